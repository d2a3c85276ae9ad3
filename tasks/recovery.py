"""recover: optional LoRA fine-tuning of the pruned model on the calibration texts, merged back.

The result is an ordinary HF directory (same loader as every pruned step), so checkpointing,
evaluation and registration treat it like any other model.
"""

from __future__ import annotations

import logging
import time

from prefect import task
from pydantic import BaseModel, ConfigDict

from infra.calibration import CalibrationSource, load_calibration
from infra.config import RecoverySettings, RuntimeSettings
from pip_core import io as core_io
from pip_core.recovery import recover_lora
from tasks._common import content_key, key_from
from tasks.calibration import read_heldout
from tasks.models import load_model, save_model
from tasks.refs import CalibrationRef, ModelRef

log = logging.getLogger(__name__)


class RecoveryResult(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelRef
    n_texts: int
    first_loss: float
    last_loss: float
    losses: tuple[float, ...]
    seconds: float


@task(name="recover-lora", cache_key_fn=key_from("model", "calib", "source_digest", "settings", "seed", "max_length",
                                                 "runtime"),
      persist_result=True, result_serializer="json")
def recover(model: ModelRef, calib: CalibrationRef, calibration: str, source_digest: str, settings: RecoverySettings,
            seed: int, max_length: int, runtime: RuntimeSettings = RuntimeSettings()) -> RecoveryResult:
    """Fine-tune LoRA adapters on calibration texts (never the held-out ones) and merge them.

    It draws up to `settings.max_texts` texts from the whole calibration source, not only the
    few scoring pairs: a handful of texts seen for many epochs overfits and raises held-out
    perplexity instead of recovering it.
    """
    held = set(read_heldout(calib))
    data = load_calibration(CalibrationSource(calibration).path, n_samples=settings.max_texts + len(held), seed=seed)
    texts = [t for t in data["text"] if t not in held][:settings.max_texts]
    log.info("LoRA recovery on %d calibration texts (%d held out)", len(texts), len(held))
    net, tokenizer = load_model(model, runtime, for_update=True, seq_len=max_length)
    start = time.perf_counter()
    merged, report = recover_lora(net, tokenizer, texts, steps=settings.steps, rank=settings.rank, lr=settings.lr,
                                  batch_size=settings.batch_size, max_length=max_length, seed=seed)
    seconds = time.perf_counter() - start
    num_params = core_io.param_count(merged)
    if num_params != model.num_params:
        raise RuntimeError(f"LoRA merge changed the parameter count {model.num_params} -> {num_params}")
    # named by everything that decides the weights, so two recoveries never share a directory
    name = content_key(model.fingerprint, calib.data_hash, source_digest, settings.model_dump(), seed, max_length)
    recovered = save_model(merged, tokenizer, f"{model.fingerprint[:16]}-lora-{name[:16]}", num_params)
    log.info("LoRA recovery: %d steps, loss %.3f -> %.3f in %.0f s", report.steps, report.first_loss,
             report.last_loss, seconds)
    return RecoveryResult(model=recovered, n_texts=len(texts), first_loss=report.first_loss,
                          last_loss=report.last_loss, losses=report.losses, seconds=seconds)
