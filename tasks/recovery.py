"""recover: optional recovery fine-tuning of the pruned model on the calibration texts.

`recovery.kind` lora: LoRA on the LM loss, merged back; kd: distillation from the dense model
(the teacher, handed over by ModelRef), through LoRA adapters merged back or on every weight.

The result is an ordinary HF directory (same loader as every pruned step), so checkpointing,
evaluation and registration treat it like any other model.
"""

from __future__ import annotations

import logging
import time

from prefect import task
from pydantic import BaseModel, ConfigDict

from infra.calibration import load_calibration
from infra.config import RecoverySettings, RuntimeSettings
from pip_core import io as core_io
from pip_core.recompute import activation_checkpointing
from pip_core.recovery import RecoveryReport, recover_kd, recover_lora
from tasks._common import content_key, key_from
from tasks.calibration import read_heldout
from tasks.models import load_model, placement_for, save_model
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
    #: unpadded tokens trained on (steps x batch, the budget two recovery kinds are compared at)
    tokens: int = 0


@task(name="recover", cache_key_fn=key_from("model", "calib", "settings", "seed", "runtime", "teacher"),
      persist_result=True, result_serializer="json")
def recover(model: ModelRef, calib: CalibrationRef, settings: RecoverySettings, seed: int,
            runtime: RuntimeSettings = RuntimeSettings(), teacher: ModelRef | None = None) -> RecoveryResult:
    """Fine-tune on calibration texts (never the held-out ones): LoRA on the LM loss, or distil `teacher`.

    It draws up to `settings.max_texts` texts from the whole calibration source, not only the
    few scoring pairs: a handful of texts seen for many epochs overfits and raises held-out
    perplexity instead of recovering it. Both kinds draw the same batches (same token budget).
    """
    if settings.kind == "kd" and teacher is None:
        raise ValueError("recovery.kind 'kd' needs the dense model as teacher")
    held = set(read_heldout(calib))
    max_length = calib.max_length
    data = load_calibration(calib.source_path, n_samples=settings.max_texts + len(held), seed=seed)
    texts = [t for t in data["text"] if t not in held][:settings.max_texts]
    log.info("%s recovery on %d calibration texts (%d held out)", describe(settings), len(texts), len(held))
    net, tokenizer = load_model(model, runtime, for_update=True, seq_len=max_length)
    lean = placement_for(model, runtime, max_length, loaded=True).gradient_checkpointing
    start = time.perf_counter()
    with activation_checkpointing(net, lean):  # training's activations bounded as scoring's are
        out, report = _train(net, tokenizer, texts, settings, seed, max_length, runtime, teacher)
    seconds = time.perf_counter() - start
    num_params = core_io.param_count(out)
    if num_params != model.num_params:
        raise RuntimeError(f"recovery changed the parameter count {model.num_params} -> {num_params}")
    # named by everything that decides the weights, so two recoveries never share a directory
    name = content_key(model.fingerprint, calib.data_hash, calib.source_digest, settings.model_dump(), seed, max_length,
                       teacher.fingerprint if teacher and settings.kind == "kd" else None)
    recovered = save_model(out, tokenizer, f"{model.fingerprint[:16]}-{settings.kind}-{name[:16]}", num_params)
    log.info("%s recovery: %d steps, loss %.3f -> %.3f in %.0f s", describe(settings), report.steps,
             report.first_loss, report.last_loss, seconds)
    return RecoveryResult(model=recovered, n_texts=len(texts), first_loss=report.first_loss,
                          last_loss=report.last_loss, losses=report.losses, seconds=seconds,
                          tokens=report.tokens)


def describe(settings: RecoverySettings) -> str:
    """'LoRA (LM loss)' or 'KD (lora, T=1)': how the recovery stage trains, for logs and the summary."""
    if settings.kind == "kd":
        return f"KD ({settings.kd_params}, T={settings.temperature:g})"
    return "LoRA (LM loss)"


def _train(net, tokenizer, texts: list[str], settings: RecoverySettings, seed: int, max_length: int,  # noqa: ANN001
           runtime: RuntimeSettings, teacher: ModelRef | None) -> tuple[object, RecoveryReport]:
    """The configured kind of recovery on the model in hand."""
    if settings.kind != "kd":
        return recover_lora(net, tokenizer, texts, settings.options(max_length, seed))
    # read like any model but kept out of the hand-off, which must keep the model being trained
    dense = load_model(teacher, runtime, for_update=True, seq_len=max_length)[0]
    return recover_kd(net, dense, tokenizer, texts, settings.options(max_length, seed))
