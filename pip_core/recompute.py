"""Gradient checkpointing for the length of one job (scoring, recovery), restored afterwards.

Each layer's activations are recomputed during backward instead of stored: the same gradients,
the activation memory of one layer instead of all of them. `pip_core.placement` decides when for
scoring; recovery checkpoints only as many layers as its `memory_plan.TrainingPlan` needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from pip_core.errors import PipCoreError


@contextmanager
def activation_checkpointing(model: nn.Module, on: bool = True, layers: int | None = None) -> Iterator[nn.Module]:
    """Switch HF gradient checkpointing on for the block (a no-op when `on` is false).

    `layers`: checkpoint only the first `layers` decoder layers (None: all); the others keep their
    activations, so the recomputation is paid only for the memory that must be saved.
    HF only checkpoints in train mode, so the model is put in train mode; with dropout that would make
    results random, so a model with dropout is refused rather than silently changed.
    """
    if not on:
        yield model
        return
    if getattr(model.config, "attention_dropout", 0.0) or getattr(model.config, "hidden_dropout", 0.0):
        raise PipCoreError("gradient checkpointing needs train mode; this model has dropout, which would "
                           "make results random")
    was_training = model.training
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if layers is not None:
        _checkpoint_first(model, layers)
    model.train()
    try:
        yield model
    finally:
        (model.activation_checkpointing_disable if hasattr(model, "activation_checkpointing_disable")
         else model.gradient_checkpointing_disable)()
        model.train(was_training)


def _checkpoint_first(model: nn.Module, layers: int) -> None:
    """Leave checkpointing on for the first `layers` decoder layers only (HF's per-layer flag)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not 0 <= layers <= len(blocks):
        raise PipCoreError(f"cannot checkpoint {layers} layers of a model with {len(blocks)}")
    for index, block in enumerate(blocks):
        block.gradient_checkpointing = index < layers
