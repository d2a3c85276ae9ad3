"""What every command shares: exit codes, one-line errors, a stdout that holds only the JSON document, and the
checks before work (`check_out`, `check_inputs`, `runtime`: the one place a command brings the stack up).

Exit codes (documented in the README, tested in tests/test_cli_contract.py):
0 success; 1 a verification or gate failed (lineage mismatch, promotion refused) or a run failed;
2 bad input (the message names the field or file and the fix); 3 a service unreachable;
130 interrupted.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from infra.settings import Settings

OK, FAILED, BAD_INPUT, UNREACHABLE, INTERRUPTED = 0, 1, 2, 3, 130
#: version of every `--json` document; bump when a field changes meaning or disappears
JSON_SCHEMA = 1


class CliError(typer.Exit):
    """A failure already reported as one line on stderr; click turns it into the exit code."""

    def __init__(self, message: str, code: int = BAD_INPUT) -> None:
        super().__init__(code)
        self.message, self.code = message, code


def fail(message: str, code: int = BAD_INPUT) -> None:
    """Stop the command: `message` goes to stderr as one line, the process exits with `code`.

    With `--debug` (PIPPRUNE_DEBUG=1) the exception being handled, if any, is printed first.
    """
    if os.environ.get("PIPPRUNE_DEBUG") == "1" and sys.exc_info()[0] is not None:
        import traceback

        traceback.print_exc(file=sys.stderr)
    print_error(message)
    raise CliError(message, code)


def print_error(message: str) -> None:
    """On stderr; while the console is redirected to a log file (pipprune.commands.console), on the terminal too."""
    from pipprune.commands.console import ACTIVE

    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    for console in ACTIVE[-1:]:
        sys.stderr.flush()
        console.err.write(f"error: {message}\n")
        console.err.flush()


class JsonOut:
    """The process's real stdout, reserved for one JSON document; everything else printed goes to stderr.

    File descriptor 1 itself is pointed at stderr, so output from libraries that print (MLflow's
    "View run ... at" lines), hold their own reference to stdout, or write from C is moved too.
    It stays there until the process exits, so nothing printed at exit can follow the document.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.emitted, self._fd = enabled, False, None
        if enabled:
            sys.stdout.flush()
            self._fd = os.dup(1)
            os.dup2(2, 1)
            sys.stdout = sys.stderr

    def emit(self, document: dict[str, Any]) -> None:
        """Write the one document (with `"schema"`) to the real stdout and close it."""
        if not self.enabled or self.emitted:
            return
        data = (json.dumps({"schema": JSON_SCHEMA, **document}, indent=1, default=str) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        os.close(self._fd)
        self.emitted = True


@contextmanager
def json_output(enabled: bool) -> Iterator[JsonOut]:
    """Route logs away from stdout while a `--json` command runs; a failure still yields one document.

    On failure the document is `{"schema": 1, "ok": false, "exit_code": N, "error": "..."}`.
    """
    out = JsonOut(enabled)
    try:
        yield out
    except CliError as exc:
        out.emit({"ok": False, "exit_code": exc.code, "error": exc.message})
        raise
    except (KeyboardInterrupt, typer.Abort):
        out.emit({"ok": False, "exit_code": INTERRUPTED, "error": "interrupted"})
        raise
    except typer.Exit as exc:
        out.emit({"ok": exc.exit_code == 0, "exit_code": exc.exit_code})
        raise
    except Exception as exc:
        out.emit({"ok": False, "exit_code": FAILED, "error": f"{type(exc).__name__}: {exc}"})
        raise


def validation_message(exc: Exception) -> str:
    """A pydantic error as `field: problem; field: problem` (no traceback, no URLs)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
    return str(exc)


def config_help(path: str, note: str = "") -> str:
    """An option's help text read from the job config model (description and default), so the CLI and the
    config file never disagree. `path` is the field's place in the config, e.g. "scoring.unit"."""
    from pydantic_core import PydanticUndefined

    from infra.config import CompressConfig

    model: type = CompressConfig
    *groups, name = path.split(".")
    for group in groups:
        model = model.model_fields[group].annotation
    field = model.model_fields[name]
    text = " ".join(part for part in (field.description or "", note) if part)
    if field.default is not PydanticUndefined and field.default not in (None, ()):
        text += f" (default: {field.default})"
    return text


def check_out(out: Path | None, overwrite: bool) -> str | None:
    from infra.output_dir import OutputDirError, check_output_dir

    if out is None:
        return None
    try:
        return str(check_output_dir(out, overwrite))
    except OutputDirError as exc:
        fail(str(exc))


def check_inputs(cfg):  # noqa: ANN001, ANN201 - CompressConfig -> BudgetPlan, imported where used
    """Model, weights, tokenizer, calibration, evaluation tasks, budget: before any server is started or contacted.
    The budget's plan."""
    from infra.preflight import PreflightError, check_inputs

    try:
        return check_inputs(cfg)
    except (PreflightError, ValueError, OSError) as exc:
        fail(str(exc))


def runtime(auto_stack: bool | None = None, check: bool = True) -> Settings:
    """Settings applied, the stack up (or started, or refused), and with `check` S3/MLflow/Prefect answering with
    these keys: every command that needs the stack comes here; a stack down or unreachable is exit code 3."""
    from pydantic import ValidationError

    from infra.preflight import PreflightError, ServiceUnreachable, check_services
    from infra.runtime import StackDown, prepare_runtime
    from infra.stack import StackError

    try:
        settings = prepare_runtime(auto_stack=auto_stack)
        if check:
            check_services(settings)
    except ValidationError as exc:
        fail("settings (PIPPRUNE_* environment): " + validation_message(exc))
    except (ServiceUnreachable, StackDown, StackError) as exc:
        fail(str(exc), code=UNREACHABLE)
    except PreflightError as exc:
        fail(str(exc))
    return settings




def home() -> Path:
    """PIPPRUNE_HOME as the settings read it (a bad value is reported later, with the other settings)."""
    from pydantic import ValidationError

    from infra.settings import Settings

    try:
        return Settings().home
    except ValidationError:
        return Path(".pipprune").resolve()
