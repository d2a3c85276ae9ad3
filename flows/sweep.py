"""The sweep flow: wiring only. A grid of compress runs under one parent MLflow run.

points of the grid -> (work pool: deploy the compress flow) -> each point [reuse a finished run with its key, or
run it: a deployment run on the pool, else a compress subflow here; bounded by a Prefect global concurrency
limit] -> parent run: table + Pareto plot -> optional: the best point passing the gates gets an alias.
"""

from __future__ import annotations

import os
import socket
import time
from functools import partial
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows.compress import compress_flow
from flows.deployments import COMPRESS
from infra.sweep import SweepConfig, SweepPoint
from infra.version import code_digest
from tasks.sweep import (
    PointRun,
    deploy_point_flow,
    log_sweep,
    open_sweep_run,
    prepare_concurrency_limit,
    promote_best,
    run_deployment_point,
    run_point,
)

_PROJECT_ROOT = Path(__file__).resolve().parents[1]


class SweepSummary(BaseModel):
    name: str
    parent_run_id: str
    rows: list[dict[str, Any]]
    counts: dict[str, int]
    promoted: dict[str, Any] | None = None


@flow(name="sweep", persist_result=False)
def sweep_flow(sweep: SweepConfig, source: str = str(_PROJECT_ROOT)) -> SweepSummary:
    """Run every point of `sweep` as an ordinary compress run; report them together. `source`: where pool
    workers pull the flow code from (this checkout by default; a git URL for workers on other machines)."""
    # 1. the points, each keyed on its config, the source model's content and the code
    points = sweep.points()
    keys = [point_key(p) for p in points]
    parent = open_sweep_run(sweep, len(points), str(flow_run.id))
    prepare_concurrency_limit(sweep)
    # 2. every point, on the pool's workers (in parallel, up to the limit) or one after another here (points in one
    #    process would share its model hand-off)
    if sweep.work_pool:
        deployment = deploy_point_flow(sweep, source, COMPRESS.entrypoint)
        on_pool = partial(run_deployment_point, deployment)
        futures = [run_point.submit(p, k, parent, sweep, on_pool) for p, k in zip(points, keys, strict=True)]
        rows = [f.result() for f in futures]
    else:
        rows = [run_point(p, k, parent, sweep, run_here) for p, k in zip(points, keys, strict=True)]
    # 3. the parent run's table and Pareto plot; the best point passing the gates promoted
    counts = log_sweep(parent, sweep, rows)
    promoted = promote_best(sweep, rows)
    return SweepSummary(name=sweep.name, parent_run_id=parent, rows=rows, counts=counts, promoted=promoted)


def run_here(point: SweepPoint) -> PointRun:
    """`point` as a compress subflow in this process (the sweep's own flow run is its parent)."""
    started = time.perf_counter()
    state = compress_flow(point.config, return_state=True)
    state.result()  # raises the point's own error
    return PointRun(str(state.state_details.flow_run_id), f"subflow in {socket.gethostname()}:{os.getpid()}",
                    time.perf_counter() - started)


def point_key(point: SweepPoint) -> str:
    from infra.model_source import local_model_dir
    from pip_core import io as core_io

    return point.key(core_io.model_fingerprint(local_model_dir(point.config.model)), code_digest())
