"""The compress config's budget, as the planner in `pip_core.budget` takes it (one mapping, three callers:
the preflight check, the flow's plan task and `pipprune plan`)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from infra.config import CompressConfig, ScoringSettings, ServingSettings
from pip_core.budget import BudgetPlan, Serving, Target, plan_budget
from pip_core.rules import Selection


def plan_for(config: CompressConfig, model_config: dict, vocab_after: int | None = None) -> BudgetPlan:
    """The plan of `config`'s target on the model `model_config` (config.json) describes, its vocabulary trimmed to
    `vocab_after` tokens first when given; BudgetError if infeasible."""
    return plan_with(model_config, config.budget_target(), config.scoring, config.serving, config.runtime.dtype,
                     vocab_after)


def plan_with(model_config: dict, target: str, scoring: ScoringSettings, serving: ServingSettings,
              dtype: str = "auto", vocab_after: int | None = None) -> BudgetPlan:
    """The plan of `target` with the job's scoring and serving groups passed whole (what `pipprune plan` calls)."""
    selection = Selection(**scoring.model_dump(include={f.name for f in fields(Selection)}))
    return plan_budget(model_config, target, selection, iterations=scoring.iterations, dtype=dtype,
                       serving=Serving(serving.context, serving.batch), vocab_after=vocab_after)


def kept_tokens(model: str | Path, corpus: str) -> int:
    """How many tokens `corpus` keeps of the vocabulary of `model` (a model directory, or a GGUF file whose
    tokenizer is read from its header): the count the planner takes, no weights read."""
    from transformers import AutoTokenizer

    from infra.gguf_source import is_gguf
    from infra.settings import Settings
    from infra.vocab_source import kept_vocabulary

    path = Path(model).expanduser()
    tokenizer = (AutoTokenizer.from_pretrained(str(path.resolve().parent), gguf_file=path.name) if is_gguf(str(model))
                 else AutoTokenizer.from_pretrained(str(path)))
    return len(kept_vocabulary(tokenizer, corpus, Settings().home / "cache").trim.keep)


def deep_cut_refusal(plan: BudgetPlan) -> str:
    """Why a target that guts the decoder layers stops before any work, and what the user can do instead."""
    share = 1 - plan.body.params_before / plan.params_before
    asked = Target.parse(plan.target)
    layers = asked.value if asked.kind == "ratio" else round(plan.achieved_ratio, 2)
    if plan.vocab:
        kept = plan.vocab.describe(plan.params_before)
        why = (f"the {kept} pays part of it and the layers the rest. Ask for less (--ratio ")
    else:
        why = (f"the embeddings and the head, {share:.0%} of this model, are not pruned, so the layers pay for all of "
               "it. Ask for less (--ratio ")
    return (f"target {plan.target} takes {plan.body.describe()}: {why}"
            f"{plan.largest_shallow_ratio():g} takes half of the layers' parameters), give the target over the layers "
            f"alone (--target layers={layers:g} takes {layers:.0%} of them)"
            + ("" if plan.vocab else ", trim the vocabulary first (--vocab-corpus public, or a corpus file: the rows "
               "of tokens it never uses count towards the target)")
            + ", or confirm this one with --allow-deep-cut (config: allow_deep_cut: true)")


def refusal(exc: Exception) -> str:
    """The one-line refusal of an infeasible target, with the nearest feasible one."""
    nearest = getattr(exc, "nearest", None)
    return f"{exc}; nearest feasible target: --target {nearest}" if nearest else str(exc)
