"""MLflow tracking tasks: one run per flow run, step-indexed metrics and artifacts per iteration.

All calls go through an explicit `MlflowClient` and run id (no fluent global "active run"), so
concurrent flows in one process cannot log into each other's runs.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import task

from infra import run_info
from infra.mlflow_utils import flatten_params, mlflow_client
from infra.settings import Settings
from infra.tags import DATASET_DIGEST, DATASET_SOURCE, RUN_KEY
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.refs import CalibrationRef

log = logging.getLogger(__name__)

EXPERIMENT = "pipprune-compress"


@task(name="open-tracking-run", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def open_tracking_run(run_key: str, params: dict[str, Any], tags: dict[str, str]) -> str:
    """Create the MLflow run of this flow run (with MLflow's standard source tags); returns its id."""
    client = mlflow_client()
    run = client.create_run(experiment_id(client), run_name=f"compress-{run_key[:8]}",
                            tags={RUN_KEY: run_key, **tags, **run_info.source_tags(tags),
                                  run_info.DESCRIPTION_TAG: run_info.describe_running(params)})
    client.log_batch(run.info.run_id, params=_params(params))
    return run.info.run_id


def experiment_id(client) -> str:  # noqa: ANN001
    """The experiment's id, creating it once even when several runs start at the same moment.

    It is tagged as model development: without `mlflow.experimentKind` MLflow 3's UI guesses
    and files the runs under "GenAI -> Evaluation runs".
    """
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        try:
            return client.create_experiment(EXPERIMENT, tags=run_info.EXPERIMENT_TAGS)
        except MlflowException as exc:  # another run created it between our two calls
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(EXPERIMENT)
    for key, value in run_info.EXPERIMENT_TAGS.items():
        if experiment.tags.get(key) != value:  # experiments created by older versions
            client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def _params(params: dict[str, Any]) -> list:
    from mlflow.entities import Param

    return [Param(k, v) for k, v in flatten_params(params).items()]


@task(name="log-iteration", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_iteration(run_id: str, iteration: int, metrics: dict[str, float], score_table: str,
                  units_removed: list[dict], history: list[dict[str, float]]) -> None:
    """Metrics at step=iteration, the score table, the removed units, and the two plots."""
    import json
    import time

    import pandas as pd
    from mlflow.entities import Metric

    from infra import plots

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
        protect = run_info.protected_layers(client.get_run(run_id).data.params)
        fig = plots.unit_scores(pd.read_csv(score_table), f"step {iteration}", *protect)
        client.log_artifact(run_id, str(plots.save(fig, Path(tmp) / "unit_scores.png")), folder)
        if len(history) > 1:
            curve = plots.save(plots.quality_curve(history), Path(tmp) / "quality_vs_params_removed.png")
            client.log_artifact(run_id, str(curve), "plots")
            if all("heldout_kl" in h for h in history):  # KL(dense || model) per token, 0 for the dense row
                kl = plots.save(plots.quality_curve(history, "heldout_kl"), Path(tmp) / "kl_vs_params_removed.png")
                client.log_artifact(run_id, str(kl), "plots")


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


@task(name="log-eval-provenance", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_eval_provenance(run_id: str, record: dict[str, Any]) -> None:
    """What produced the run's evaluation figures: `eval_provenance.json` plus its digest and key fields as tags."""
    import json

    from mlflow.entities import RunTag

    from infra import eval_provenance

    client = mlflow_client()
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in eval_provenance.tags(record).items()])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / eval_provenance.ARTIFACT
        path.write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
        client.log_artifact(run_id, str(path))


@task(name="log-samples", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_samples(run_id: str, rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The prompts and both models' continuations as an MLflow table (`samples.json`); returns the rows."""
    if rows:
        import pandas as pd

        mlflow_client().log_table(run_id, data=pd.DataFrame(rows), artifact_file="samples.json")
    return rows


@task(name="log-final", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_final(run_id: str, metrics: dict[str, float], summary: dict[str, Any]) -> None:
    """Final metrics (step 0), the summary artifact, and the markdown run description."""
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
    params = client.get_run(run_id).data.params
    client.set_tag(run_id, run_info.DESCRIPTION_TAG, run_info.describe_finished(params, summary))


@task(name="close-tracking-run", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def close_tracking_run(run_id: str, status: str = "FINISHED") -> None:
    mlflow_client().set_terminated(run_id, status=status)


@contextmanager
def tracking_run(run_key: str, params: dict[str, Any], tags: dict[str, str]) -> Iterator[str]:
    """The MLflow run of one flow run: FINISHED when the block completes, FAILED on any error or interrupt.

    System metrics (CPU, memory, disk, network; GPU when one and `nvidia-ml-py` are present) are
    sampled into the run meanwhile.
    """
    run_id = open_tracking_run(run_key, params, tags)
    monitor = run_info.start_system_metrics(run_id)
    try:
        yield run_id
    except BaseException:
        run_info.stop_system_metrics(monitor)
        close_tracking_run(run_id, "FAILED")
        raise
    run_info.stop_system_metrics(monitor)
    close_tracking_run(run_id)


@task(name="log-datasets", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_datasets(run_id: str, calib: CalibrationRef) -> dict[str, str]:
    """The calibration pairs and held-out texts as MLflow datasets, inputs of the run.

    Contexts "calibration" and "evaluation"; the source is the calibration file the texts came from
    (`calib.source_path`); the digest is the first 32 hex digits of the content hash pipprune keys everything on
    (MLflow stores at most 36 characters): `pipprune.calibration_hash` for the calibration set,
    the same hash over the held-out texts for the evaluation set. The digests are also run tags,
    so the registered version and `pipprune lineage` can carry and check them.
    """
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    from infra.calibration import calibration_hash
    from tasks.calibration import read_heldout, read_pairs

    pairs = pd.DataFrame(read_pairs(calib), columns=["original", "perturbed"])
    held = read_heldout(calib)
    heldout = pd.DataFrame({"text": held})
    uri = calib.source_path
    datasets = {
        "calibration": mlflow.data.from_pandas(pairs, source=uri, name=f"calibration-{calib.data_hash[:8]}",
                                               digest=calib.data_hash[:32]),
        "evaluation": mlflow.data.from_pandas(heldout, source=uri, name=f"heldout-{calibration_hash(held)[:8]}",
                                              digest=calibration_hash(held)[:32]),
    }
    client = mlflow_client()
    client.log_inputs(run_id, datasets=[
        DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])
        for context, ds in datasets.items()])
    tags = {}
    for context, ds in datasets.items():
        tags[DATASET_DIGEST.format(context=context)] = ds.digest
        tags[DATASET_SOURCE.format(context=context)] = uri
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    if Path(uri).resolve().is_relative_to(Settings().work_dir.resolve()):  # texts pipprune drew (self, a mix): kept
        client.log_artifact(run_id, uri, "calibration")
        if Path(uri).with_name("wordlist.txt").is_file():  # none when the method perturbs nothing
            client.log_artifact(run_id, str(Path(uri).with_name("wordlist.txt")), "calibration")
    return tags
