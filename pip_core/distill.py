"""Knowledge-distillation loss from a teacher (the dense model), chunked over the sequence.

KL(teacher || student) per predicted token, on logits softened by a temperature T and scaled by
T^2 (so gradients keep their size as T changes; Hinton et al. 2015). It is the quantity the
evaluation reports as `heldout_kl` (at T = 1), so distillation optimises what is measured.

The teacher's side of the loss is its final hidden states (after its final norm) and its LM head.
Recovery computes the hidden states once per text (`teacher_outputs`, one inference pass) instead
of once per draw, and then needs only the head: [tokens x hidden] floats per text, against the
teacher's whole body running every step. Passing the live teacher gives the same loss.

Neither model's logits exist for the whole sequence: the two LM heads, the soft-capping and the KL
run over slices of `chunk_tokens` positions. With gradients on, each slice's gradient with respect
to the student's hidden states (and its head, when trained) is taken while the slice is in hand,
so backward never recomputes a slice: one head product per model and one for the gradient per
slice, against five with the slice recomputed in backward. At most one slice of
[rows x chunk x vocab] teacher and student logits is alive at any time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pip_core.chunked_loss import _head, _logits, chunk_tokens_for
from pip_core.errors import PipCoreError


@dataclass(frozen=True)
class TeacherOutputs:
    """What the loss needs of the teacher, computed once per text: see `teacher_outputs`.

    `hidden` maps each text's token ids (unpadded) to the teacher's final hidden states of those
    tokens, [tokens x hidden] in the teacher's dtype; `head` and `cap` are its LM head and
    logit soft-cap. Holding these keeps the head's weight alive, not the teacher's body.
    """

    hidden: dict[tuple[int, ...], torch.Tensor]
    head: nn.Module
    cap: float | None

    @property
    def vocab_size(self) -> int:
        return int(self.head.weight.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the cached hidden states (the head is counted with the weights)."""
        return sum(h.numel() * h.element_size() for h in self.hidden.values())

    def with_head_of(self, student: nn.Module) -> TeacherOutputs:
        """These outputs with `student`'s LM head standing in for an equal one of the teacher's.

        Width pruning leaves the head as it is, and LoRA training does not touch it: sharing it
        frees the teacher's copy (the head is a fifth of SmolLM2-135M's weights). Only for a
        student whose head stays frozen while these outputs are in use.
        """
        _, head, cap = _head(student)
        mine, theirs = self.head.state_dict(), head.state_dict()
        same = cap == self.cap and mine.keys() == theirs.keys() and all(
            mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k].to(mine[k].device)) for k in mine)
        return replace(self, head=head) if same else self

    def batch(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[rows x positions x hidden] hidden states of a batch: each row's cached states at its unpadded positions."""
        keep = mask.bool()
        rows = []
        for row in range(ids.shape[0]):
            key = tuple(ids[row][keep[row]].tolist())
            if key not in self.hidden:
                raise PipCoreError(f"no cached teacher outputs for batch row {row} ({len(key)} tokens): "
                                   "teacher_outputs was computed on other texts or another max_length")
            rows.append(self.hidden[key])
        first = rows[0]
        out = torch.zeros(*ids.shape, first.shape[-1], dtype=first.dtype, device=first.device)
        out[keep.to(first.device)] = torch.cat(rows)
        return out


@torch.inference_mode()
def teacher_outputs(teacher: nn.Module, rows: Sequence[Sequence[int]], batch_size: int = 8) -> TeacherOutputs:
    """One inference pass of `teacher` over `rows` (token ids of each text, unpadded), `batch_size` texts at a time.

    Texts are batched by length (little padding) and right-padded, so each text's states are those
    of the text alone; a text listed twice is run once. The teacher is left as it was (mode, grads).
    """
    if batch_size < 1:
        raise PipCoreError(f"teacher batch_size must be >= 1, got {batch_size}")
    base, head, cap = _head(teacher)
    device = next(teacher.parameters()).device
    keys = sorted({tuple(int(t) for t in r) for r in rows if len(r)}, key=len, reverse=True)
    hidden: dict[tuple[int, ...], torch.Tensor] = {}
    was_training = teacher.training
    teacher.eval()
    try:
        for start in range(0, len(keys), batch_size):
            group = keys[start:start + batch_size]
            ids = torch.zeros(len(group), len(group[0]), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, key in enumerate(group):
                ids[i, :len(key)] = torch.tensor(key)
                mask[i, :len(key)] = 1
            states = base(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            for i, key in enumerate(group):
                hidden[key] = states[i, :len(key)].clone()
    finally:
        teacher.train(was_training)
    return TeacherOutputs(hidden=hidden, head=head, cap=cap)


def _slice_kl(s_head: nn.Module, s_cap: float | None, t_head: nn.Module, t_cap: float | None, s_hidden: torch.Tensor,
              t_hidden: torch.Tensor, valid: torch.Tensor, temperature: float) -> torch.Tensor:
    """Summed T^2 * KL(teacher_T || student_T) over the valid positions of one slice."""
    def soft(logits: torch.Tensor) -> torch.Tensor:  # at T = 1 no pass over [rows x chunk x vocab]
        return torch.log_softmax(logits if temperature == 1 else logits / temperature, -1)

    with torch.no_grad():
        logp_t = soft(_logits(t_head, t_hidden, t_cap))
    logp_s = soft(_logits(s_head, s_hidden, s_cap))
    logp_t = logp_t.to(logp_s.device)
    kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)
    return (kl * valid.to(kl.device)).sum() * temperature ** 2


@dataclass(frozen=True)
class _Slices:
    """Everything of the loss but the student's hidden states and trained head parameters."""

    s_head: nn.Module
    s_cap: float | None
    t_head: nn.Module
    t_cap: float | None
    t_hidden: torch.Tensor
    valid: torch.Tensor
    temperature: float
    chunk_tokens: int

    def __iter__(self) -> Iterator[slice]:
        for start in range(0, self.t_hidden.shape[1], self.chunk_tokens):
            yield slice(start, start + self.chunk_tokens)

    def kl(self, s_slice: torch.Tensor, sl: slice) -> torch.Tensor:
        """The summed KL of positions `sl`, given the student's hidden states of those positions."""
        return _slice_kl(self.s_head, self.s_cap, self.t_head, self.t_cap, s_slice, self.t_hidden[:, sl],
                         self.valid[:, sl], self.temperature)


class _KLWithGradient(torch.autograd.Function):
    """The summed KL of every slice, its gradient taken slice by slice in forward (nothing recomputed in backward)."""

    @staticmethod
    def forward(ctx: Any, s_hidden: torch.Tensor, slices: _Slices, *params: torch.Tensor) -> torch.Tensor:
        grads = [torch.zeros_like(s_hidden), *(torch.zeros_like(p) for p in params)]
        total = torch.zeros((), dtype=torch.float32, device=slices.s_head.weight.device)
        for sl in slices:
            # contiguous: matmul folds a requiring-grad 3-D slice into one mm only when it is (else a bmm against
            # the head expanded per row: twice the time on CPU)
            h = s_hidden[:, sl].detach().contiguous().requires_grad_()
            with torch.enable_grad():
                loss = slices.kl(h, sl)
            parts = torch.autograd.grad(loss, [h, *params])
            grads[0][:, sl] = parts[0]
            for acc, part in zip(grads[1:], parts[1:], strict=True):
                acc += part
            total += loss.detach()
        ctx.save_for_backward(*grads)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_grad, *param_grads = ctx.saved_tensors
        return (hidden_grad * grad_out.to(hidden_grad.dtype), None,
                *(g * grad_out.to(g.dtype) for g in param_grads))


def _teacher_side(teacher: nn.Module | TeacherOutputs, ids: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, nn.Module, float | None, int]:
    """(final hidden states of the batch, LM head, soft-cap, vocabulary size) of the live or cached teacher."""
    if isinstance(teacher, TeacherOutputs):
        return teacher.batch(ids, mask), teacher.head, teacher.cap, teacher.vocab_size
    t_base, t_head, t_cap = _head(teacher)
    t_device = next(teacher.parameters()).device
    with torch.no_grad():
        hidden = t_base(input_ids=ids.to(t_device), attention_mask=mask.to(t_device)).last_hidden_state
    return hidden, t_head, t_cap, int(teacher.config.vocab_size)


def kd_chunk_tokens(student: nn.Module, batch: int) -> int:
    """The positions per slice `kd_loss` takes when not told (a slice holds two models' logits for `batch` rows);
    what a memory plan of the training must count, not the whole sequence."""
    head = _head(student)[1].weight
    return chunk_tokens_for(head.shape[0], 2 * batch, head.numel() * head.element_size())


def kd_loss(student: nn.Module, teacher: nn.Module | TeacherOutputs, ids: torch.Tensor, mask: torch.Tensor,
            temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean over predicted (unpadded) tokens of T^2 * KL(softmax(z_t / T) || softmax(z_s / T)), in float32.

    `teacher` is the dense model, run on the batch, or its `teacher_outputs` for the batch's texts.
    """
    if temperature <= 0:
        raise PipCoreError(f"distillation temperature must be > 0, got {temperature}")
    t_vocab = teacher.vocab_size if isinstance(teacher, TeacherOutputs) else int(teacher.config.vocab_size)
    if student.config.vocab_size != t_vocab:
        raise PipCoreError(f"vocabularies differ: student {student.config.vocab_size}, teacher {t_vocab}")
    s_base, s_head, s_cap = _head(student)
    if chunk_tokens is None:
        chunk_tokens = kd_chunk_tokens(student, ids.shape[0])
    if chunk_tokens < 1:
        raise PipCoreError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    valid = mask[:, 1:].to(torch.float32)
    n = valid.sum()
    if n == 0:
        raise PipCoreError("distillation batch has no predicted tokens")
    t_hidden, t_head, t_cap, _ = _teacher_side(teacher, ids, mask)
    s_device = next(student.parameters()).device
    s_hidden = s_base(input_ids=ids.to(s_device), attention_mask=mask.to(s_device)).last_hidden_state[:, :-1]
    slices = _Slices(s_head, s_cap, t_head, t_cap, t_hidden[:, :-1], valid, float(temperature), chunk_tokens)
    if torch.is_grad_enabled() and (s_hidden.requires_grad or any(p.requires_grad for p in s_head.parameters())):
        params = [p for p in s_head.parameters() if p.requires_grad]
        total = _KLWithGradient.apply(s_hidden, slices, *params)
    else:
        total = sum((slices.kl(s_hidden[:, sl], sl) for sl in slices), torch.zeros((), device=s_head.weight.device))
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
