"""Knowledge-distillation loss from a teacher (the dense model), chunked over the sequence.

KL(teacher || student) per predicted token, on logits softened by a temperature T and scaled by
T^2 (so gradients keep their size as T changes; Hinton et al. 2015). It is the quantity the
evaluation reports as `heldout_kl` (at T = 1), so distillation optimises what is measured.

Neither model's logits exist for the whole sequence: both base models give hidden states, then
the two LM heads, the soft-capping and the KL run over slices of `chunk_tokens` positions, and in
a backward pass each slice is recomputed (activation checkpointing of the heads alone), as in
`pip_core.chunked_loss`. At most one slice of [rows x chunk x vocab] teacher and student logits
is alive at any time. The teacher runs without gradients.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pip_core.chunked_loss import _head, _logits, chunk_tokens_for
from pip_core.errors import PipCoreError


def _slice_kl(s_head: nn.Module, s_cap: float | None, t_head: nn.Module, t_cap: float | None, s_hidden: torch.Tensor,
              t_hidden: torch.Tensor, valid: torch.Tensor, temperature: float) -> torch.Tensor:
    """Summed T^2 * KL(teacher_T || student_T) over the valid positions of one slice."""
    with torch.no_grad():
        logp_t = torch.log_softmax(_logits(t_head, t_hidden, t_cap) / temperature, -1)
    logp_s = torch.log_softmax(_logits(s_head, s_hidden, s_cap) / temperature, -1)
    logp_t = logp_t.to(logp_s.device)
    kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)
    return (kl * valid.to(kl.device)).sum() * temperature ** 2


def kd_loss(student: nn.Module, teacher: nn.Module, ids: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0,
            chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean over predicted (unpadded) tokens of T^2 * KL(softmax(z_t / T) || softmax(z_s / T)), in float32."""
    if temperature <= 0:
        raise PipCoreError(f"distillation temperature must be > 0, got {temperature}")
    if student.config.vocab_size != teacher.config.vocab_size:
        raise PipCoreError(f"vocabularies differ: student {student.config.vocab_size}, "
                           f"teacher {teacher.config.vocab_size}")
    s_base, s_head, s_cap = _head(student)
    t_base, t_head, t_cap = _head(teacher)
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(s_head.weight.shape[0], 2 * ids.shape[0],
                                        s_head.weight.numel() * s_head.weight.element_size())
    if chunk_tokens < 1:
        raise PipCoreError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    t_device = next(teacher.parameters()).device
    with torch.no_grad():
        t_hidden = t_base(input_ids=ids.to(t_device), attention_mask=mask.to(t_device)).last_hidden_state[:, :-1]
    s_device = next(student.parameters()).device
    s_hidden = s_base(input_ids=ids.to(s_device), attention_mask=mask.to(s_device)).last_hidden_state[:, :-1]
    valid = mask[:, 1:].to(torch.float32)
    n = valid.sum()
    if n == 0:
        raise PipCoreError("distillation batch has no predicted tokens")
    total = torch.zeros((), dtype=torch.float32, device=s_head.weight.device)
    grad = torch.is_grad_enabled() and s_hidden.requires_grad
    for start in range(0, s_hidden.shape[1], chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        args = (s_head, s_cap, t_head, t_cap, s_hidden[:, sl], t_hidden[:, sl], valid[:, sl], float(temperature))
        if grad:  # recompute this slice's logits in backward instead of keeping them
            total = total + checkpoint(_slice_kl, *args, use_reentrant=False)
        else:
            total = total + _slice_kl(*args)
    return total / n.to(total.device)


def full_logits_kd_loss(student: nn.Module, teacher: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """The reference: the same loss from both models' whole logits tensors (memory grows with tokens x vocab)."""
    with torch.no_grad():
        z_t = teacher(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    z_s = student(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp_t = torch.log_softmax(z_t / temperature, -1)
    logp_s = torch.log_softmax(z_s / temperature, -1)
    kl = torch.nn.functional.kl_div(logp_s, logp_t, log_target=True, reduction="none").sum(-1)
    valid = mask[:, 1:].to(kl.dtype)
    return (kl * valid).sum() / valid.sum() * temperature ** 2
