"""Gradient checkpointing for the length of one job (scoring, recovery), restored afterwards.

Each layer's activations are recomputed during backward instead of stored: the same gradients,
the activation memory of one layer instead of all of them. `pip_core.placement` decides when.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from pip_core.errors import PipCoreError


@contextmanager
def activation_checkpointing(model: nn.Module, on: bool = True) -> Iterator[nn.Module]:
    """Switch HF gradient checkpointing on for the block (a no-op when `on` is false).

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
    model.train()
    try:
        yield model
    finally:
        (model.activation_checkpointing_disable if hasattr(model, "activation_checkpointing_disable")
         else model.gradient_checkpointing_disable)()
        model.train(was_training)
