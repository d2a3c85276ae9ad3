"""`pipprune sweep`: a grid of compress runs (on a Prefect work pool, or here) compared in one parent MLflow run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipprune.commands.common import FAILED, UNREACHABLE, fail, json_output, validation_message


def sweep(
    config: Path = typer.Option(..., help="sweep file: base (a compress config), grid (setting -> values), and "
                                "optionally work_pool, concurrency, gates, alias, name (see infra/sweep.py)"),
    work_pool: Optional[str] = typer.Option(None, help="run the points on this Prefect work pool's workers "
                                            "(overrides the file's work_pool)"),
    local: bool = typer.Option(False, "--local", help="run the points here, one after another, whatever the file "
                               "says about a work pool"),
    json_out: bool = typer.Option(False, "--json", help="print the sweep's table as one JSON document"),
    auto_stack: Optional[bool] = typer.Option(None, "--auto-stack/--no-auto-stack",
                                              help="start the embedded stack if it is down [default: true]"),
) -> None:
    """Run every point of a grid as an ordinary compress run; rerunning reuses finished points.

    Exit 1 when any point failed (the others still ran and are in the table).
    """
    from pydantic import ValidationError

    from infra.sweep import SweepConfig

    with json_output(json_out) as doc:
        try:
            spec = SweepConfig.from_file(config)
            if work_pool or local:
                spec = spec.model_copy(update={"work_pool": None if local else work_pool})
            points = spec.points()
        except ValidationError as exc:
            fail(f"{config}: " + validation_message(exc))
        except (ValueError, FileNotFoundError) as exc:
            fail(validation_message(exc) if not isinstance(exc, FileNotFoundError) else str(exc))
        if spec.gates is not None and not Path(spec.gates).is_file():
            fail(f"{config}: gates file not found: {spec.gates}")
        typer.echo(f"sweep {spec.name}: {len(points)} points", err=True)
        _runtime(auto_stack)
        from flows.sweep import sweep_flow
        from infra.runtime import prefect_settings
        from infra.sweep import markdown_table

        with prefect_settings():
            summary = sweep_flow(spec)
        if json_out:
            doc.emit({"ok": not summary.counts.get("failed"), **summary.model_dump(mode="json")})
        else:
            typer.echo(markdown_table(summary.rows), nl=False)
            typer.echo(f"sweep {spec.name}: {summary.counts} (MLflow parent run {summary.parent_run_id})")
            if summary.promoted:
                typer.echo(f"best point passing the gates: {summary.promoted}")
        if summary.counts.get("failed"):
            raise typer.Exit(FAILED)


def _runtime(auto_stack: bool | None):
    from infra.preflight import ServiceUnreachable, check_services
    from infra.runtime import StackDown, prepare_runtime
    from infra.stack import StackError

    try:
        settings = prepare_runtime(auto_stack=auto_stack)
        check_services(settings)
    except (ServiceUnreachable, StackDown, StackError) as exc:
        fail(str(exc), code=UNREACHABLE)
    return settings
