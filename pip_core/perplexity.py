"""Token-level perplexity on held-out texts: the cheap quality signal checked after every step."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pip_core.chunked_loss import per_sequence_nll


@torch.no_grad()
def perplexity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
               max_length: int = 256) -> dict[str, float]:
    """Mean negative log-likelihood per predicted token over all texts, and its exponential.

    The logits are computed a slice of the sequence at a time, so memory does not grow with
    tokens x vocabulary.
    """
    if not texts:
        raise ValueError("perplexity needs at least one held-out text")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    try:
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
            if ids.shape[1] < 2:
                continue
            ids = ids.to(device)
            nll, counts = per_sequence_nll(model, ids, torch.ones_like(ids))  # logits in slices
            total_nll += float(nll.sum())
            total_tokens += int(counts.sum())
    finally:
        model.train(was_training)
    if total_tokens == 0:
        raise ValueError("held-out texts are all shorter than 2 tokens")
    nll = total_nll / total_tokens
    return {"nll": nll, "perplexity": math.exp(nll), "tokens": float(total_tokens)}
