"""Optional recovery fine-tuning after pruning: LoRA on calibration text, merged back into the weights.

The merged result is the same model class with updated weights, so it saves as an ordinary
Hugging Face directory like any pruned model (no adapter files, no peft needed to load it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from pip_core.errors import CalibrationError
from pip_core.units import check_supported

log = logging.getLogger(__name__)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class RecoveryReport:
    steps: int
    first_loss: float
    last_loss: float
    losses: tuple[float, ...] = ()


def recover_lora(model: nn.Module, tokenizer, texts: Sequence[str], steps: int = 60, rank: int = 8,  # noqa: ANN001
                 lr: float = 2e-3, batch_size: int = 8, max_length: int = 128, seed: int = 0,
                 progress: bool = True) -> tuple[nn.Module, RecoveryReport]:
    """Train LoRA adapters on `texts` for `steps` steps, merge them, return (merged model, report)."""
    from peft import LoraConfig, get_peft_model

    check_supported(model)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationError("recovery needs at least one non-empty calibration text")
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", target_modules=list(TARGETS),
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    peft_model.train()
    optim = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    losses: list[float] = []
    for _ in tqdm(range(steps), desc="LoRA recovery", disable=not progress):
        picks = torch.randint(0, len(texts), (min(batch_size, len(texts)),), generator=generator).tolist()
        batch = tokenizer([texts[i] for i in picks], return_tensors="pt", truncation=True, max_length=max_length,
                          padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        device = next(peft_model.parameters()).device
        loss = peft_model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                          labels=labels.to(device)).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
    merged = peft_model.merge_and_unload()
    merged.eval()
    return merged, RecoveryReport(steps=steps, first_loss=losses[0], last_loss=losses[-1], losses=tuple(losses))
