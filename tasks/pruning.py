"""prune_step and checkpoint: physically remove the planned units, save, and upload verified to S3."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from prefect import task

from infra.config import RuntimeSettings
from infra.settings import Settings
from pip_core import io as core_io
from pip_core import prune
from pip_core.units import Unit
from tasks._common import RETRIES, RETRY_DELAYS, key_from, retry_transient
from tasks.models import ensure_local, load_model, save_model
from tasks.refs import ModelRef, PrunePlan

log = logging.getLogger(__name__)


@task(name="prune-step", cache_key_fn=key_from("model", "plan", "runtime"), persist_result=True,
      result_serializer="json")
def prune_step(model: ModelRef, plan: PrunePlan, runtime: RuntimeSettings = RuntimeSettings()) -> ModelRef:
    """Apply `plan` to `model` and save the result as an ordinary HF directory, in the dtype it was loaded in."""
    net, tokenizer = load_model(model, runtime, for_update=True)
    before = core_io.param_count(net)
    prune.apply(net, [Unit(**u) for u in plan.units])
    after = core_io.param_count(net)
    if before - after != plan.params_selected:
        raise RuntimeError(f"pruning removed {before - after} params, plan said {plan.params_selected}")
    pruned = save_model(net, tokenizer, f"{model.fingerprint[:16]}-{plan.table_sha256[:16]}", after)
    log.info("pruned %d -> %d params (%s)", before, after, pruned.fingerprint[:12])
    return pruned


@task(name="checkpoint", cache_key_fn=key_from("run_key", "iteration", "model", "metadata"),
      persist_result=True, result_serializer="json", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS,
      retry_condition_fn=retry_transient)
def checkpoint(run_key: str, iteration: int, model: ModelRef, score_table: str | None, metadata: dict) -> ModelRef:
    """Upload model dir + the score table behind the step; the manifest goes last, so it marks completion.

    S3 layout: runs/<run_key>/iter-<i>/{model/..., score_table.csv, manifest.json}; a stage
    that scored nothing (recovery) has no score table.
    """
    from infra.s3store import CheckpointStore

    settings = Settings()
    store = CheckpointStore.from_settings(settings, run_key)
    local = ensure_local(model, settings)
    # a staging dir of this call alone: two runs checkpointing the same model never share it
    stage = Path(tempfile.mkdtemp(prefix=f"{Path(model.local_dir).name}.ckpt-{iteration}-", dir=local.parent))
    shutil.copytree(local, stage / CHECKPOINT_MODEL_SUBDIR)
    if score_table is not None:
        shutil.copy2(score_table, stage / "score_table.csv")
    try:
        ref = store.upload_checkpoint(iteration, stage, metadata={**metadata, "model_fingerprint": model.fingerprint})
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log.info("checkpoint iter-%d -> %s", iteration, ref.uri)
    return model.model_copy(update={"s3_uri": ref.uri + CHECKPOINT_MODEL_SUBDIR + "/",
                                    "manifest_sha256": ref.manifest_sha256})


#: where the model files sit inside an iteration's S3 prefix
CHECKPOINT_MODEL_SUBDIR = "model"
