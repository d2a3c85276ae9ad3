"""The `pipprune` command line: the app and `main`; each command lives in `pipprune/commands/`. Heavy imports
(torch, prefect, mlflow) happen inside commands.

Exit codes: 0 success; 1 a verification or gate failed, or a run failed; 2 bad input (named in the
message, with the fix); 3 a service unreachable; 130 interrupted. `--debug` shows tracebacks.
"""

from __future__ import annotations

import os
import sys

import typer

from pipprune.commands import compress as compress_cmd
from pipprune.commands import evaluate as evaluate_cmd
from pipprune.commands import export as export_cmd
from pipprune.commands import keys as keys_cmd
from pipprune.commands import plan as plan_cmd
from pipprune.commands import promote as promote_cmd
from pipprune.commands import reference as reference_cmd
from pipprune.commands import schedule as schedule_cmd
from pipprune.commands import stack as stack_cmd
from pipprune.commands import sweep as sweep_cmd
from pipprune.commands import trim_vocab as trim_vocab_cmd
from pipprune.commands.common import (
    BAD_INPUT,
    FAILED,
    INTERRUPTED,
    print_error,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Auditable PIP pruning of causal LMs: compress, evaluate, trace, promote.")
app.add_typer(stack_cmd.app, name="stack", help="Local S3 / MLflow / Prefect stack on 127.0.0.1.")
app.add_typer(reference_cmd.app, name="reference", help="Build the offline reference model and tasks.")
app.add_typer(keys_cmd.app, name="keys", help="The key that signs registered models (OpenSSF model-signing).")
app.command("lineage")(promote_cmd.lineage)
app.command("promote")(promote_cmd.promote)
app.command("export")(export_cmd.export)
app.command("compress")(compress_cmd.compress)
app.command("eval")(evaluate_cmd.eval_cmd)
app.command("plan")(plan_cmd.plan_cmd)
app.command("schedule")(schedule_cmd.schedule)
app.command("sweep")(sweep_cmd.sweep)
app.command("trim-vocab")(trim_vocab_cmd.trim_vocab)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="show Python tracebacks (accepted anywhere on the "
                                     "command line)")) -> None:
    """Options for every command; `--debug` itself is read by `main`."""


def main(argv: list[str] | None = None) -> None:
    """The console script: one line and an exit code for every failure; a traceback only with --debug."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if debug:
        os.environ["PIPPRUNE_DEBUG"] = "1"
    try:
        code = app(args=args, prog_name="pipprune", standalone_mode=False)
    except typer.TyperException as exc:  # usage errors: unknown option, missing value (typer's own click)
        exc.show()
        code = BAD_INPUT
    except (KeyboardInterrupt, typer.Abort):
        print_error("interrupted")
        code = INTERRUPTED
    except Exception as exc:  # the catch-all that keeps tracebacks behind --debug
        if debug:
            raise
        print_error(f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)")
        code = FAILED
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
