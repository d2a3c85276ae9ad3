"""Fan-out evaluation: many model directories evaluated as parallel Prefect tasks.

The task runner is the caller's choice: a local thread pool by default, or prefect-dask's
DaskTaskRunner for a Dask cluster (a LocalCluster here, a team's scheduler address in production).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task


@task(name="evaluate-dir")
def evaluate_dir(model_dir: str, tasks: tuple[str, ...], include_path: str | None, limit: int | None) -> dict:
    """lm-eval on one directory with the provenance of its figures; also reports which Dask worker (if any) ran it."""
    from infra.lmeval import run_lmeval_recorded

    try:
        from distributed import get_worker

        worker = get_worker().address
    except (ImportError, ValueError):
        worker = None
    results, provenance = run_lmeval_recorded(Path(model_dir), list(tasks),
                                              include_path=Path(include_path) if include_path else None, limit=limit)
    return {"results": results, "provenance": provenance, "worker": worker}


@flow(name="evaluate-models")
def evaluate_models_flow(model_dirs: list[str], tasks: tuple[str, ...], include_path: str | None = None,
                         limit: int | None = None) -> dict[str, dict]:
    futures = {d: evaluate_dir.submit(d, tasks, include_path, limit) for d in model_dirs}
    return {d: f.result() for d, f in futures.items()}


def dask_runner(address: str | None = None, n_workers: int = 2):  # noqa: ANN201
    """A DaskTaskRunner on an existing cluster (`address`) or a LocalCluster on 127.0.0.1."""
    from prefect_dask import DaskTaskRunner

    if address:
        return DaskTaskRunner(address=address)
    return DaskTaskRunner(cluster_kwargs={"n_workers": n_workers, "threads_per_worker": 1, "processes": True,
                                          "host": "127.0.0.1", "dashboard_address": None})
