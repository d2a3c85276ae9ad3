"""Optional recovery fine-tuning after pruning: LoRA on the LM loss, or distillation from the dense model.

The merged result is the same model class with updated weights, so it saves as an ordinary
Hugging Face directory like any pruned model (no adapter files, no peft needed to load it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from pip_core.errors import CalibrationError, PipCoreError
from pip_core.units import check_supported
from pip_core.vocabulary import KD_PARAMS

log = logging.getLogger(__name__)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class RecoveryOptions:
    """How a recovery trains, passed whole (`infra.config.RecoverySettings.options` builds it from the config)."""

    steps: int = 60
    #: LoRA rank (LoRA recovery, or KD with kd_params "lora")
    rank: int = 8
    lr: float = 2e-3
    batch_size: int = 8
    #: tokens per text (longer texts are truncated)
    max_length: int = 128
    seed: int = 0
    #: KD only: "lora" trains adapters merged back, "full" every weight
    kd_params: str = "lora"
    #: KD only: softmax temperature of both models' logits
    temperature: float = 1.0
    #: KD only: tokens per chunk of the loss (None: pip_core.distill's default)
    chunk_tokens: int | None = None
    progress: bool = True


@dataclass(frozen=True)
class RecoveryReport:
    steps: int
    first_loss: float
    last_loss: float
    losses: tuple[float, ...] = ()
    #: predicted-position budget actually trained on (unpadded tokens of every batch)
    tokens: int = 0


def _texts(texts: Sequence[str]) -> list[str]:
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationError("recovery needs at least one non-empty calibration text")
    return texts


def _batches(tokenizer, texts: list[str], steps: int, batch_size: int, max_length: int,  # noqa: ANN001
             generator: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """`steps` batches of texts drawn with replacement: the same draws (and tokens) for every recovery kind."""
    for _ in range(steps):
        picks = torch.randint(0, len(texts), (min(batch_size, len(texts)),), generator=generator).tolist()
        yield tokenizer([texts[i] for i in picks], return_tensors="pt", truncation=True, max_length=max_length,
                        padding=True)


def _lora(model: nn.Module, rank: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", target_modules=list(TARGETS),
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _train(trainable: nn.Module, loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
           batches: Iterator[dict[str, torch.Tensor]], lr: float, steps: int, desc: str,
           progress: bool) -> tuple[list[float], int]:
    """AdamW on the parameters of `trainable` that require grad; returns the loss of every step and the tokens seen."""
    trainable.train()
    optim = torch.optim.AdamW([p for p in trainable.parameters() if p.requires_grad], lr=lr)
    losses: list[float] = []
    tokens = 0
    for batch in tqdm(batches, total=steps, desc=desc, disable=not progress):
        tokens += int(batch["attention_mask"].sum())
        loss = loss_fn(batch)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
    return losses, tokens


def recover_lora(model: nn.Module, tokenizer, texts: Sequence[str],  # noqa: ANN001
                 options: RecoveryOptions = RecoveryOptions()) -> tuple[nn.Module, RecoveryReport]:
    """Train LoRA adapters on `texts` (LM loss) for `options.steps` steps, merge them, return (merged model, report)."""
    check_supported(model)
    texts, o = _texts(texts), options
    torch.manual_seed(o.seed)
    generator = torch.Generator().manual_seed(o.seed)
    peft_model = _lora(model, o.rank)

    def lm_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        device = next(peft_model.parameters()).device
        return peft_model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                          labels=labels.to(device)).loss

    losses, tokens = _train(peft_model, lm_loss, _batches(tokenizer, texts, o.steps, o.batch_size, o.max_length, generator),
                            o.lr, o.steps, "LoRA recovery", o.progress)
    merged = peft_model.merge_and_unload()
    merged.eval()
    return merged, RecoveryReport(steps=o.steps, first_loss=losses[0], last_loss=losses[-1], losses=tuple(losses),
                                tokens=tokens)


def recover_kd(model: nn.Module, teacher: nn.Module, tokenizer, texts: Sequence[str],  # noqa: ANN001
               options: RecoveryOptions = RecoveryOptions()) -> tuple[nn.Module, RecoveryReport]:
    """Distil `teacher` (the dense model) into the pruned `model` on `texts`; returns (model, report).

    The loss is `pip_core.distill.kd_loss` (T^2 * KL(teacher_T || student_T) per token, chunked so no
    model's logits exist for the whole sequence). `params="lora"` trains LoRA adapters and merges
    them; `kd_params="full"` trains every weight of `model` in place. The teacher is never changed.
    The batches are the same draws as `recover_lora` with the same seed (same token budget).
    """
    from pip_core.distill import kd_loss

    o, params = options, options.kd_params
    if params not in KD_PARAMS:
        raise PipCoreError(f"distillation params must be one of {KD_PARAMS}, got {params!r}")
    check_supported(model)
    texts = _texts(texts)
    torch.manual_seed(o.seed)
    generator = torch.Generator().manual_seed(o.seed)
    trainable = _lora(model, o.rank) if params == "lora" else model
    teacher_modes = [(p, p.requires_grad) for p in teacher.parameters()]
    teacher_training = teacher.training
    teacher.eval()
    for p, _ in teacher_modes:
        p.requires_grad_(False)

    def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # peft injects the adapters into `model`'s own modules, so `model` itself runs with them
        return kd_loss(model, teacher, batch["input_ids"], batch["attention_mask"], o.temperature, o.chunk_tokens)

    try:
        losses, tokens = _train(trainable, loss, _batches(tokenizer, texts, o.steps, o.batch_size, o.max_length, generator),
                                o.lr, o.steps, f"KD recovery ({params})", o.progress)
    finally:
        for p, flag in teacher_modes:
            p.requires_grad_(flag)
        teacher.train(teacher_training)
    out = trainable.merge_and_unload() if params == "lora" else model
    out.eval()
    return out, RecoveryReport(steps=o.steps, first_loss=losses[0], last_loss=losses[-1], losses=tuple(losses),
                                tokens=tokens)
