"""recover: optional recovery fine-tuning of the pruned model on the calibration texts.

`recovery.kind` lora: LoRA on the LM loss, merged back; kd: distillation from the dense model
(the teacher, handed over by ModelRef), through LoRA adapters merged back or on every weight.
The teacher runs once over the texts the recovery draws, before training; its body is then
dropped and only its LM head and final hidden states are kept (pip_core.distill).

Memory: gradient checkpointing covers only as many layers as the training plan of the real
recovery batch needs (pip_core.memory_plan.plan_training) to keep the run within its target.

The result is an ordinary HF directory (same loader as every pruned step), so checkpointing,
evaluation and registration treat it like any other model.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from prefect import task
from pydantic import BaseModel, ConfigDict

from infra.calibration import load_calibration
from infra.config import RecoverySettings, RuntimeSettings
from infra.memory import resident_bytes
from pip_core import io as core_io
from pip_core.distill import TeacherOutputs, kd_chunk_tokens
from pip_core.memory_plan import available_bytes, plan_training
from pip_core.recompute import activation_checkpointing
from pip_core.recovery import (
    RecoveryOptions,
    consumer_params,
    kd_teacher_outputs,
    lora_params,
    recover_kd,
    recover_lora,
)
from tasks._common import content_key, key_from
from tasks.calibration import read_heldout, read_recovery
from tasks.models import ensure_local, load_model, placement_for, save_model
from tasks.refs import CalibrationRef, ModelRef

log = logging.getLogger(__name__)

#: the run's peak resident memory over the dense model's fp32 weights (issue 47) that a CPU recovery keeps to
#: when `runtime.activation_budget` is set (null: only the memory actually free)
MEMORY_TARGET = 4.0


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
    #: of `seconds`, the teacher's one pass over the recovery texts (kd)
    teacher_seconds: float = 0.0
    #: decoder layers trained with gradient checkpointing (of the model's layers)
    checkpointed_layers: int = 0


@task(name="recover", cache_key_fn=key_from("model", "calib", "settings", "seed", "runtime", "teacher"),
      persist_result=True, result_serializer="json")
def recover(model: ModelRef, calib: CalibrationRef, settings: RecoverySettings, seed: int,
            runtime: RuntimeSettings = RuntimeSettings(), teacher: ModelRef | None = None) -> RecoveryResult:
    """Fine-tune on the recovery texts (never the held-out ones): LoRA on the LM loss, or distil `teacher`.

    The texts are the calibration's own recovery texts when it has them (drawn apart from the scoring
    and held-out texts), else up to `settings.max_texts` texts of the whole calibration source: a
    handful of texts seen for many epochs overfits and raises held-out perplexity instead of
    recovering it. Both kinds draw the same batches (same token budget), each text once per pass.
    """
    if settings.kind == "kd" and teacher is None:
        raise ValueError("recovery.kind 'kd' needs the dense model as teacher")
    texts = _texts(calib, settings, seed)
    max_length = calib.max_length
    options = settings.options(max_length, seed)
    net, tokenizer = load_model(model, runtime, for_update=True, seq_len=max_length)
    start = time.perf_counter()
    outputs = _teacher_outputs(teacher, runtime, net, tokenizer, texts, options) if settings.kind == "kd" else None
    teacher_seconds = time.perf_counter() - start
    layers = checkpointed_layers(net, model, teacher or model, runtime, options, settings.kind)
    with activation_checkpointing(net, layers > 0, layers=layers):
        out, report = (recover_kd(net, outputs, tokenizer, texts, options) if outputs is not None
                       else recover_lora(net, tokenizer, texts, options))
    seconds = time.perf_counter() - start
    num_params = core_io.param_count(out)
    if num_params != model.num_params:
        raise RuntimeError(f"recovery changed the parameter count {model.num_params} -> {num_params}")
    # named by everything that decides the weights, so two recoveries never share a directory
    name = content_key(model.fingerprint, calib.data_hash, calib.source_digest, settings.model_dump(), seed, max_length,
                       teacher.fingerprint if teacher and settings.kind == "kd" else None, texts)
    recovered = save_model(out, tokenizer, f"{model.fingerprint[:16]}-{settings.kind}-{name[:16]}", num_params)
    log.info("%s recovery: %d steps, loss %.3f -> %.3f in %.0f s (teacher pass %.0f s)", describe(settings),
             report.steps, report.first_loss, report.last_loss, seconds, teacher_seconds)
    return RecoveryResult(model=recovered, n_texts=len(texts), first_loss=report.first_loss,
                          last_loss=report.last_loss, losses=report.losses, seconds=seconds,
                          tokens=report.tokens, teacher_seconds=teacher_seconds, checkpointed_layers=layers)


def consumer_params_count(net: Any) -> int:
    """Parameters kd_params "consumers" trains."""
    names = set(consumer_params(net))
    return sum(p.numel() for n, p in net.named_parameters() if n in names)


def describe(settings: RecoverySettings) -> str:
    """'LoRA (LM loss)' or 'KD (lora, T=1)': how the recovery stage trains, for logs and the summary."""
    if settings.kind == "kd":
        return f"KD ({settings.kd_params}, T={settings.temperature:g})"
    return "LoRA (LM loss)"


def _texts(calib: CalibrationRef, settings: RecoverySettings, seed: int) -> list[str]:
    """The calibration's recovery texts when it has them, else texts of its source that are not held out."""
    if calib.recovery_path:
        texts = read_recovery(calib)[:settings.max_texts]
        log.info("%s recovery on %d recovery texts", describe(settings), len(texts))
        return texts
    held = set(read_heldout(calib))
    data = load_calibration(calib.source_path, n_samples=settings.max_texts + len(held), seed=seed)
    texts = [t for t in data["text"] if t not in held][:settings.max_texts]
    log.info("%s recovery on %d calibration texts (%d held out)", describe(settings), len(texts), len(held))
    return texts


def _teacher_outputs(teacher: ModelRef, runtime: RuntimeSettings, student: Any, tokenizer: Any, texts: list[str],
                     options: RecoveryOptions) -> TeacherOutputs:
    """The dense model's outputs on the texts the recovery draws (`student`'s head shared when equal); the dense
    model itself is dropped on return, so its memory is free before training starts.

    Read like any model but kept out of the hand-off, which must keep the model being trained.
    """
    dense = load_model(teacher, runtime, for_update=True, seq_len=options.max_length)[0]
    start = time.perf_counter()
    outputs = kd_teacher_outputs(dense, tokenizer, texts, options, student)
    del dense
    gc.collect()
    log.info("teacher pass: %d texts in %.1f s, %.0f MB of hidden states kept", len(outputs.hidden),
             time.perf_counter() - start, outputs.nbytes / 2**20)
    return outputs


def checkpointed_layers(net: Any, model: ModelRef, dense: ModelRef, runtime: RuntimeSettings,
                        options: RecoveryOptions, kind: str) -> int:
    """Decoder layers to train with gradient checkpointing: the fewest that keep the training plan of the
    real recovery batch within the memory free on its device and, on the CPU with an activation budget
    set, within MEMORY_TARGET x the dense model's fp32 weights less what the process holds now (the
    model in hand and the teacher's outputs included). A target that even every layer checkpointed
    cannot meet (a tiny model beside the process's own libraries) checkpoints nothing for it.
    """
    placement = placement_for(model, runtime, options.max_length, loaded=True)
    config = core_io.read_config(ensure_local(model))
    # the LM loss takes whole logits; KD's slices are those kd_loss takes (not the whole sequence: the plan then
    # counted 1.3 GiB of logits for SmolLM2-135M's 16-position slices of 0.16 GiB, and checkpointed nothing)
    chunk = (options.chunk_tokens or kd_chunk_tokens(net, options.batch_size)) if kind == "kd" else options.max_length
    trained = {"full": lambda: core_io.param_count(net), "lora": lambda: lora_params(net, options.rank),
               "consumers": lambda: consumer_params_count(net)}[options.kd_params if kind == "kd" else "lora"]()
    plan = plan_training(config, placement.dtype, options.batch_size, options.max_length, trained, chunk)
    free = available_bytes(placement.device)
    layers = plan.layers_to_checkpoint(free)
    if layers is None:
        log.warning("recovery needs %.2f GiB with every layer checkpointed, %.2f GiB is free: checkpointing all",
                    plan.peak(plan.layers) / 2**30, free / 2**30)
        return plan.layers
    room = int(MEMORY_TARGET * dense.num_params * 4) - resident_bytes()
    within = plan.layers_to_checkpoint(room)
    if placement.device == "cpu" and runtime.activation_budget is not None and within is not None:
        layers = max(layers, within)
    log.info("recovery memory: plan %.2f GiB with %d of %d layers checkpointed (%.2f GiB free, %.2f GiB left "
             "within %gx the fp32 weights)", plan.peak(layers) / 2**30, layers, plan.layers, free / 2**30,
             room / 2**30, MEMORY_TARGET)
    return layers
