"""measure_serving: dense and pruned serving speed in the same run, on the same prompts, logged to MLflow.

The comparison is logged before registration, so the version's tags carry the speedup and
promotion gates can require it (`decode_speedup: ">= 1.2"`).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

from prefect import task

from infra.config import RuntimeSettings, ServingSettings
from infra.mlflow_utils import mlflow_client
from infra.tags import SERVING, SERVING_BACKEND
from pip_core import serving as core_serving
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.calibration import read_heldout, read_pairs
from tasks.models import ensure_local, load_model
from tasks.refs import CalibrationRef, ModelRef

log = logging.getLogger(__name__)


def backend_for(settings: ServingSettings) -> str:
    """vLLM when asked for, or on auto when it is installed and a GPU is present; transformers otherwise."""
    from infra import vllm_serving

    if settings.backend == "vllm" and not vllm_serving.available():
        raise ValueError("serving backend vllm needs vLLM installed (pip install 'pipprune[vllm]') and a CUDA GPU")
    if settings.backend == "auto":
        return "vllm" if vllm_serving.available() else "transformers"
    return settings.backend


def _measure(model: ModelRef, ids, settings: ServingSettings, runtime: RuntimeSettings,  # noqa: ANN001
             backend: str) -> core_serving.ServingStats:
    net, tokenizer = load_model(model, runtime, keep_slot=True)
    if backend == "vllm":
        from infra import vllm_serving

        return vllm_serving.measure(ensure_local(model), ids.tolist(), new_tokens=settings.new_tokens,
                                    batch_sizes=list(settings.batch_sizes), repeats=settings.repeats,
                                    matmul_params=core_serving.matmul_params(net))
    return core_serving.measure(net, tokenizer, ids, new_tokens=settings.new_tokens,
                                batch_sizes=settings.batch_sizes, repeats=settings.repeats)


@task(name="measure-serving")
def measure_serving(model: ModelRef, calib: CalibrationRef, settings: ServingSettings,
                    runtime: RuntimeSettings) -> dict:
    """One model's serving figures on the run's fixed prompts ({} when measurement is off).

    The dense model is measured at the start of the run, while it is the model in hand, and the
    compressed one at the end: the same prompts and settings, and never two models in memory.
    """
    if not settings.measure:
        return {}
    backend = backend_for(settings)
    _, tokenizer = load_model(model, runtime, keep_slot=True)
    texts = read_heldout(calib) or [original for original, _ in read_pairs(calib)]
    ids = core_serving.prompt_ids(tokenizer, texts, settings.prompts, settings.prompt_tokens)
    started = time.perf_counter()
    stats = _measure(model, ids, settings, runtime, backend)
    log.info("serving (%s) of %s measured in %.1fs", backend, model.fingerprint[:12], time.perf_counter() - started)
    return {"backend": backend, "stats": stats.as_dict()}


def compare_serving(dense: dict, pruned: dict) -> dict:
    """Both models' figures and their comparison, as `log_serving` records them ({} when not measured)."""
    if not dense or not pruned:
        return {}
    dense_stats, pruned_stats = (core_serving.ServingStats.from_dict(m["stats"]) for m in (dense, pruned))
    comparison = core_serving.compare(dense_stats, pruned_stats)
    log.info("serving (%s): decode speedup x%.3f (ideal x%.3f, %.0f%% of it)", pruned["backend"],
             comparison.decode_speedup, comparison.ideal_speedup, 100 * comparison.fraction_of_ideal)
    return {"backend": pruned["backend"], "dense": dense_stats.as_dict(), "pruned": pruned_stats.as_dict(),
            "metrics": {**comparison.metrics(), **core_serving.stats_metrics("serving.dense", dense_stats),
                        **core_serving.stats_metrics("serving.pruned", pruned_stats)}}


@task(name="log-serving", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def log_serving(run_id: str, measured: dict) -> dict[str, str]:
    """Metrics, the plot and the raw figures on the run; returns the version's serving tags."""
    if not measured:
        return {}
    from mlflow.entities import Metric

    from infra import plots

    metrics = measured["metrics"]
    client = mlflow_client()
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "serving.json"
        raw.write_text(json.dumps(measured, indent=1))
        client.log_artifact(run_id, str(raw), "serving")
        fig = plots.serving_speed(measured["dense"], measured["pruned"], metrics["serving.ideal_speedup"])
        fig.savefig(Path(tmp) / "serving_speed.png", dpi=110)
        client.log_artifact(run_id, str(Path(tmp) / "serving_speed.png"), "serving")
    tags = {SERVING_BACKEND: measured["backend"]}
    for key in ("decode_speedup", "ideal_speedup", "fraction_of_ideal", "flop_cut"):
        tags[SERVING.format(key=key)] = f"{metrics['serving.' + key]:.4f}"
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    return tags
