"""find_resume_point: the last complete, verified checkpoint of a run in S3."""

from __future__ import annotations

import logging

from prefect import task

from infra.settings import Settings
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.pruning import CHECKPOINT_MODEL_SUBDIR
from tasks.refs import ModelRef

log = logging.getLogger(__name__)


@task(name="find-resume-point", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def find_resume_point(run_key: str) -> list[dict]:
    """Metadata of every complete iteration 1..k in order (k = last complete manifest).

    A manifest is written last, so its presence means the step finished; a checkpoint whose files
    do not verify is skipped along with everything after it.
    """
    from infra.s3store import CheckpointStore

    store = CheckpointStore.from_settings(Settings(), run_key)
    done: list[dict] = []
    for ref in store.complete_checkpoints():
        if ref.iteration != len(done) + 1:
            break
        problems = store.verify_checkpoint(ref)
        if problems:
            log.warning("checkpoint iter-%d does not verify (%s): resuming before it", ref.iteration, problems[:3])
            break
        meta = dict(ref.metadata)
        meta["model"] = ModelRef(**meta["model"]).model_copy(
            update={"s3_uri": ref.uri + CHECKPOINT_MODEL_SUBDIR + "/", "manifest_sha256": ref.manifest_sha256}
        ).model_dump()
        done.append(meta)
    if done:
        log.info("run %s: resuming after iteration %d from S3", run_key[:8], len(done))
    return done
