"""Iterative schedule: reach the target ratio in N steps, re-scoring the pruned model each step."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from pip_core import importance, prune
from pip_core.errors import PipCoreError
from pip_core.importance import CalibrationData
from pip_core.units import Unit, discover, param_count
from pip_core.vocabulary import MAX_RATIO

log = logging.getLogger(__name__)


def check_ratio(ratio: float) -> None:
    if not isinstance(ratio, (int, float)) or math.isnan(ratio) or not 0.0 < ratio <= MAX_RATIO:
        raise PipCoreError(f"ratio must be in (0, {MAX_RATIO}], got {ratio}")


def plan(target_ratio: float, iterations: int) -> list[float]:
    """Cumulative ratio after each step, linear in parameters removed."""
    check_ratio(target_ratio)
    if not isinstance(iterations, int) or iterations < 1:
        raise PipCoreError(f"iterations must be >= 1, got {iterations}")
    return [target_ratio * (i + 1) / iterations for i in range(iterations)]


@dataclass(frozen=True)
class StepSpec:
    """What one pruning step must do: the single place the per-step seed and budget are decided."""

    step: int
    target_ratio: float
    params_to_remove: int
    seed: int


def step_spec(step: int, cumulative_ratio: float, total_params: int, current_params: int, seed: int) -> StepSpec:
    """Step `step` (1-based) removes what brings the model to `cumulative_ratio` of `total_params`.

    The seed advances with the step (`seed + step - 1`) so random scores and sampling differ
    between steps but a rerun is identical; the flow and `prune_iteratively` both come here.
    """
    to_remove = round(cumulative_ratio * total_params) - (total_params - current_params)
    return StepSpec(step=step, target_ratio=cumulative_ratio, params_to_remove=to_remove, seed=seed + step - 1)


@dataclass(frozen=True)
class ScoringOptions:
    """How units are scored and which layers are off limits (the config's scoring group, as pip_core sees it)."""

    method: str
    kind: str
    max_length: int = 128
    protect_first: int = 1
    protect_last: int = 1
    gradient_checkpointing: bool = False
    #: "uniform": every layer keeps the same widths (stock config); "per_layer": each its own
    width_mode: str = "uniform"
    #: uniform width mode: every layer keeps a multiple of `align` MLP channels (1: any width)
    align: int = 1
    #: uniform width mode: "params" shares a step between attention and MLP by their parameters, "scores" by the
    #: units' standardised scores
    width_split: str = "params"


def score_step(model: nn.Module, data: CalibrationData, spec: StepSpec, options: ScoringOptions,
               progress: bool = True) -> tuple[list[Unit], list[float]]:
    """First half of a step: every unit of the current model and its score."""
    units = discover(model, options.kind)
    scores = importance.score(model, options.method, units, data, seed=spec.seed, max_length=options.max_length,
                              progress=progress, gradient_checkpointing=options.gradient_checkpointing)
    return units, [float(x) for x in scores.tolist()]


def select_step(units: Sequence[Unit], scores: Sequence[float], spec: StepSpec, options: ScoringOptions) -> list[Unit]:
    """Second half of a step: the lowest-scoring units worth the step's budget, protected layers excluded."""
    return prune.select(units, scores, spec.params_to_remove, protect_first=options.protect_first,
                        protect_last=options.protect_last, width_mode=options.width_mode, align=options.align,
                        width_split=options.width_split)


@dataclass
class StepReport:
    step: int
    target_ratio: float
    achieved_ratio: float
    num_params: int
    removed: list[Unit]
    scores: list[float] = field(repr=False)
    units: list[Unit] = field(repr=False)


def step(model: nn.Module, data: CalibrationData, spec: StepSpec, options: ScoringOptions, total_params: int, *,
         progress: bool = True) -> StepReport:
    """One pruning step in place: score, select, remove. The flow's tasks run these same three parts."""
    units, scores = score_step(model, data, spec, options, progress=progress)
    chosen = select_step(units, scores, spec, options)
    prune.apply(model, chosen)
    now = param_count(model)
    return StepReport(step=spec.step, target_ratio=spec.target_ratio, achieved_ratio=(total_params - now) / total_params,
                      num_params=now, removed=chosen, scores=scores, units=units)


@dataclass
class IterativeResult:
    params_before: int
    params_after: int
    steps: list[StepReport]

    @property
    def achieved_ratio(self) -> float:
        return (self.params_before - self.params_after) / self.params_before


def prune_iteratively(model: nn.Module, data: CalibrationData, options: ScoringOptions, target_ratio: float,
                      iterations: int, *, seed: int = 0, progress: bool = True) -> IterativeResult:
    """Prune `model` in place to `target_ratio` of its parameters removed, in `iterations` calls of `step`.

    The ratio counts all parameters (embeddings included), as LLM-Pruner reports it.
    """
    total = param_count(model)
    steps: list[StepReport] = []
    for i, ratio in enumerate(plan(target_ratio, iterations), start=1):
        spec = step_spec(i, ratio, total, param_count(model), seed)
        report = step(model, data, spec, options, total, progress=progress)
        log.info("step %d: removed %d %s units, ratio %.4f (target %.4f)", i, len(report.removed), options.kind,
                 report.achieved_ratio, ratio)
        steps.append(report)
    return IterativeResult(params_before=total, params_after=param_count(model), steps=steps)
