"""quick_eval (held-out perplexity after each step) and evaluate (lm-eval, the same code as `pipprune eval`)."""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import task

from infra.config import RuntimeSettings
from infra.hashing import tree_digest
from pip_core.perplexity import perplexity
from tasks._common import key_from
from tasks.calibration import read_heldout
from tasks.models import ensure_local, load_model
from tasks.refs import CalibrationRef, ModelRef

log = logging.getLogger(__name__)


@task(name="quick-eval", cache_key_fn=key_from("model", "calib", "max_length", "runtime"), persist_result=True,
      result_serializer="json")
def quick_eval(model: ModelRef, calib: CalibrationRef, max_length: int,
               runtime: RuntimeSettings = RuntimeSettings()) -> dict[str, float]:
    """Perplexity on the calibration texts held out from scoring."""
    texts = read_heldout(calib)
    if not texts:
        return {}
    net, tokenizer = load_model(model, runtime, seq_len=max_length)
    metrics = perplexity(net, tokenizer, texts, max_length=max_length)
    log.info("quick eval: perplexity %.3f on %d held-out texts", metrics["perplexity"], len(texts))
    return {"heldout_perplexity": metrics["perplexity"], "heldout_nll": metrics["nll"]}


def tasks_digest(include_path: str | None) -> str | None:
    """Content of the task definitions, so editing a local task invalidates cached evaluations."""
    return tree_digest(Path(include_path)) if include_path else None


@task(name="evaluate", cache_key_fn=key_from("model", "tasks", "tasks_content", "limit", "runtime"),
      persist_result=True, result_serializer="json")
def evaluate(model: ModelRef, tasks: tuple[str, ...], include_path: str | None, tasks_content: str | None,
             limit: int | None,
             runtime: RuntimeSettings = RuntimeSettings()) -> dict[str, dict[str, float]]:
    """Run lm-eval tasks on the model directory, exactly as `pipprune eval` does."""
    from infra.lmeval import run_lmeval

    if not tasks:
        return {}
    net, tokenizer = load_model(model, runtime, keep_slot=True)
    results = run_lmeval(ensure_local(model), list(tasks), include_path=Path(include_path) if include_path else None,
                         limit=limit, loaded=(net, tokenizer), device=str(next(net.parameters()).device))
    log.info("evaluate: %s", results)
    return results
