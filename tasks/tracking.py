"""MLflow tracking tasks: one run per flow run, step-indexed metrics and artifacts per iteration.

All calls go through an explicit `MlflowClient` and run id (no fluent global "active run"), so
concurrent flows in one process cannot log into each other's runs.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from prefect import task

from infra.mlflow_utils import flatten_params, mlflow_client
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient

log = logging.getLogger(__name__)

EXPERIMENT = "pipprune-compress"


@task(name="open-tracking-run", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def open_tracking_run(run_key: str, params: dict[str, Any], tags: dict[str, str]) -> str:
    """Create the MLflow run of this flow run; returns its id."""
    client = mlflow_client()
    run = client.create_run(experiment_id(client), tags={"pipprune.run_key": run_key, **tags},
                            run_name=f"compress-{run_key[:8]}")
    client.log_batch(run.info.run_id, params=_params(params))
    return run.info.run_id


def experiment_id(client) -> str:  # noqa: ANN001
    """The experiment's id, creating it once even when several runs start at the same moment."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(EXPERIMENT)
    except MlflowException as exc:  # another run created it between our two calls
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(EXPERIMENT).experiment_id


def _params(params: dict[str, Any]) -> list:
    from mlflow.entities import Param

    return [Param(k, v) for k, v in flatten_params(params).items()]


@task(name="log-iteration", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_iteration(run_id: str, iteration: int, metrics: dict[str, float], score_table: str,
                  units_removed: list[dict], history: list[dict[str, float]]) -> None:
    """Metrics at step=iteration, the score table, the removed units, and the two plots."""
    import json
    import time

    from mlflow.entities import Metric

    client = mlflow_client()
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, iteration) for k, v in metrics.items()])
    folder = f"iterations/iter-{iteration}"
    with tempfile.TemporaryDirectory() as tmp:
        table_path = Path(tmp) / "score_table.csv"
        shutil.copyfile(score_table, table_path)
        client.log_artifact(run_id, str(table_path), folder)
        units_path = Path(tmp) / "units_removed.json"
        units_path.write_text(json.dumps(units_removed, indent=1))
        client.log_artifact(run_id, str(units_path), folder)
        scores_png = Path(tmp) / "unit_scores.png"
        plot_scores(score_table, scores_png, title=f"iteration {iteration}")
        client.log_artifact(run_id, str(scores_png), folder)
        if len(history) > 1:
            curve = Path(tmp) / "metric_vs_params.png"
            plot_history(history, curve)
            client.log_artifact(run_id, str(curve), "plots")


@task(name="log-recovery", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_recovery(run_id: str, stage: int, metrics: dict[str, float], losses: list[float],
                 settings: dict[str, Any]) -> None:
    """The recovery step like a pruning step: metrics at step=stage, plus its training-loss curve."""
    import json
    import time

    from mlflow.entities import Metric

    client = mlflow_client()
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, stage) for k, v in metrics.items()])
    for start in range(0, len(losses), 1000):  # MLflow caps a batch at 1000 metrics
        client.log_batch(run_id, metrics=[Metric("recovery_train_loss", float(v), now, start + j)
                                          for j, v in enumerate(losses[start:start + 1000])])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recovery.json"
        path.write_text(json.dumps({"settings": settings, "metrics": metrics, "losses": losses}, indent=1))
        client.log_artifact(run_id, str(path), f"iterations/iter-{stage}")


@task(name="log-final", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_final(run_id: str, metrics: dict[str, float], summary: dict[str, Any]) -> None:
    import json
    import time

    from mlflow.entities import Metric

    client = mlflow_client()
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "summary.json"
        path.write_text(json.dumps(summary, indent=1, default=str))
        client.log_artifact(run_id, str(path))


@task(name="close-tracking-run", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def close_tracking_run(run_id: str, status: str = "FINISHED") -> None:
    mlflow_client().set_terminated(run_id, status=status)


def plot_scores(score_table: str, out: Path, title: str) -> None:
    """Per-unit scores along depth; removed units in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    table = pd.read_csv(score_table)
    position = table["layer"] + table["index"].fillna(0) / (table["index"].max() + 1 if table["index"].notna().any() else 1)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    kept = table[~table["selected"]]
    gone = table[table["selected"]]
    ax.scatter(position[kept.index], kept["score"], s=6, label="kept")
    ax.scatter(position[gone.index], gone["score"], s=10, c="red", label="removed")
    ax.set_xlabel("layer (units spread within)")
    ax.set_ylabel("importance score")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_history(history: list[dict[str, float]], out: Path) -> None:
    """Quick-eval perplexity against remaining parameters, one point per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [h["num_params"] for h in history]
    ys = [h.get("heldout_perplexity", float("nan")) for h in history]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(xs, ys, marker="o")
    ax.invert_xaxis()
    ax.set_xlabel("parameters")
    ax.set_ylabel("held-out perplexity")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


@contextmanager
def tracking_run(run_key: str, params: dict[str, Any], tags: dict[str, str]) -> Iterator[str]:
    """The MLflow run of one flow run: FINISHED when the block completes, FAILED on any error or interrupt."""
    run_id = open_tracking_run(run_key, params, tags)
    try:
        yield run_id
    except BaseException:
        close_tracking_run(run_id, "FAILED")
        raise
    close_tracking_run(run_id)
