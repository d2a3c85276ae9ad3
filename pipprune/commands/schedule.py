"""`pipprune schedule`: compress on a cron schedule (served here, or deployed to a work pool)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipprune.commands.common import (
    check_inputs,
    check_out,
    fail,
    runtime,
    validation_message,
)


def schedule(
    config: Path = typer.Option(..., help="YAML/JSON compress config (same keys as `compress`)"),
    cron: str = typer.Option(..., help="cron expression, e.g. '0 3 * * 1'"),
    name: str = typer.Option("scheduled-compress", help="deployment name"),
    work_pool: Optional[str] = typer.Option(None, help="deploy to this Prefect work pool instead of serving here"),
    out: Optional[Path] = typer.Option(None, help="copy each run's final model here (replacing the previous run's "
                                       "copy; a directory pipprune did not write is refused)"),
    auto_stack: Optional[bool] = typer.Option(None, "--auto-stack/--no-auto-stack",
                                              help="start the embedded stack if it is down [default: true]"),
) -> None:
    """Run compress on a cron schedule: served by this process, or by a team's work pool workers."""
    from pydantic import ValidationError

    from infra.config import load_config_file

    try:
        from prefect.client.schemas.schedules import CronSchedule

        CronSchedule(cron=cron)
        cfg = load_config_file(config)
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        fail(f"{config}: " + validation_message(exc) if isinstance(exc, ValidationError) else validation_message(exc))
    out_dir = check_out(out, overwrite=True)
    check_inputs(cfg)
    runtime(auto_stack)
    from flows.schedule import deploy_to_pool, serve_locally
    from infra.runtime import prefect_settings

    with prefect_settings():
        if work_pool:
            deployment_id = deploy_to_pool(cfg, cron, name, work_pool, out_dir)
            typer.echo(f"deployment compress/{name} ({deployment_id}) on pool {work_pool!r}, cron {cron!r}")
        else:
            typer.echo(f"serving compress/{name} on cron {cron!r} (Ctrl-C to stop)")
            serve_locally(cfg, cron, name, out_dir)
