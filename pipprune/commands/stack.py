"""`pipprune stack up|down|status`: the embedded local stack on 127.0.0.1."""

from __future__ import annotations

import json

import typer

app = typer.Typer(no_args_is_help=True)


def _stack():  # noqa: ANN202
    from infra.settings import Settings, apply_process_env
    from infra.stack import LocalStack

    settings = Settings()
    apply_process_env(settings)
    return LocalStack(settings)


def _print(statuses, as_json: bool) -> None:  # noqa: ANN001
    from infra.stack import LocalStack

    if as_json:
        print(json.dumps(LocalStack.as_dicts(statuses), indent=1))
        return
    for s in statuses:
        mark = typer.style("up  ", fg=typer.colors.GREEN) if s.up else typer.style("down", fg=typer.colors.RED)
        typer.echo(f"{mark} {s.name:8s} {s.url:32s} pid={s.pid or '-'}  log={s.log}")


@app.command()
def up(json_out: bool = typer.Option(False, "--json")) -> None:
    """Start (or reuse) the S3, MLflow and Prefect servers and wait until they are healthy."""
    from infra.stack import StackError

    stack = _stack()
    try:
        statuses = stack.up(wait=True)
    except StackError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    _print(statuses, json_out)
    if not json_out:
        typer.echo("client environment:")
        for key, value in stack.client_env().items():
            if not key.startswith("AWS_"):
                typer.echo(f"  export {key}={value}")


@app.command()
def down() -> None:
    """Stop every server the stack started (no orphan processes)."""
    _stack().down()
    typer.echo("stack stopped")


@app.command()
def status(json_out: bool = typer.Option(False, "--json")) -> None:
    """Show each service; exit 1 if any is down."""
    statuses = _stack().status()
    _print(statuses, json_out)
    if not all(s.up for s in statuses):
        raise typer.Exit(1)
