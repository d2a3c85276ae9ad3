"""A fork server for the tests' `pipprune` CLI runs: each run is still its own process, without the import cost.

`python -m pipprune.cli compress ...` spends most of its ~14 CPU-seconds importing transformers, Prefect and
MLflow; the suite runs the CLI about a hundred times. This server imports the CLI once, then forks a child per
request: the child takes the request's environment, working directory and arguments, writes its stdout and stderr
to the files named in the request, and exits through `pipprune.cli.main` as the console script does (atexit
handlers, flushed logs, its own exit code). What a fresh process reads at import time is the server's: the
client (`tests.helpers.cli`) only sends requests whose environment differs from the server's in the variables
read per call (`LATE_READ`) and runs every other one as a plain subprocess.

Protocol: one JSON object per line on stdin (args, env, cwd, stdout, stderr, timeout), one JSON reply per line
on stdout ({"returncode": int} or {"timeout": true}). The server never starts a thread, so forking is safe.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import sys
import threading
import traceback
from typing import NoReturn

#: environment variables a CLI run reads after import (pydantic-settings, boto3, MLflow per call; Prefect's
#: settings are refreshed in the child), and pytest's per-test marker that nothing reads: only these may differ
#: between the server and a request
LATE_READ = ("PIPPRUNE_", "PREFECT_", "MLFLOW_", "AWS_", "PYTEST_CURRENT_TEST")


def _child(request: dict) -> NoReturn:
    """Become the requested CLI run, then exit with its code."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["pipprune", *request["args"]]

    import prefect.context
    import prefect.logging.configuration

    prefect.context.refresh_global_settings_context()
    prefect.logging.configuration.setup_logging()
    from pipprune.cli import main

    try:
        main(request["args"])
    except SystemExit as done:
        _exit(done.code)
    except BaseException:  # noqa: BLE001  (--debug lets tracebacks out, as the console script would print them)
        traceback.print_exc()
        _exit(1)


def _exit(code: object) -> NoReturn:
    """Exit as the interpreter does (threads joined, atexit handlers, streams flushed), less module teardown:
    seconds of garbage collection over torch's object graph that no test can observe."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # what Py_Finalize does first: wait for non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)


def _wait(pid: int, timeout: float) -> dict:
    """The child's exit code, or kill it once `timeout` has passed (as subprocess.run does)."""
    fd = os.pidfd_open(pid)
    try:
        if not select.select([fd], [], [], timeout)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return {"returncode": os.waitstatus_to_exitcode(status)}


def _warm() -> None:
    """Import what a compress run imports, inside its functions too (pipprune.precompile's list), or every forked
    run would still pay for it; a module that starts a thread would make forking unsafe, so that stops the server."""
    from pipprune.precompile import import_run_modules

    import_run_modules()
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        raise RuntimeError(f"importing what a run imports started threads {threads}: forking is not safe")


def serve() -> None:
    before = dict(os.environ)
    _warm()  # the heavy imports every compress run needs, done once

    # some libraries set variables when imported (KMP_DUPLICATE_LIB_OK, HF_XET_HIGH_PERFORMANCE): a fresh process
    # gets them too, so the client counts them as the server's own
    set_on_import = {k: v for k, v in os.environ.items() if before.get(k) != v}
    print(json.dumps({"ready": os.getpid(), "set_on_import": set_on_import}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps(_wait(pid, request["timeout"])), flush=True)


if __name__ == "__main__":
    serve()
