"""lm-eval on a model directory: the one code path behind `pipprune eval` and the pipeline's evaluate.

The model is loaded by pipprune's own loader (safetensors only, per-layer pruned classes
registered in-process, so no `trust_remote_code`) and handed to lm-eval's HFLM in memory.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)

#: lm-eval reports stderr next to each metric; we keep the metrics
_SKIP_SUFFIX = "_stderr"
#: lm-eval holds a batch's float32 logits and their log-softmax at once; items are sized at this many tokens
_ITEM_TOKENS = 64


def batch_size_for(model) -> int:  # noqa: ANN001 (a transformers model)
    """lm-eval's batch: 2 to 8 items, as many as keep one batch's logits within an eighth of the weights.

    At 8 items the logits of SmolLM2-135M (49k vocabulary) made the final evaluation the run's peak;
    an 8B model still gets 8.
    """
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_item = 2 * 4 * _ITEM_TOKENS * int(model.config.vocab_size)  # logits and log-softmax, float32
    return max(2, min(8, weights // 8 // max(per_item, 1)))


def unknown_tasks(tasks: list[str], include_path: str | Path | None = None) -> list[str]:
    """Task names that neither `include_path` nor lm-eval's registry defines.

    The local index is instant; lm-eval's default index costs ~22 s, so it is built only for
    names the local one lacks.
    """
    from lm_eval.tasks import TaskManager

    missing = list(tasks)
    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        missing = [t for t in missing if t not in local.all_tasks]
    if missing:
        defaults = TaskManager(include_path=str(include_path) if include_path else None)
        missing = [t for t in missing if t not in defaults.all_tasks]
    return missing


def run_lmeval(model_dir: Path, tasks: list[str], include_path: Path | None = None, limit: int | None = None,
               batch_size: int | None = None, device: str | None = None, dtype: str = "auto",
               loaded: tuple | None = None) -> dict[str, dict[str, float]]:
    """Evaluate `tasks` on the model in `model_dir`; returns {task: {metric: value}}.

    `device` (auto | cpu | cuda | cuda:N) and `dtype` (auto = the checkpoint's own) say how the
    model is loaded; `loaded` is that directory's (model, tokenizer) when the caller already holds them.
    """
    return run_lmeval_recorded(model_dir, tasks, include_path, limit, batch_size, device, dtype, loaded)[0]


def run_lmeval_recorded(model_dir: Path, tasks: list[str], include_path: Path | None = None, limit: int | None = None,
                        batch_size: int | None = None, device: str | None = None, dtype: str = "auto",
                        loaded: tuple | None = None) -> tuple[dict[str, dict[str, float]], dict]:
    """`run_lmeval` plus the provenance of its figures (infra.eval_provenance.lmeval_record), read off the run itself."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from infra.eval_provenance import lmeval_record
    from pip_core import io as core_io

    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"lm-eval include path not found: {include_path}")
    from pip_core.placement import resolve_device

    device = resolve_device(device or "auto")
    manager = TaskManager(include_path=str(include_path), include_defaults=False) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}" + (f" in {include_path}" if include_path else ""))
    model, tokenizer = loaded or core_io.load(model_dir, dtype=dtype, device=device)
    batch_size = batch_size or batch_size_for(model)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size, device=device)
    results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, bootstrap_iters=0,
                              log_samples=False, verbosity="WARNING")
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        clean = {}
        for key, value in metrics.items():
            name = key.split(",")[0]
            if name.endswith(_SKIP_SUFFIX) or not isinstance(value, (int, float)) or name in ("alias", "sample_len"):
                continue
            if isinstance(value, float) and math.isnan(value):
                continue
            clean[name] = float(value)
        out[task] = clean
    return out, lmeval_record(results, lm.max_length, batch_size, limit)
