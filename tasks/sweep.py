"""Sweep tasks: run one point (a compress deployment run on a work pool, or a compress subflow here), find a
finished point's MLflow run, and the parent run's table, Pareto plot and best-point promotion.

Points are found again by MLflow tags, not by Prefect results: every compress run tags its MLflow run with
its Prefect flow run id (lineage), and the sweep adds `pipprune.sweep.point_key` plus `mlflow.parentRunId`
(which nests it under the sweep's parent run in the MLflow UI).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task

from infra import sweep as sweep_rules
from infra import tags as tag_names
from infra.mlflow_utils import mlflow_client
from infra.sweep import SweepConfig, SweepPoint
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.tracking import EXPERIMENT, experiment_id

log = logging.getLogger(__name__)

POINT_KEY_TAG = tag_names.SWEEP_POINT_KEY
SWEEP_TAG = tag_names.SWEEP
PARENT_TAG = "mlflow.parentRunId"
FLOW_RUN_TAG = tag_names.PREFECT_FLOW_RUN_ID
#: where the point ran: the work pool worker's process (host:pid), or this process for subflows
WHERE_TAG = tag_names.SWEEP_RAN_IN
#: the point's flow run from start to end in seconds (inputs and model loads included, the worker's process start-up not)
WALL_TAG = tag_names.SWEEP_WALL_S


def limit_name(sweep: SweepConfig) -> str:
    return f"pipprune-sweep-{sweep.name}"


@task(name="open-sweep-run", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def open_sweep_run(sweep: SweepConfig, n_points: int, flow_run_id: str) -> str:
    """The sweep's parent MLflow run (in the compress experiment, so the points nest under it)."""
    from mlflow.entities import Param

    client = mlflow_client()
    run = client.create_run(experiment_id(client), run_name=f"sweep-{sweep.name}",
                            tags={SWEEP_TAG: sweep.name, tag_names.SWEEP_ROLE: "parent", FLOW_RUN_TAG: flow_run_id,
                                  "mlflow.note.content": f"sweep {sweep.name}: {n_points} points over "
                                  + ", ".join(f"{k} in {v}" for k, v in sweep.grid.items())})
    client.log_batch(run.info.run_id, params=[
        Param("grid", json.dumps(sweep.grid)[:6000]), Param("points", str(n_points)),
        Param("work_pool", sweep.work_pool or "(this process)"), Param("concurrency", str(sweep.concurrency))])
    return run.info.run_id


@task(name="prepare-concurrency-limit")
def prepare_concurrency_limit(sweep: SweepConfig) -> str:
    """Create (or resize) the Prefect global concurrency limit that bounds how many points run at once."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(limit_name(sweep), sweep.concurrency)
    return limit_name(sweep)


@dataclass(frozen=True)
class PointRun:
    """A point's finished compress flow run: its id, where it ran, and its wall time (None when unknown)."""

    flow_run_id: str
    where: str
    wall_s: float | None


#: runs one point's compress flow to its end and says which flow run it was (the flow layer supplies it:
#: a deployment run on a work pool, or a compress subflow in this process)
Launch = Callable[[SweepPoint], PointRun]


@task(name="deploy-sweep-point")
def deploy_point_flow(sweep: SweepConfig, source: str, entrypoint: str) -> str:
    """The compress deployment (`entrypoint`) the points run as on `sweep.work_pool`, code pulled from `source`."""
    from prefect import flow

    deployable = flow.from_source(source=source, entrypoint=entrypoint)
    with contextlib.redirect_stdout(sys.stderr):  # Prefect prints a table: stdout is the sweep's own
        deployable.deploy(name=sweep.deployment, work_pool_name=sweep.work_pool, build=False, push=False,
                          print_next_steps=False, ignore_warnings=True)
    return f"compress/{sweep.deployment}"


def finished_run(point_key: str) -> Any | None:
    """The newest FINISHED compress run already tagged with `point_key`, or None."""
    client = mlflow_client()
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id],
                              f"tags.`{POINT_KEY_TAG}` = '{point_key}' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def _run_of_flow_run(flow_run_id: str) -> Any | None:
    client = mlflow_client()
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


@task(name="run-sweep-point", task_run_name="point {point.label}")
def run_point(point: SweepPoint, point_key: str, parent_run_id: str, sweep: SweepConfig,
              launch: Launch) -> dict[str, Any]:
    """One point: reused when a finished run has its key; else run (bounded by the sweep's concurrency limit).

    Never raises: a failed point is a row with status `failed` and its error, so the other points go on.
    """
    from prefect.concurrency.sync import concurrency

    from infra.preflight import check_inputs

    started = time.perf_counter()
    try:
        check_inputs(point.config)  # an infeasible point (bad target, missing file) fails alone, before any work
        run = finished_run(point_key)
        status = "reused"
        if run is None:
            # the sweep's slots, and a one-slot limit of this point's key: the same point started by another sweep
            # (on any machine that shares the Prefect server) waits here, then finds the finished run
            with concurrency([limit_name(sweep), _point_limit(point_key)], occupy=1, strict=True):
                run = finished_run(point_key)
                if run is None:
                    run, status = _execute(point, point_key, launch), "ran"
        return _adopt(run, point, point_key, parent_run_id, sweep, status, time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 - one failed point is reported, the sweep goes on
        log.error("point %s failed: %s: %s", point.label, type(exc).__name__, exc)
        return sweep_rules.point_row(point.label, "failed", {}, wall_s=time.perf_counter() - started,
                                     mlflow_run_id="", model_version="", error=f"{type(exc).__name__}: {exc}"[:300],
                                     worker="")


def _point_limit(point_key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectAlreadyExists

    name = f"pipprune-point-{point_key}"
    with get_client(sync_client=True) as client:
        try:
            client.upsert_global_concurrency_limit_by_name(name, 1)
        except ObjectAlreadyExists:  # another sweep created it between the read and the create: same limit
            pass
    return name


def run_deployment_point(deployment: str, point: SweepPoint) -> PointRun:
    """`point` as a run of `deployment` on its work pool, waited for; raises unless it completed."""
    from prefect.deployments import run_deployment

    flow_run = run_deployment(deployment, parameters={"config": point.config.model_dump(mode="json")},
                              flow_run_name=f"point-{point.label}"[:100], timeout=None, poll_interval=3)
    if not flow_run.state or not flow_run.state.is_completed():
        message = flow_run.state.message if flow_run.state else "no state"
        raise RuntimeError(f"flow run {flow_run.id} ended {flow_run.state.name if flow_run.state else '?'}: "
                           f"{message}")
    worker = (flow_run.labels or {}).get("prefect.worker.name", "?")  # set by the worker that took the run
    wall = (flow_run.end_time - flow_run.start_time).total_seconds() \
        if flow_run.start_time and flow_run.end_time else None
    return PointRun(str(flow_run.id), f"worker {worker} (process {flow_run.infrastructure_pid or '?'})", wall)


def _execute(point: SweepPoint, point_key: str, launch: Launch) -> Any:
    """The point launched; its run tagged with the point's key before the point's slots are released (a waiting
    twin then finds it)."""
    ran = launch(point)
    run = _run_of_flow_run(ran.flow_run_id)
    if run is None:
        raise RuntimeError(f"flow run {ran.flow_run_id} finished but no MLflow run carries its id")
    client = mlflow_client()
    for key, value in {WHERE_TAG: ran.where, WALL_TAG: f"{ran.wall_s:.1f}" if ran.wall_s is not None else "",
                       POINT_KEY_TAG: point_key}.items():
        if value:
            client.set_tag(run.info.run_id, key, value)
            run.data.tags[key] = value
    return run


def _adopt(run: Any, point: SweepPoint, point_key: str, parent_run_id: str, sweep: SweepConfig,
           status: str, seconds: float) -> dict[str, Any]:
    """Tag the point's compress run as a child of the sweep and read its row."""
    client = mlflow_client()
    run_id = run.info.run_id
    tags = {POINT_KEY_TAG: point_key, SWEEP_TAG: sweep.name, tag_names.SWEEP_POINT: point.label}
    if PARENT_TAG not in run.data.tags:  # a reused point stays the child of the sweep run that computed it
        tags[PARENT_TAG] = parent_run_id
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    versions = client.search_model_versions(f"run_id = '{run_id}'")
    version = next((v.version for v in versions if v.name == point.config.registered_model_name), "")
    wall = float(run.data.tags[WALL_TAG]) if run.data.tags.get(WALL_TAG) else \
        (run.info.end_time - run.info.start_time) / 1000 if run.info.end_time else seconds
    return sweep_rules.point_row(point.label, status, dict(run.data.metrics), wall_s=wall, mlflow_run_id=run_id,
                                 model_version=str(version), error="",
                                 worker=run.data.tags.get(WHERE_TAG, ""))


@task(name="log-sweep", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_sweep(parent_run_id: str, sweep: SweepConfig, rows: list[dict[str, Any]]) -> dict[str, int]:
    """The parent run's table (CSV, markdown, JSON), Pareto plot and point counts; FAILED when any point failed."""
    from mlflow.entities import Metric

    from infra import plots

    client = mlflow_client()
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ran", "reused", "failed")}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        import pandas as pd

        pd.DataFrame(rows).to_csv(out / "sweep.csv", index=False)
        (out / "sweep.md").write_text(sweep_rules.markdown_table(rows))
        (out / "sweep.json").write_text(json.dumps(rows, indent=1, default=str))
        plots.save(sweep_rules.pareto_plot(rows, f"sweep {sweep.name}: quality vs size"), out / "pareto.png")
        client.log_artifacts(parent_run_id, str(out), "sweep")
    now = int(time.time() * 1000)
    client.log_batch(parent_run_id, metrics=[Metric(f"points.{k}", float(v), now, 0) for k, v in counts.items()])
    front = sweep_rules.pareto_front(rows)
    client.set_tag(parent_run_id, tag_names.SWEEP_PARETO, ", ".join(rows[i]["point"] for i in front)[:5000])
    client.set_terminated(parent_run_id, status="FAILED" if counts["failed"] else "FINISHED")
    return counts


@task(name="promote-best-point")
def promote_best(sweep: SweepConfig, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Give `sweep.alias` to the point removing the most parameters (then: lowest KL) that passes the gates file."""
    if sweep.gates is None:
        return None
    from infra.promotion import PromotionGates, promote
    from infra.s3store import CheckpointStore
    from infra.settings import Settings
    from infra.signing import SigningError, check_version_signature, public_key_pem, signing_key_path

    settings = Settings()
    gates = PromotionGates.from_file(Path(sweep.gates))
    try:
        key = public_key_pem(signing_key_path(settings))
    except SigningError:
        key = None

    def verify(tags: dict[str, str]):
        store = CheckpointStore.for_uri(settings, tags["pipprune.s3_uri"]) if tags.get("pipprune.s3_uri") else None
        return check_version_signature(tags, store, key, settings.work_dir)

    name = sweep.points()[0].config.registered_model_name
    done = [r for r in rows if r["status"] != "failed" and r["model_version"]]
    done.sort(key=lambda r: (-(r["achieved_ratio"] if math.isfinite(r["achieved_ratio"]) else -1),
                             r["kl"] if math.isfinite(r["kl"]) else math.inf))
    client = mlflow_client()
    for row in done:
        outcome = promote(client, name, row["model_version"], sweep.alias, gates,
                          reason=f"best point of sweep {sweep.name} passing {sweep.gates}: {row['point']}",
                          verify_signature=verify)
        if outcome.promoted:
            log.info("sweep %s: %s v%s (%s) is now %r", sweep.name, name, row["model_version"], row["point"],
                     sweep.alias)
            return {"point": row["point"], "name": name, "version": row["model_version"], "alias": sweep.alias}
        log.info("point %s does not pass the gates: %s", row["point"],
                 "; ".join(g.detail for g in outcome.gates if not g.passed))
    return None
