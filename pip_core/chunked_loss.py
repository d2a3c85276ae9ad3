"""Causal-LM loss without materialising the logits of the whole sequence.

The logits (tokens x vocabulary floats, for both PIP views) are the largest tensor of a scoring
pass once the vocabulary reaches 128k. Here the base model gives the hidden states; the LM head,
the optional logit soft-capping and the cross-entropy then run over slices of the sequence. In a
backward pass each slice's logits are recomputed (activation checkpointing of the head alone), so
at most one slice of logits is alive at any time, forward or backward.

On CUDA the fused linear cross-entropy of liger-kernel is used when it is installed (optional
import): it never materialises more than a block of logits either. The torch path is the
reference and runs everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

#: float32 logits of one slice (all rows) at most: 64 MiB is 64 positions of a pair at a 128k vocabulary
LOGITS_SLICE_BYTES = 64 * 2**20
#: a slice's backward holds about four slices' worth (logits recomputed, log-softmax, both gradients): the
#: slice is kept to 1/32 of the LM head's bytes, so that burst stays within an eighth of the head
HEAD_FRACTION = 32
MIN_CHUNK_TOKENS = 16
#: fixed positions per slice instead of the byte budget (None: from the budget)
DEFAULT_CHUNK_TOKENS: int | None = None
IGNORE = -100


def chunk_tokens_for(vocab: int, batch: int, head_bytes: int | None = None) -> int:
    """Sequence positions per slice: one slice of float32 logits stays within LOGITS_SLICE_BYTES and
    1/HEAD_FRACTION of the LM head's own bytes, so the logits never dominate a small model's memory
    either (measured on SmolLM2-135M: a quarter of the head made scoring's peak 80 MiB above its floor)."""
    if DEFAULT_CHUNK_TOKENS is not None:
        return DEFAULT_CHUNK_TOKENS
    budget = LOGITS_SLICE_BYTES if head_bytes is None else min(LOGITS_SLICE_BYTES, head_bytes // HEAD_FRACTION)
    return max(MIN_CHUNK_TOKENS, budget // (4 * max(vocab, 1) * max(batch, 1)))


def _head(model: nn.Module) -> tuple[nn.Module, nn.Module, float | None]:
    """(base model, LM head, soft-cap) of a Hugging Face causal LM."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or head is None:
        raise TypeError(f"{type(model).__name__} has no base model + LM head; chunked loss needs a causal LM")
    cap = getattr(model.config, "final_logit_softcapping", None)
    return base, head, (float(cap) if cap else None)


def _logits(head: nn.Module, hidden: torch.Tensor, cap: float | None) -> torch.Tensor:
    logits = head(hidden.to(head.weight.device)).float()
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _slice_nll(head: nn.Module, cap: float | None, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of each row of one slice (targets == IGNORE contribute nothing)."""
    logits = _logits(head, hidden, cap)
    rows, positions, vocab = logits.shape
    nll = nn.functional.cross_entropy(logits.reshape(rows * positions, vocab),  # contiguous: no transposed copy
                                      target.to(logits.device).reshape(-1), reduction="none", ignore_index=IGNORE)
    return nll.view(rows, positions).sum(1)


def hidden_states(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states of the base model (the LM head is not applied)."""
    base, _, _ = _head(model)
    return base(input_ids=ids, attention_mask=mask).last_hidden_state


def _targets(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    target = ids[:, 1:].clone()
    target[mask[:, 1:] == 0] = IGNORE
    return target


def _liger_loss() -> Callable | None:
    try:  # optional: only where liger-kernel (triton) is installed
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss


def fused_available(device: torch.device) -> bool:
    """True where the fused CUDA kernel will be used for `device`."""
    return device.type == "cuda" and _liger_loss() is not None


def per_sequence_nll(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, chunk_tokens: int | None = None,
                     fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token NLL, number of predicted tokens) of each row, in float32.

    `chunk_tokens` defaults to `chunk_tokens_for(vocab, rows)`; `fused=None` uses liger-kernel on
    CUDA when installed, the chunked torch path otherwise.
    """
    _, head, cap = _head(model)
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(head.weight.shape[0], ids.shape[0],
                                        head.weight.numel() * head.weight.element_size())
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    hidden = hidden_states(model, ids, mask)[:, :-1]
    target = _targets(ids, mask)
    counts = (target != IGNORE).sum(1).float()
    use_fused = fused_available(hidden.device) if fused is None else fused
    if use_fused:
        return _fused_nll(head, cap, hidden, target), counts
    total = torch.zeros(ids.shape[0], dtype=torch.float32, device=head.weight.device)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, hidden.shape[1], chunk_tokens):
        h, t = hidden[:, start:start + chunk_tokens], target[:, start:start + chunk_tokens]
        if grad:  # recompute this slice's logits in backward instead of keeping them
            total = total + checkpoint(_slice_nll, head, cap, h, t, use_reentrant=False)
        else:
            total = total + _slice_nll(head, cap, h, t)
    return total, counts.to(total.device)


def _fused_nll(head: nn.Module, cap: float | None, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed NLL per row through liger's fused linear cross-entropy (one call per row: its reduction is global)."""
    loss_cls = _liger_loss()
    kwargs = {"ignore_index": IGNORE, "reduction": "sum"}
    if cap is not None:
        kwargs["softcap"] = cap
    loss_fn = loss_cls(**kwargs)
    bias = getattr(head, "bias", None)
    rows = []
    for row in range(hidden.shape[0]):
        h = hidden[row].to(head.weight.device).contiguous()
        rows.append(loss_fn(head.weight, h, target[row].to(h.device).contiguous(), bias).float())
    return torch.stack(rows)


def per_sequence_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, chunk_tokens: int | None = None,
                      fused: bool | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of each row over its own (unpadded) tokens, computed in slices."""
    nll, counts = per_sequence_nll(model, ids, mask, chunk_tokens, fused)
    return nll / counts


def full_logits_per_sequence_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reference: the same loss from the model's whole logits tensor (memory grows with tokens x vocabulary)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = ids[:, 1:]
    valid = mask[:, 1:].to(logits.dtype)
    nll = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    return (nll * valid).sum(1) / valid.sum(1)
