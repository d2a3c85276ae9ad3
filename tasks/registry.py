"""register_model: the final checkpoint becomes a registered MLflow model version with lineage tags."""

from __future__ import annotations

import logging

from prefect import task

from infra.mlflow_utils import mlflow_client
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient

log = logging.getLogger(__name__)


@task(name="register-model", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def register_model(name: str, source_uri: str, run_id: str, tags: dict[str, str]) -> str:
    """Create a version of `name` pointing at `source_uri`; idempotent per (run_key, final model).

    A rerun of identical inputs returns the version already registered instead of adding a twin.
    """
    from mlflow.exceptions import MlflowException

    client = mlflow_client()
    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, description="Models compressed by pipprune (PIP)")
        except MlflowException as exc:  # a concurrent run registered the name first
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    wanted = (tags["pipprune.run_key"], tags["pipprune.model_fingerprint"])
    for version in client.search_model_versions(f"name = '{name}'"):
        if (version.tags.get("pipprune.run_key"), version.tags.get("pipprune.model_fingerprint")) == wanted:
            log.info("model %s version %s already registered for this run key", name, version.version)
            return str(version.version)
    version = client.create_model_version(name, source=source_uri, run_id=run_id, tags=tags,
                                          description=f"pipprune run {tags['pipprune.run_key']}")
    log.info("registered %s version %s", name, version.version)
    return str(version.version)
