"""register_model: the final checkpoint becomes an MLflow model and a registered version with lineage tags.

The version is an MLflow 3 logged model (transformers flavor, signature, input example) whose
files are the final S3 checkpoint itself (see `infra.mlflow_model`): the weights exist once, and
`mlflow.transformers.load_model("models:/NAME@ALIAS")` reads the bytes `pipprune lineage` verifies.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from prefect import task

from infra.mlflow_utils import mlflow_client
from infra.settings import Settings
from infra.tags import (
    DATASET_PREFIX,
    GIT_SHA,
    LOGGED_MODEL_ID,
    METHOD,
    MLFLOW_FILES_SHA256,
    MODEL_FINGERPRINT,
    RATIO,
    RUN_KEY,
    S3_URI,
    SOURCE_MODEL,
    UNIT,
)
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.refs import ModelRef

log = logging.getLogger(__name__)

LOGGED_MODEL_TYPE = "pipprune-compressed-lm"


def checkpoint_root(model_uri: str) -> str:
    """s3://B/runs/K/iter-N/model/ -> s3://B/runs/K/iter-N/ (the MLflow model root)."""
    from infra.mlflow_model import MODEL_SUBDIR

    suffix = f"/{MODEL_SUBDIR}/"
    if not model_uri.endswith(suffix):
        raise ValueError(f"{model_uri} is not a checkpoint's model folder (expected it to end in {suffix})")
    return model_uri[: -len(MODEL_SUBDIR) - 1]


@task(name="register-model", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def register_model(name: str, model: ModelRef, run_id: str, tags: dict[str, str]) -> str:
    """Register `model` (checkpointed in S3) as a version of `name`; idempotent per (run_key, final model).

    A rerun of identical inputs returns the version already registered instead of adding a twin.
    The run's dataset digests (`log_datasets`) are copied onto the version.
    """
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    if not model.s3_uri:
        raise ValueError(f"model {model.fingerprint[:12]} has no S3 checkpoint; only checkpointed models register")
    client = mlflow_client()
    _ensure_registered_model(client, name)
    wanted = (tags[RUN_KEY], tags[MODEL_FINGERPRINT])
    for version in client.search_model_versions(f"name = '{name}'"):
        if (version.tags.get(RUN_KEY), version.tags.get(MODEL_FINGERPRINT)) == wanted:
            log.info("model %s version %s already registered for this run key", name, version.version)
            return str(version.version)
    run = client.get_run(run_id)
    tags = {**tags, **{k: v for k, v in run.data.tags.items() if k.startswith(DATASET_PREFIX)}}
    root = checkpoint_root(model.s3_uri)
    logged = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                        model_type=LOGGED_MODEL_TYPE,
                                        tags={S3_URI: root, RUN_KEY: tags[RUN_KEY],
                                              MODEL_FINGERPRINT: model.fingerprint})
    try:
        tags[MLFLOW_FILES_SHA256] = publish_mlflow_model(model, root, run_id, logged.model_id, tags)
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])  # the run page lists it
    tags[LOGGED_MODEL_ID] = logged.model_id
    version = client.create_model_version(name, source=root, run_id=run_id, model_id=logged.model_id, tags=tags,
                                          description=f"pipprune run {tags[RUN_KEY]}; weights and MLmodel "
                                                      f"at {root}")
    log.info("registered %s version %s (MLflow model at %s)", name, version.version, root)
    return str(version.version)


def _ensure_registered_model(client, name: str) -> None:  # noqa: ANN001
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, description="Models compressed by pipprune (PIP)")
        except MlflowException as exc:  # a concurrent run registered the name first
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise


def publish_mlflow_model(model: ModelRef, root: str, run_id: str, model_id: str, tags: dict[str, str]) -> str:
    """Write the flavor's files beside the checkpoint's `model/` in S3; returns the files manifest's sha256."""
    from infra import mlflow_model
    from infra.s3store import CheckpointStore, split_uri
    from tasks.models import ensure_local, load_model

    settings = Settings()
    store = CheckpointStore.for_uri(settings, root)
    _, base = split_uri(root)
    metadata = {k: v for k, v in tags.items() if k in (RUN_KEY, SOURCE_MODEL, METHOD,
                                                         UNIT, RATIO, GIT_SHA)}
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlflow-model-", dir=settings.work_dir) as tmp:
        out = Path(tmp) / "files"
        files = mlflow_model.build(ensure_local(model, settings), out, run_id, model_id, metadata,
                                   loaded=load_model(model, keep_slot=True))
        if any(rel.startswith(f"{mlflow_model.MODEL_SUBDIR}/") for rel in files):
            raise RuntimeError("refusing to upload a second copy of the model folder")
        for rel in [*sorted(files), mlflow_model.FILES_MANIFEST]:  # the list of files goes last
            store.put_verified(out / rel, base + rel)
        return mlflow_model.files_manifest_sha256(out)
