"""The CLI contract for people and schedulers, through the command line run as its own process.

Bad input fails before any model is loaded (exit 2, one line naming the file/field, no traceback,
nothing registered); `--out` never touches what pipprune did not write; `--json` puts exactly one
JSON document on stdout; a non-terminal log gets one plain line per step; the embedded stack is
started only with a notice, or refused with exit 3.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.stack import free_port
from tests.conftest import stack_settings
from tests.helpers import NO_SERVING, ROOT, cli, stack_settings_env

PRECIOUS = b"\x00user data \xff\xfe that pipprune must never touch\n"


def _registry(env: dict[str, str]) -> list[tuple[str, str]]:
    """Every registered (model, version) on the stack's MLflow."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    return sorted((v.name, v.version) for m in client.search_registered_models()
                  for v in client.search_model_versions(f"name = '{m.name}'"))


def _foreground_sigint() -> None:
    """Ctrl-C as at a terminal: a shell starts background jobs (`make test &`, CI runners) with SIGINT ignored,
    the child inherits that, and Python then installs no KeyboardInterrupt handler; a foreground run has it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _lean(ref: Path, name: str, *extra: str) -> list[str]:
    return ["compress", "--model", str(ref), "--calibration", str(ref), "--ratio", "0.2", "--iterations", "2",
            "--n-samples", "4", "--tasks", "pipprune_wordnet_cloze", "--include-path", str(ref / "tasks"),
            "--eval-limit", "10", "--name", name, *NO_SERVING, *extra]


# ---------------------------------------------------------------------------------------- bad input, exit 2
def _truncated(ref: Path, tmp: Path) -> Path:
    bad = tmp / "truncated"
    bad.mkdir()
    for path in ref.glob("*.json"):
        (bad / path.name).write_bytes(path.read_bytes())
    (bad / "model.safetensors").write_bytes((ref / "model.safetensors").read_bytes()[:100_000])
    return bad


def _user_dir(tmp: Path) -> Path:
    user = tmp / "my-models"
    (user / "llama-finetune").mkdir(parents=True)
    (user / "llama-finetune" / "model.safetensors").write_bytes(PRECIOUS * 3)
    (user / "notes.txt").write_bytes(PRECIOUS)
    return user


def _user_file(tmp: Path) -> Path:
    (tmp / "model.bin").write_bytes(PRECIOUS)
    return tmp / "model.bin"


def _yaml_error(ref: Path, tmp: Path) -> Path:
    (tmp / "job.yaml").write_text(f"model: {ref}\ncalibration: {ref}\nratio: [0.2\nunit: mlp\n")
    return tmp / "job.yaml"


BAD_INPUT = {
    # case: (args from (ref, tmp), expected message parts)
    "--out a non-empty user directory": (lambda r, t: _lean(r, "bad-out", "--out", str(_user_dir(t))),
                                         ["non-empty directory that pipprune did not write", "my-models"]),
    "--out a user directory with --overwrite": (
        lambda r, t: _lean(r, "bad-out", "--out", str(_user_dir(t)), "--overwrite"),
        ["non-empty directory that pipprune did not write"]),
    "--out a file": (lambda r, t: _lean(r, "bad-out", "--out", str(_user_file(t))), ["model.bin is a file"]),
    "unknown task": (lambda r, t: ["compress", "--model", str(r), "--calibration", str(r), "--tasks", "no_such_task",
                                   "--include-path", str(r / "tasks"), "--name", "bad-task"],
                     ["unknown lm-eval task(s) no_such_task", "--tasks"]),
    "truncated weights": (lambda r, t: ["compress", "--model", str(_truncated(r, t)), "--calibration", str(r),
                                        "--name", "bad-weights"],
                          ["model.safetensors is truncated or corrupt", "re-download"]),
    "YAML syntax error": (lambda r, t: ["compress", "--model", str(r), "--config", str(_yaml_error(r, t))],
                          ["job.yaml: YAML syntax error at line 4", "fix the file"]),
    "missing model path": (lambda r, t: ["compress", "--model", str(t / "no-such-model")],
                           ["model not found", "no-such-model"]),
}


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_refused_before_any_work(case, stack_env, tiny_reference_dir, tmp_path):
    env = {**os.environ, **stack_env, "PIPPRUNE_HOME": str(tmp_path / "home")}
    build, expected = BAD_INPUT[case]
    args = build(tiny_reference_dir, tmp_path)
    before_files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    before_registry = _registry(env)
    done = cli(env, *args, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    error = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, done.stderr[-3000:]
    for part in expected:
        assert part in error[0], error[0]
    assert "--calibration is required" not in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert _registry(env) == before_registry
    assert not (tmp_path / "home" / "work").exists()  # no calibration, scoring or checkpoint started
    for path, data in before_files.items():  # every file the user had is there, byte for byte
        assert path.read_bytes() == data, path


def test_debug_shows_the_traceback_bad_input_does_not(tiny_reference_dir, tmp_path):
    env = {**os.environ, "PIPPRUNE_HOME": str(tmp_path / "home")}
    args = ["compress", "--model", str(tiny_reference_dir), "--config", str(_yaml_error(tiny_reference_dir, tmp_path))]
    plain = cli(env, *args)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr, plain.stderr
    debug = cli(env, *args, "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "YAML syntax error" in debug.stderr, debug.stderr


def test_unreachable_remote_services_exit_3_and_start_nothing(tiny_reference_dir, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "PIPPRUNE_HOME": str(tmp_path / "home"), "PIPPRUNE_S3_ENDPOINT_URL": dead,
           "PIPPRUNE_MLFLOW_TRACKING_URI": dead, "PIPPRUNE_PREFECT_API_URL": dead + "/api",
           "PIPPRUNE_S3_MAX_ATTEMPTS": "1", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    done = cli(env, *_lean(tiny_reference_dir, "dead"), "--json", timeout=300)
    assert done.returncode == 3, done.stderr[-3000:]
    assert f"cannot reach S3 at {dead}" in done.stderr and "Traceback" not in done.stderr
    document = json.loads(done.stdout)
    assert document == {"schema": 1, "ok": False, "exit_code": 3, "error": document["error"]}
    assert not (tmp_path / "home" / "stack").exists()  # a remote URI never starts the embedded stack
    assert not (tmp_path / "home" / "work").exists()


# ------------------------------------------------------------------------ full runs: --json, logs, --out
def _pipe_to_json_load(env: dict[str, str], args: list[str], tmp: Path) -> tuple[int, dict, str]:
    """`pipprune ... --json | python -c "import json,sys; json.load(sys.stdin)"`, literally; stdout teed."""
    script = (f"set -o pipefail; {sys.executable} -m pipprune.cli {' '.join(map(_quote, args))} 2>{tmp / 'err.log'} "
              f"| tee {tmp / 'out.json'} | {sys.executable} -c 'import json,sys; json.load(sys.stdin)'")
    done = subprocess.run(["bash", "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    stderr = (tmp / "err.log").read_text()
    text = (tmp / "out.json").read_text()
    return done.returncode, (json.loads(text) if text.strip() else {}), stderr


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _assert_plain_log(stderr: str, steps: int) -> None:
    lines = stderr.splitlines()
    assert max(map(len, lines)) <= 1000, max(lines, key=len)[:300]
    assert "\r" not in stderr  # no progress-bar redraws in a non-terminal log
    for i in range(1, steps + 1):
        assert any(f"step {i}/{steps}: scored" in line and "params" in line and "elapsed" in line for line in lines), \
            stderr[-3000:]


@pytest.mark.slow
@pytest.mark.stack
def test_json_with_running_stack_then_out_and_overwrite(stack_env, tiny_reference_dir, tmp_path):
    env = {**os.environ, **stack_env, "PIPPRUNE_HOME": str(tmp_path / "home")}
    out = tmp_path / "pruned"
    rc, summary, stderr = _pipe_to_json_load(env, _lean(tiny_reference_dir, "cli-json", "--out", str(out), "--json"),
                                             tmp_path)
    assert rc == 0, stderr[-3000:]
    assert summary["schema"] == 1 and summary["ok"] is True and summary["registered_model"] == "cli-json"
    assert "View run" in stderr  # MLflow writes it to sys.stdout: it went to stderr, not into the document
    assert "starting the embedded stack" not in stderr
    _assert_plain_log(stderr, 2)
    provenance = json.loads((out / "pipprune_provenance.json").read_text())
    assert provenance["run_key"] == summary["run_key"] and "model.safetensors" in provenance["pipprune_output"]["files"]

    # a previous pipprune output: refused without --overwrite, replaced with it; nothing else is touched
    (tmp_path / "neighbour.txt").write_bytes(PRECIOUS)
    registry = _registry(env)
    again = cli(env, *_lean(tiny_reference_dir, "cli-json", "--out", str(out)), timeout=600)
    assert again.returncode == 2 and "previous pipprune output; pass --overwrite" in again.stderr, again.stderr[-2000:]
    assert _registry(env) == registry
    replaced = cli(env, *_lean(tiny_reference_dir, "cli-json", "--out", str(out), "--overwrite", "--json"),
                   timeout=600)
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert json.loads(replaced.stdout)["model_version"] == summary["model_version"]  # the identical run, cached
    assert (tmp_path / "neighbour.txt").read_bytes() == PRECIOUS
    assert sorted(p.name for p in tmp_path.iterdir() if ".pipprune-" in p.name) == []  # no partial/old copies left

    # a previous output someone added a file to is not pipprune's alone any more: refused even with --overwrite
    (out / "my-notes.md").write_bytes(PRECIOUS)
    refused = cli(env, *_lean(tiny_reference_dir, "cli-json", "--out", str(out), "--overwrite"), timeout=600)
    assert refused.returncode == 2 and "my-notes.md" in refused.stderr, refused.stderr[-2000:]
    assert (out / "my-notes.md").read_bytes() == PRECIOUS and (out / "model.safetensors").is_file()

    # Ctrl-C mid-run: exit 130, the one document says so, the MLflow run is marked FAILED
    log = tmp_path / "interrupted.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pipprune.cli", *_lean(tiny_reference_dir, "cli-int", "--seed",
                                                                               "7", "--json")],
                                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                preexec_fn=_foreground_sigint)
        deadline = time.monotonic() + 400
        while "step 1/2" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, log.read_text()[-3000:]
    assert json.loads(stdout) == {"schema": 1, "ok": False, "exit_code": 130, "error": "interrupted"}
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="params.registered_model_name = 'cli-int'")
    assert [r.info.status for r in runs] == ["FAILED"]
    assert not [v for v in _registry(env) if v[0] == "cli-int"]


def _fresh_stack_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPPRUNE_", "MLFLOW_", "PREFECT_", "AWS_"))}
    env.update(stack_settings_env(stack_settings(home)))
    return env


@pytest.mark.slow
@pytest.mark.stack
def test_json_with_auto_started_stack_and_no_auto_stack(tiny_reference_dir, tmp_path):
    home = tmp_path / "home"
    env = _fresh_stack_env(home)
    refused = cli(env, *_lean(tiny_reference_dir, "cli-auto"), "--no-auto-stack", timeout=300)
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert "is not running and auto-start is off" in refused.stderr and "pipprune stack up" in refused.stderr
    assert not (home / "stack" / "state.json").exists() and not (home / "work").exists()
    off = cli({**env, "PIPPRUNE_AUTO_STACK": "false"}, *_lean(tiny_reference_dir, "cli-auto"), timeout=300)
    assert off.returncode == 3 and "auto-start is off" in off.stderr
    try:
        rc, summary, stderr = _pipe_to_json_load(env, _lean(tiny_reference_dir, "cli-auto", "--method", "magnitude",
                                                            "--json"), tmp_path)
        assert rc == 0, stderr[-3000:]
        assert summary["schema"] == 1 and summary["registered_model"] == "cli-auto"
        notice = f"starting the embedded stack in {home} (stop: pipprune stack down)"
        assert notice in stderr
        assert stderr.index(notice) < stderr.index("step 1/2")
        _assert_plain_log(stderr, 2)
        status = cli(env, "stack", "status", "--json")
        assert status.returncode == 0 and all(s["up"] for s in json.loads(status.stdout)["services"])
    finally:
        cli(env, "stack", "down")


# -------------------------------------------------------------------------------- infra.output_dir, direct
def _model_dir(path: Path, payload: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(payload)
    return path


def test_output_dir_writes_replaces_and_refuses(tmp_path):
    from infra.output_dir import OutputDirError, check_output_dir, foreign_files, write_output_dir

    first, second = _model_dir(tmp_path / "a", b"first"), _model_dir(tmp_path / "b", b"second")
    out = tmp_path / "dest" / "model"
    write_output_dir(first, out, {"run_key": "r1"})
    assert (out / "model.safetensors").read_bytes() == b"first" and foreign_files(out) == []
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    with pytest.raises(OutputDirError, match="pass --overwrite"):
        write_output_dir(second, out, {"run_key": "r2"})
    write_output_dir(second, out, {"run_key": "r2"}, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == b"second"
    assert json.loads((out / "pipprune_provenance.json").read_text())["run_key"] == "r2"
    assert [p.name for p in out.parent.iterdir()] == ["model"]  # no partial or old copy left beside it

    (out / "model.safetensors").write_bytes(b"edited by hand")  # a changed file is no longer pipprune's
    with pytest.raises(OutputDirError, match="model.safetensors"):
        check_output_dir(out, overwrite=True)

    empty = tmp_path / "empty"
    empty.mkdir()
    write_output_dir(first, empty, {})  # an empty directory is fine
    assert (empty / "model.safetensors").read_bytes() == b"first"

    link = tmp_path / "link"
    link.symlink_to(first)
    with pytest.raises(OutputDirError, match="symbolic link"):
        check_output_dir(link, overwrite=True)
    assert (first / "model.safetensors").read_bytes() == b"first"

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "pipprune_provenance.json").write_text('{"run_key": "not a pipprune marker"}')
    (foreign / "weights.bin").write_bytes(PRECIOUS)
    with pytest.raises(OutputDirError, match="did not write"):
        write_output_dir(first, foreign, {}, overwrite=True)
    assert (foreign / "weights.bin").read_bytes() == PRECIOUS
