"""Optional recovery fine-tuning after pruning: LoRA on the LM loss, or distillation from the dense model.

The merged result is the same model class with updated weights, so it saves as an ordinary
Hugging Face directory like any pruned model (no adapter files, no peft needed to load it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from pip_core.distill import TeacherOutputs, kd_loss, teacher_outputs
from pip_core.errors import CalibrationError, PipCoreError
from pip_core.precision import cpu_bf16_autocast
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
    #: KD only: "lora" trains adapters merged back, "full" every weight, "consumers" the consumers and norms at full
    #: rank (`consumer_params`)
    kd_params: str = "lora"
    #: KD only: softmax temperature of both models' logits
    temperature: float = 1.0
    #: KD only: tokens per chunk of the loss (None: pip_core.distill's default)
    chunk_tokens: int | None = None
    #: forward passes (teacher and student) under bf16 autocast where the model is fp32 on a CPU with native bf16
    #: (pip_core.precision); weights, optimizer state and the loss stay fp32
    cpu_bf16: bool = True
    #: share of the steps the learning rate warms up over, linearly (then it decays as `decay` says)
    warmup: float = 0.0
    #: after the warm-up: "constant" keeps `lr`, "cosine" decays to 0 at the last step (on SmolLM2-135M, 16 KD
    #: steps: constant x1.636 / x2.530 on Persuasion / WordNet, 10% warm-up + cosine x1.676 / x2.620;
    #: benchmarks/results/repair.md)
    decay: str = "constant"
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


def _order(n_texts: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Each step's text indices: a fresh seeded permutation per pass over the texts, so every text is seen
    once before any is seen twice (draws with replacement repeat some texts and never show others)."""
    generator = torch.Generator().manual_seed(seed)
    size = min(batch_size, n_texts)
    picks: list[int] = []
    while len(picks) < steps * size:
        picks += torch.randperm(n_texts, generator=generator).tolist()
    return [picks[i * size:(i + 1) * size] for i in range(steps)]


def _batches(tokenizer: PreTrainedTokenizerBase, texts: list[str], order: list[list[int]],
             max_length: int) -> Iterator[dict[str, torch.Tensor]]:
    """The batches of `order`, right-padded (the losses take a row's predicted positions from its mask)."""
    for picks in order:
        yield tokenizer([texts[i] for i in picks], return_tensors="pt", truncation=True, max_length=max_length,
                        padding=True, padding_side="right")


def _lora(model: nn.Module, rank: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", target_modules=list(TARGETS),
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _train(trainable: nn.Module, loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
           batches: Iterator[dict[str, torch.Tensor]], o: RecoveryOptions, desc: str) -> tuple[list[float], int]:
    """AdamW on the parameters of `trainable` that require grad, `o.lr` warmed up and decayed over `o.steps`;
    returns the loss of every step and the tokens seen. `o.cpu_bf16`: each forward under bf16 autocast where it
    pays (pip_core.precision), backward outside it."""
    trainable.train()
    optim = torch.optim.AdamW([p for p in trainable.parameters() if p.requires_grad], lr=o.lr)
    schedule = lr_schedule(optim, o)
    losses: list[float] = []
    tokens = 0
    for batch in tqdm(batches, total=o.steps, desc=desc, disable=not o.progress):
        tokens += int(batch["attention_mask"].sum())
        with cpu_bf16_autocast(trainable, o.cpu_bf16):
            loss = loss_fn(batch)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        schedule.step()
        losses.append(float(loss.detach()))
    return losses, tokens


def consumer_params(model: nn.Module) -> list[str]:
    """Names of the parameters kd_params "consumers" trains: every module that reads pruned units (the family's
    dim-1 slots: o_proj, down_proj) and every norm, from the family table."""
    family = check_supported(model)
    slots = {slot.module for kind in ("attn", "mlp") for slot in family.slots(kind) if slot.dim == 1}
    prefix = family.layers + "."
    names = []
    for name, _ in model.named_parameters():
        module = name.removeprefix(prefix).partition(".")[2] if name.startswith(prefix) else name
        module = module.rpartition(".")[0]  # less the parameter's own name (weight, bias)
        if module in slots or "norm" in module.rpartition(".")[2]:
            names.append(name)
    return names


def _train_only_consumers(model: nn.Module) -> list[nn.Parameter]:
    """Freeze every parameter but `consumer_params`; returns those frozen here (to be unfrozen after training)."""
    keep = set(consumer_params(model))
    frozen = [p for n, p in model.named_parameters() if n not in keep and p.requires_grad]
    for param in frozen:
        param.requires_grad_(False)
    return frozen


def lr_schedule(optim: torch.optim.Optimizer, o: RecoveryOptions) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `o.warmup` of the steps, then a cosine decay or a constant rate: a short recovery on a
    CPU budget spends its few steps at a rate that neither overshoots at the start nor stays high at the end.

    Step i (from 0) trains at lr x (i + 1) / (w + 1) while i < w, then x (1 + cos(pi (i - w) / (steps - w))) / 2:
    no step runs at a rate of 0 (transformers' schedules start at 0, a lost step of a 16-step budget).
    """
    if o.decay not in DECAYS:
        raise PipCoreError(f"unknown learning-rate decay {o.decay!r}; use one of {', '.join(DECAYS)}")
    if not 0.0 <= o.warmup < 1.0:
        raise PipCoreError(f"warmup is a share of the steps in [0, 1), got {o.warmup}")
    w, steps = round(o.warmup * o.steps), max(o.steps, 1)

    def factor(i: int) -> float:
        if i < w:
            return (i + 1) / (w + 1)
        return 1.0 if o.decay == "constant" else 0.5 * (1.0 + math.cos(math.pi * (i - w) / max(steps - w, 1)))

    return torch.optim.lr_scheduler.LambdaLR(optim, factor)


#: what the learning rate does after the warm-up
DECAYS = ("cosine", "constant")


def recover_lora(model: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
                 options: RecoveryOptions = RecoveryOptions()) -> tuple[nn.Module, RecoveryReport]:
    """Train LoRA adapters on `texts` (LM loss) for `options.steps` steps, merge them, return (merged model, report)."""
    check_supported(model)
    texts, o = _texts(texts), options
    torch.manual_seed(o.seed)
    peft_model = _lora(model, o.rank)

    def lm_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        device = next(peft_model.parameters()).device
        return peft_model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                          labels=labels.to(device)).loss

    order = _order(len(texts), o.steps, o.batch_size, o.seed)
    losses, tokens = _train(peft_model, lm_loss, _batches(tokenizer, texts, order, o.max_length), o, "LoRA recovery")
    merged = peft_model.merge_and_unload()
    merged.eval()
    return merged, RecoveryReport(steps=o.steps, first_loss=losses[0], last_loss=losses[-1], losses=tuple(losses),
                                tokens=tokens)


def kd_teacher_outputs(teacher: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
                       options: RecoveryOptions = RecoveryOptions(), student: nn.Module | None = None) -> TeacherOutputs:
    """The teacher's outputs on the texts `recover_kd` draws with these options and texts, each text run once.

    A caller that owns the teacher computes these, drops the teacher and passes them to `recover_kd`:
    only the LM head stays in memory through training, and not even that when `student` (the model
    to be trained) is given, trains LoRA adapters only and has an equal head (`with_head_of`).
    """
    texts, o = _texts(texts), options
    seen = sorted({i for picks in _order(len(texts), o.steps, o.batch_size, o.seed) for i in picks})
    rows = tokenizer([texts[i] for i in seen], truncation=True, max_length=o.max_length)["input_ids"]
    with cpu_bf16_autocast(teacher, o.cpu_bf16):
        outputs = teacher_outputs(teacher, rows, o.batch_size)
    return outputs.with_head_of(student) if student is not None and o.kd_params == "lora" else outputs


def lora_params(model: nn.Module, rank: int) -> int:
    """Parameters of the LoRA adapters `_lora` adds to `model` (rank x (in + out) per targeted linear)."""
    return sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS)


def recover_kd(model: nn.Module, teacher: nn.Module | TeacherOutputs, tokenizer: PreTrainedTokenizerBase,
               texts: Sequence[str], options: RecoveryOptions = RecoveryOptions()) -> tuple[nn.Module, RecoveryReport]:
    """Distil `teacher` (the dense model, or its `kd_teacher_outputs`) into the pruned `model` on `texts`.

    The loss is `pip_core.distill.kd_loss` (T^2 * KL(teacher_T || student_T) per token, chunked so no
    model's logits exist for the whole sequence), on the teacher's outputs computed once per text
    before the first step (given a model, here; the same loss as running it on every batch).
    `kd_params="lora"` trains LoRA adapters and merges them; `"full"` trains every weight of `model` in place,
    `"consumers"` only the modules that read pruned units and the norms (`consumer_params`). The teacher is never
    changed. The batches are those of `recover_lora` with the same seed (same token budget). Returns (model, report).
    """
    o = options
    if o.kd_params not in KD_PARAMS:
        raise PipCoreError(f"distillation params must be one of {KD_PARAMS}, got {o.kd_params!r}")
    check_supported(model)
    outputs = teacher if isinstance(teacher, TeacherOutputs) else kd_teacher_outputs(teacher, tokenizer, texts, o, model)
    if o.kd_params == "full" and outputs.head is model.get_output_embeddings():
        raise PipCoreError("teacher outputs share the student's LM head, which kd_params 'full' would train")

    def loss(student: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return kd_loss(student, outputs, batch["input_ids"], batch["attention_mask"], o.temperature, o.chunk_tokens)

    return _distil(model, loss, tokenizer, texts, o)


def _distil(model: nn.Module, loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
            tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], o: RecoveryOptions) -> tuple[nn.Module, RecoveryReport]:
    """Train `model` (LoRA adapters merged back, or every weight) on `loss(model, batch)` over the recovery batches."""
    texts = _texts(texts)
    torch.manual_seed(o.seed)
    trainable = _lora(model, o.rank) if o.kd_params == "lora" else model
    frozen = _train_only_consumers(model) if o.kd_params == "consumers" else []
    order = _order(len(texts), o.steps, o.batch_size, o.seed)
    # peft injects the adapters into `model`'s own modules, so `model` itself runs with them
    try:
        losses, tokens = _train(trainable, lambda batch: loss(model, batch),
                                _batches(tokenizer, texts, order, o.max_length), o, f"KD recovery ({o.kd_params})")
    finally:
        for param in frozen:
            param.requires_grad_(True)
    out = trainable.merge_and_unload() if o.kd_params == "lora" else model
    out.eval()
    return out, RecoveryReport(steps=o.steps, first_loss=losses[0], last_loss=losses[-1], losses=tuple(losses),
                                tokens=tokens)
