"""`pipprune stack up|down|status`: the embedded local stack on 127.0.0.1."""

from __future__ import annotations

import time

import typer

from pipprune.commands.common import BAD_INPUT, UNREACHABLE, fail, json_output

app = typer.Typer(no_args_is_help=True)


def _stack():
    from infra.settings import Settings, apply_process_env
    from infra.stack import LocalStack

    settings = Settings()
    apply_process_env(settings)
    return LocalStack(settings)


def _print(statuses, doc) -> None:  # noqa: ANN001
    from infra.stack import LocalStack

    if doc.enabled:
        doc.emit({"ok": all(s.up for s in statuses), "services": LocalStack.as_dicts(statuses)})
        return
    for s in statuses:
        mark = typer.style("up  ", fg=typer.colors.GREEN) if s.up else typer.style("down", fg=typer.colors.RED)
        typer.echo(f"{mark} {s.name:8s} {s.url:30s} port={s.port:<6d} pid={s.pid or '-':<8} rss={s.rss_mb:7.1f} MB  "
                   f"data={s.data_dir}" + (f"  ({s.detail})" if s.detail and not s.up else ""))
    typer.echo(f"total rss={sum(s.rss_mb for s in statuses):.1f} MB")


@app.command()
def up(json_out: bool = typer.Option(False, "--json")) -> None:
    """Start (or restart) the S3, MLflow and Prefect servers on their data and wait until they are healthy."""
    from infra.signing import SigningError
    from infra.stack import StackError

    with json_output(json_out) as doc:
        stack = _stack()
        started = time.monotonic()
        try:
            statuses = stack.up(wait=True)
        except SigningError as exc:  # PIPPRUNE_SIGNING_KEY names a missing or unusable key
            fail(str(exc), code=BAD_INPUT)
        except StackError as exc:
            fail(str(exc), code=UNREACHABLE)
        _print(statuses, doc)
        if not json_out:
            typer.echo(f"healthy in {time.monotonic() - started:.1f} s; client environment "
                       f"(S3 keys stay in {stack.dir / 'credentials.json'}, mode 0600):")
            for key, value in stack.public_env().items():
                typer.echo(f"  export {key}={value}")


@app.command()
def down() -> None:
    """Stop every server the stack started (no orphan processes)."""
    _stack().down()
    typer.echo("stack stopped")


@app.command()
def status(json_out: bool = typer.Option(False, "--json")) -> None:
    """Show each service; exit 3 (a service unreachable) if any is down."""
    with json_output(json_out) as doc:
        statuses = _stack().status()
        _print(statuses, doc)
        if not all(s.up for s in statuses):
            raise typer.Exit(UNREACHABLE)


@app.command("env")
def env_cmd(json_out: bool = typer.Option(False, "--json")) -> None:
    """Print the exports a Python session needs to load registered models (`eval "$(pipprune stack env)"`).

    Includes the embedded S3 server's keys: registered versions live in S3 and MLflow's loaders
    read them directly (MLFLOW_S3_ENDPOINT_URL + AWS keys). pipprune itself runs unchanged with them set.
    """
    import shlex

    from infra.user_env import UserEnvError, user_env

    with json_output(json_out) as doc:
        try:
            exports = user_env(_stack().settings)
        except UserEnvError as exc:
            fail(str(exc), UNREACHABLE)
        if json_out:
            doc.emit({"ok": True, "env": exports})
            return
    typer.echo("# pipprune: load registered models from Python with these set (they hold S3 keys: keep them private)")
    for key, value in exports.items():
        typer.echo(f"export {key}={shlex.quote(value)}")
