"""The compress config's budget, as the planner in `pip_core.budget` takes it (one mapping, three callers:
the preflight check, the flow's plan task and `pipprune plan`)."""

from __future__ import annotations

from dataclasses import fields

from infra.config import CompressConfig, ScoringSettings, ServingSettings
from pip_core.budget import BudgetPlan, Serving, plan_budget
from pip_core.rules import Selection


def plan_for(config: CompressConfig, model_config: dict) -> BudgetPlan:
    """The plan of `config`'s target on the model `model_config` (config.json) describes; BudgetError if infeasible."""
    return plan_with(model_config, config.budget_target(), config.scoring, config.serving, config.runtime.dtype)


def plan_with(model_config: dict, target: str, scoring: ScoringSettings, serving: ServingSettings,
              dtype: str = "auto") -> BudgetPlan:
    """The plan of `target` with the job's scoring and serving groups passed whole (what `pipprune plan` calls)."""
    selection = Selection(**scoring.model_dump(include={f.name for f in fields(Selection)}))
    return plan_budget(model_config, target, selection, iterations=scoring.iterations, dtype=dtype,
                       serving=Serving(serving.context, serving.batch))


def refusal(exc: Exception) -> str:
    """The one-line refusal of an infeasible target, with the nearest feasible one."""
    nearest = getattr(exc, "nearest", None)
    return f"{exc}; nearest feasible target: --target {nearest}" if nearest else str(exc)
