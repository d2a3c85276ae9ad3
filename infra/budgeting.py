"""The compress config's budget, as the planner in `pip_core.budget` takes it (one mapping, three callers:
the preflight check, the flow's plan task and `pipprune plan`)."""

from __future__ import annotations

from dataclasses import fields

from infra.config import CompressConfig, ScoringSettings, ServingSettings
from pip_core.budget import BudgetPlan, Serving, Target, plan_budget
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


def deep_cut_refusal(plan: BudgetPlan) -> str:
    """Why a target that guts the decoder layers stops before any work, and what the user can do instead."""
    share = 1 - plan.body.params_before / plan.params_before
    asked = Target.parse(plan.target)
    layers = asked.value if asked.kind == "ratio" else round(plan.achieved_ratio, 2)
    return (f"target {plan.target} takes {plan.body.describe()}: the embeddings and the head, {share:.0%} of this "
            f"model, are not pruned, so the layers pay for all of it. Ask for less (--ratio "
            f"{plan.largest_shallow_ratio():g} takes half of the layers' parameters), give the target over the layers "
            f"alone (--target layers={layers:g} takes {layers:.0%} of them), or confirm this one with "
            "--allow-deep-cut (config: allow_deep_cut: true)")


def refusal(exc: Exception) -> str:
    """The one-line refusal of an infeasible target, with the nearest feasible one."""
    nearest = getattr(exc, "nearest", None)
    return f"{exc}; nearest feasible target: --target {nearest}" if nearest else str(exc)
