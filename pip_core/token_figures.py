"""A model's next-token NLL and argmax at every position of a fixed token set, and two models compared by them.

The general held-out set is tens of thousands of tokens: the dense model's log-probabilities there would be
30k x 49k x 4 bytes (6 GB), too much to keep for a KL. Its NLL and argmax per token are 8 bytes a token, enough for
the perplexity ratio and the top-1 agreement of any later model, which then runs alone. Windows run in batches
(right-padded, masked); the vocabulary projection runs over a slice of the batch's positions at a time, so no
[tokens x vocab] tensor of a whole batch is ever alive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pip_core.chunked_loss import _head, _logits, chunk_tokens_for, hidden_states
from pip_core.errors import PipCoreError
from pip_core.precision import cpu_bf16_autocast

#: tokens of one forward batch (windows are grouped up to this many, padding included)
BATCH_TOKENS = 4096


@dataclass(frozen=True)
class TokenFigures:
    """NLL (float32) and argmax (int64) of one model at every predicted position, windows concatenated in order."""

    nll: torch.Tensor
    argmax: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.nll.numel())

    def metrics(self) -> dict[str, float]:
        nll = float(self.nll.double().mean())
        return {"nll": nll, "perplexity": math.exp(nll), "tokens": float(self.tokens)}

    def against(self, dense: TokenFigures) -> dict[str, float]:
        """This model's figures with its perplexity ratio and top-1 agreement to `dense` (same tokens, same order)."""
        if dense.tokens != self.tokens:
            raise PipCoreError(f"token figures cover {self.tokens} tokens, the dense model's {dense.tokens}: "
                               "not the same token set")
        gap = float(self.nll.double().mean() - dense.nll.double().mean())
        agree = float((self.argmax == dense.argmax).double().mean())
        return {**self.metrics(), "ppl_ratio": math.exp(gap), "top1_agreement": agree}

    def save(self, path: Path) -> None:
        """One .pt file (a few hundred KB for 30k tokens); written whole by the caller's atomic rename."""
        torch.save({"nll": self.nll, "argmax": self.argmax}, Path(path))

    @classmethod
    def load(cls, path: Path) -> TokenFigures:
        data = torch.load(Path(path), weights_only=True)
        return cls(nll=data["nll"], argmax=data["argmax"])


def batches(windows: Sequence[Sequence[int]], batch_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Indexes of consecutive windows grouped so each batch's padded size stays within `batch_tokens`."""
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, ids in enumerate(windows):
        if current and max(longest, len(ids)) * (len(current) + 1) > batch_tokens:
            out.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, len(ids))
    if current:
        out.append(current)
    return out


@torch.inference_mode()
def token_figures(model: nn.Module, windows: Sequence[Sequence[int]], batch_tokens: int = BATCH_TOKENS,
                  chunk_tokens: int | None = None, cpu_bf16: bool = False) -> TokenFigures:
    """NLL and argmax of `model` at each position after the first of every window (token ids, unpadded).

    `chunk_tokens`: rows of hidden states projected to the vocabulary at once; default: LOGITS_SLICE_BYTES of
    float32 logits (341 rows of a 49k vocabulary). Not chunked_loss's 1/32 of the head, which bounds a backward pass:
    here a slice's logits and its log-softmax are all that is alive, and 18-row slices made the projection 3.5x
    slower on SmolLM2-135M (the head's weights are read once per slice). `cpu_bf16`: under bf16 autocast where
    the CPU has it natively (pip_core.precision): compare only figures made in the same precision.
    """
    if not windows or any(len(w) < 2 for w in windows):
        raise PipCoreError("token figures need windows of at least 2 tokens each")
    _, head, cap = _head(model)
    rows = chunk_tokens or chunk_tokens_for(head.weight.shape[0], 1)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll, argmax = [], []
    try:
        with cpu_bf16_autocast(model, cpu_bf16):
            for group in batches(windows, batch_tokens):
                longest = max(len(windows[i]) for i in group)
                ids = torch.zeros(len(group), longest, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, i in enumerate(group):
                    ids[row, :len(windows[i])] = torch.as_tensor(windows[i])
                    mask[row, :len(windows[i])] = 1
                ids, mask = ids.to(device), mask.to(device)
                hidden = hidden_states(model, ids, mask)[:, :-1]
                keep = mask[:, 1:].bool()  # row-major: window after window, position after position
                states, targets = hidden[keep], ids[:, 1:][keep]
                for s in range(0, states.shape[0], rows):
                    logits = _logits(head, states[s:s + rows], cap)
                    nll.append(nn.functional.cross_entropy(logits, targets[s:s + rows].to(logits.device),
                                                           reduction="none").cpu())
                    argmax.append(logits.argmax(-1).cpu())
    finally:
        model.train(was_training)
    return TokenFigures(nll=torch.cat(nll).float(), argmax=torch.cat(argmax).long())
