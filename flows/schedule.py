"""Scheduled compress runs as Prefect deployments: served in-process, or deployed to a work pool."""

from __future__ import annotations

from pathlib import Path

from flows.compress import compress_flow
from flows.deployments import COMPRESS
from infra.config import CompressConfig

_PROJECT_ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = COMPRESS.entrypoint


def _parameters(config: CompressConfig, out_dir: str | None) -> dict:
    # each scheduled run replaces the previous run's copy (only ever a pipprune output: see infra.output_dir)
    return {"config": config.model_dump(mode="json"), "out_dir": out_dir, "overwrite": out_dir is not None}


def deploy_to_pool(config: CompressConfig, cron: str | None, name: str, work_pool: str,
                   out_dir: str | None = None, source: Path = _PROJECT_ROOT) -> str:
    """Register a deployment that workers of `work_pool` run on `cron`; returns the deployment id.

    The flow code is pulled from `source` (this checkout by default; a git URL for remote workers).
    """
    from prefect import flow

    deployable = flow.from_source(source=str(source), entrypoint=ENTRYPOINT)
    deployment_id = deployable.deploy(name=name, work_pool_name=work_pool, cron=cron,
                                      parameters=_parameters(config, out_dir), build=False, push=False,
                                      print_next_steps=False)
    return str(deployment_id)


def serve_locally(config: CompressConfig, cron: str, name: str, out_dir: str | None = None) -> None:
    """Serve the deployment from this process (blocks); needs a real Prefect server, not the ephemeral one."""
    compress_flow.serve(name=name, cron=cron, parameters=_parameters(config, out_dir))
