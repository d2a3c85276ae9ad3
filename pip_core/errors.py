"""Errors pip_core raises for bad input; each message names the offending value."""

from __future__ import annotations


class PipCoreError(ValueError):
    """Base class: bad input to the pruning algorithm."""


class UnsupportedArchitectureError(PipCoreError):
    """The model is not a Llama-layout decoder (Llama, Mistral, Qwen2)."""


class CalibrationError(PipCoreError):
    """Calibration texts are missing, empty or too short."""


class PruneError(PipCoreError):
    """The requested pruning cannot be done (target unreachable, would empty a layer...)."""
