"""plan_budget: the run's target turned into a removal ratio and aligned widths, from config.json alone.

The CLI refuses an infeasible target before the flow starts (infra.preflight); this task plans the
same target again inside the flow (a config file run by a deployment skips the CLI) and logs the plan.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from prefect import task

from infra.budgeting import plan_for, refusal
from infra.config import CompressConfig, ScoringSettings
from infra.mlflow_utils import mlflow_client
from infra.tags import (
    ACHIEVED_PARAMS,
    ACHIEVED_RATIO,
    ALIGN,
    ALIGN_EFFECTIVE,
    PLANNED_MEMORY_BYTES,
    PLANNED_PARAMS,
    PLANNED_RATIO,
    TARGET,
)
from pip_core import io as core_io
from pip_core.budget import BudgetError, BudgetPlan
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.refs import BudgetRef, ModelRef, SourceRef

log = logging.getLogger(__name__)


@task(name="plan-budget")
def plan_budget(config: CompressConfig, source: SourceRef) -> BudgetRef:
    """The schedule the target needs on `source` (no weights read); ValueError naming the nearest feasible target."""
    try:
        plan = plan_for(config, core_io.read_config(source.given.local_dir),
                        vocab_after=source.vocab["vocab_after"] if source.vocab else None)
    except BudgetError as exc:
        raise ValueError(refusal(exc)) from None
    for note in plan.notes:
        log.warning(note)
    log.info("budget %s: %d -> %d parameters (%.2f%% removed, align %d), memory %.1f MiB", plan.target,
             plan.params_before, plan.params_after, 100 * plan.achieved_ratio, plan.effective_align,
             plan.memory_after / 2**20)
    return BudgetRef(ratio=plan.ratio, effective_align=plan.effective_align, params_after=plan.params_after,
                     tags=plan_tags(plan), plan=plan.as_dict())


def plan_tags(plan: BudgetPlan) -> dict[str, str]:
    """Tags of the run and the registered version: what was asked, what was planned, the alignment."""
    return {TARGET: plan.target, ALIGN: str(plan.align), ALIGN_EFFECTIVE: str(plan.effective_align),
            PLANNED_PARAMS: str(plan.params_after), PLANNED_RATIO: f"{plan.achieved_ratio:.6f}",
            PLANNED_MEMORY_BYTES: str(plan.memory_after)}


def aligned(scoring: ScoringSettings, budget: BudgetRef) -> ScoringSettings:
    """The scoring group with the alignment the planner settled on (clamped once, against the source width)."""
    return scoring.model_copy(update={"align": budget.effective_align})


@task(name="log-budget", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_budget(run_id: str, budget: BudgetRef, model: ModelRef, total: int) -> dict[str, str]:
    """Planned and achieved figures on the MLflow run (tags, metrics, plan.json); returns the version's tags."""
    import time

    from mlflow.entities import Metric

    achieved = (total - model.num_params) / total
    tags = {**budget.tags, ACHIEVED_RATIO: f"{achieved:.6f}", ACHIEVED_PARAMS: str(model.num_params)}
    client = mlflow_client()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric("budget.planned_params", float(budget.params_after), now, 0),
                                      Metric("budget.achieved_params", float(model.num_params), now, 0),
                                      Metric("budget.align", float(budget.effective_align), now, 0)])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "budget_plan.json"
        path.write_text(json.dumps(budget.plan, indent=1))
        client.log_artifact(run_id, str(path))
    return tags
