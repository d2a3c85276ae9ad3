"""The compress config's budget, as the planner in `pip_core.budget` takes it (one mapping, three callers:
the preflight check, the flow's plan task and `pipprune plan`)."""

from __future__ import annotations

from infra.config import CompressConfig
from pip_core.budget import BudgetPlan, Serving, plan_budget


def plan_for(config: CompressConfig, model_config: dict) -> BudgetPlan:
    """The plan of `config`'s target on the model `model_config` (config.json) describes; BudgetError if infeasible."""
    scoring = config.scoring
    return plan_budget(model_config, config.budget_target(), unit=scoring.unit, width_mode=scoring.width_mode,
                       iterations=scoring.iterations, align=scoring.align, protect_first=scoring.protect_first,
                       protect_last=scoring.protect_last, dtype=config.runtime.dtype,
                       serving=Serving(config.serving.context, config.serving.batch))


def refusal(exc: Exception) -> str:
    """The one-line refusal of an infeasible target, with the nearest feasible one."""
    nearest = getattr(exc, "nearest", None)
    return f"{exc}; nearest feasible target: --target {nearest}" if nearest else str(exc)
