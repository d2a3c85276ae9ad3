"""The selection rules, written once: which layers a step may touch, what every layer and the model keep,
how a budget is shared between unit kinds, and how a block budget rounds.

`prune.select` applies them to scored units; `budget._Planner` applies them to a model's shape (no
scores) to predict what a run ends at. Both read them from here, so `pipprune plan` cannot drift
from the run (tests/test_budget.py checks the two agree for every unit kind).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Selection:
    """What a step may cut: the unit kind, uniform or per-layer widths, the MLP alignment, the protected layers.

    The field names are the config's (`infra.config.ScoringSettings`), so the job's scoring group maps onto it whole.
    """

    unit: str = "width"
    #: "uniform": every layer keeps the same widths (stock config); "per_layer": each its own
    width_mode: str = "uniform"
    #: uniform widths: every layer keeps a multiple of `align` MLP channels (1: any width)
    align: int = 64
    protect_first: int = 1
    protect_last: int = 1


#: every decoder layer keeps at least this many units of each width kind (attention group, MLP channel)
KEEP_PER_LAYER = 1
#: the model keeps at least this many decoder blocks
KEEP_BLOCKS = 1


def protected_layers(num_layers: int, protect_first: int, protect_last: int) -> set[int]:
    """The first `protect_first` and last `protect_last` layers: never pruned (per-layer widths and blocks)."""
    return set(range(min(protect_first, num_layers))) | set(range(max(0, num_layers - protect_last), num_layers))


def removable_blocks(num_layers: int, protect_first: int, protect_last: int) -> int:
    """How many blocks one step may remove: unprotected ones, the model keeping `KEEP_BLOCKS`."""
    protected = len(protected_layers(num_layers, protect_first, protect_last))
    return max(0, min(num_layers - KEEP_BLOCKS, num_layers - protected))


def removable_per_layer(width: int) -> int:
    """How many units of one width kind a layer of `width` units may lose (it keeps `KEEP_PER_LAYER`)."""
    return max(0, width - KEEP_PER_LAYER)


def blocks_for(budget: int, block_params: int) -> int:
    """Blocks a budget of `budget` parameters removes: rounded up (the selector covers the budget, overshoot
    below one block), since the lowest-scoring blocks are taken until the budget is met."""
    return math.ceil(budget / block_params)


def kind_share(target: int, kind_params: int, total_params: int, remaining: int, last: bool) -> int:
    """One kind's share of a step's `target`: proportional to its prunable parameters (scores of different kinds
    are not on one scale); the last kind (the largest) takes what the others left (`remaining`)."""
    return remaining if last else round(target * kind_params / total_params)
