"""Iterative schedule: reach the target ratio in N steps, re-scoring the pruned model each step."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torch import nn

from pip_core import importance, prune
from pip_core.errors import PipCoreError
from pip_core.units import Unit, discover, param_count

log = logging.getLogger(__name__)

MAX_RATIO = 0.9


def check_ratio(ratio: float) -> None:
    if not isinstance(ratio, (int, float)) or math.isnan(ratio) or not 0.0 < ratio <= MAX_RATIO:
        raise PipCoreError(f"ratio must be in (0, {MAX_RATIO}], got {ratio}")


def plan(target_ratio: float, iterations: int) -> list[float]:
    """Cumulative ratio after each step, linear in parameters removed."""
    check_ratio(target_ratio)
    if not isinstance(iterations, int) or iterations < 1:
        raise PipCoreError(f"iterations must be >= 1, got {iterations}")
    return [target_ratio * (i + 1) / iterations for i in range(iterations)]


@dataclass
class StepReport:
    step: int
    target_ratio: float
    achieved_ratio: float
    num_params: int
    removed: list[Unit]
    scores: list[float] = field(repr=False)
    units: list[Unit] = field(repr=False)


@dataclass
class IterativeResult:
    params_before: int
    params_after: int
    steps: list[StepReport]

    @property
    def achieved_ratio(self) -> float:
        return (self.params_before - self.params_after) / self.params_before


def prune_iteratively(model: nn.Module, tokenizer, method: str, kind: str, target_ratio: float,  # noqa: ANN001
                      iterations: int, *, pairs: Sequence[tuple[str, str]] | None = None,
                      texts: Sequence[str] | None = None, seed: int = 0, max_length: int = 128,
                      protect_first: int = 1, protect_last: int = 1,
                      callback: Callable[[int, StepReport], None] | None = None,
                      progress: bool = True) -> IterativeResult:
    """Prune `model` in place to `target_ratio` of its parameters removed, in `iterations` steps.

    The ratio counts all parameters (embeddings included), as LLM-Pruner reports it.
    """
    cumulative = plan(target_ratio, iterations)
    total = param_count(model)
    steps: list[StepReport] = []
    for step, ratio in enumerate(cumulative, start=1):
        units = discover(model, kind)
        scores = importance.score(model, method, units, tokenizer=tokenizer, pairs=pairs, texts=texts,
                                  seed=seed + step - 1, max_length=max_length, progress=progress)
        to_remove = round(ratio * total) - (total - param_count(model))
        chosen = prune.select(units, scores, to_remove, protect_first=protect_first, protect_last=protect_last)
        prune.apply(model, chosen)
        now = param_count(model)
        report = StepReport(step=step, target_ratio=ratio, achieved_ratio=(total - now) / total, num_params=now,
                            removed=chosen, scores=scores.tolist(), units=units)
        log.info("step %d: removed %d %s units, ratio %.4f (target %.4f)", step, len(chosen), kind,
                 report.achieved_ratio, ratio)
        steps.append(report)
        if callback is not None:
            callback(step, report)
    return IterativeResult(params_before=total, params_after=param_count(model), steps=steps)
