"""Greedy continuations of fixed prompts: what a person reads to judge whether a model still talks sense."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase


@torch.no_grad()
def greedy_continuations(model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str],
                         new_tokens: int) -> list[str]:
    """Each prompt's greedy continuation (decoded, the prompt itself left out), one prompt at a time.

    One at a time, unpadded, so a continuation never depends on which other prompts were asked.
    """
    device = next(model.parameters()).device
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        out.append(tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True))
    return out
