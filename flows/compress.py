"""The compress flow: wiring only. Each box of the DAG is a task in tasks.

prepare_calibration -> per iteration [collect_dual_view_gradients -> score -> prune_step ->
checkpoint (S3) -> quick_eval -> log] -> optional recover (LoRA, checkpointed as stage N+1) ->
evaluate (lm-eval) -> register_model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel

from infra.config import CompressConfig
from pip_core.schedule import plan as plan_schedule
from infra.calibration import CalibrationSource
from tasks.calibration import prepare_calibration
from tasks.evaluation import evaluate, quick_eval, tasks_digest
from tasks.models import resolve_source
from tasks.pruning import checkpoint, prune_step
from tasks.recovery import recover
from tasks.refs import CalibrationRef, ModelRef
from tasks.registry import register_model
from tasks.resume import find_resume_point
from tasks.scoring import collect_dual_view_gradients, score
from tasks.tracking import close_tracking_run, log_final, log_iteration, log_recovery, open_tracking_run
from infra.version import code_digest, git_sha

log = logging.getLogger(__name__)

#: config fields that do not change the pruned weights (kept out of the run key)
_NOT_RESULT_DEFINING = {"model", "calibration", "wordlist", "eval_tasks", "eval_include_path", "eval_limit",
                        "registered_model_name"}


class CompressSummary(BaseModel):
    run_key: str
    mlflow_run_id: str
    registered_model: str
    model_version: str
    s3_uri: str
    out_dir: str | None
    params_before: int
    params_after: int
    achieved_ratio: float
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]
    iterations_resumed: int
    metrics_before_recovery: dict[str, float] | None = None


def run_key_for(config: CompressConfig, source_fingerprint: str, calibration_hash: str, wordlist_hash: str) -> str:
    """Content address of a run: same source, data, settings and code -> same key (and S3 prefix)."""
    settings = {k: v for k, v in config.model_dump(mode="json").items() if k not in _NOT_RESULT_DEFINING}
    payload = json.dumps([source_fingerprint, calibration_hash, wordlist_hash, settings, code_digest()], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def _flatten_eval(prefix: str, results: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"{prefix}.{task}.{metric}": value for task, metrics in results.items() for metric, value in metrics.items()}


@flow(name="compress", persist_result=False)
def compress_flow(config: CompressConfig, out_dir: str | None = None) -> CompressSummary:
    """Prune `config.model` to `config.ratio` in `config.iterations` re-scored steps; track, checkpoint, register."""
    source = resolve_source(config.model)
    calibration = CalibrationSource(config.calibration, config.wordlist)
    calib = prepare_calibration(config.calibration, config.wordlist, calibration.digest(), config.n_samples,
                                config.heldout_samples, config.seed, config.perturb_rate)
    run_key = run_key_for(config, source.model.fingerprint, calib.data_hash, calib.wordlist_hash)
    lineage = {
        "pipprune.run_key": run_key,
        "pipprune.source_model": config.model,
        "pipprune.source_fingerprint": source.model.fingerprint,
        "pipprune.calibration_hash": calib.data_hash,
        "pipprune.wordlist_hash": calib.wordlist_hash,
        "pipprune.config_digest": config.digest(),
        "pipprune.code_digest": code_digest(),
        "pipprune.git_sha": git_sha(),
        "pipprune.prefect_flow_run_id": str(flow_run.id),
    }
    run_id = open_tracking_run(run_key, {**config.model_dump(mode="json"), "n_pairs": calib.n_pairs,
                                         "n_not_perturbable": calib.n_skipped}, lineage)
    try:
        total = source.model.num_params
        before = quick_eval(source.model, calib, config.max_length)
        history = [{"iteration": 0, "num_params": total, **before}]
        done = find_resume_point(run_key)
        model: ModelRef = source.model
        for i, cumulative in enumerate(plan_schedule(config.ratio, config.iterations), start=1):
            if i <= len(done):
                meta = done[i - 1]
                model = ModelRef(**meta["model"])
                history.append({"iteration": i, "num_params": model.num_params, **meta["metrics"]})
                continue
            to_remove = round(cumulative * total) - (total - model.num_params)
            stats = collect_dual_view_gradients(model, calib, config.method, config.unit, config.seed,
                                                config.max_length)
            step_plan = score(stats, to_remove, config.protect_first, config.protect_last)
            pruned = prune_step(model, step_plan)
            metrics = {**quick_eval(pruned, calib, config.max_length), "num_params": float(pruned.num_params),
                       "achieved_ratio": (total - pruned.num_params) / total,
                       "units_removed": float(len(step_plan.units)), "scoring_seconds": stats.seconds}
            model = checkpoint(run_key, i, pruned, step_plan.table_path, {
                "iteration": i, "units_removed": list(step_plan.units), "metrics": metrics,
                "score_table_sha256": step_plan.table_sha256, "model": pruned.model_dump(), "lineage": lineage,
            })
            history.append({"iteration": i, "num_params": model.num_params, **metrics})
            log_iteration(run_id, i, metrics, step_plan.table_path, list(step_plan.units), history)

        pre_recovery = None
        if config.recovery.enabled:
            pre_recovery = {k: v for k, v in history[-1].items() if k.startswith("heldout_")}
            model, recovered = _recovery_stage(config, run_key, run_id, lineage, model, calib, calibration.digest(),
                                               done, total)
            history.append({"iteration": config.iterations + 1, "num_params": model.num_params, **recovered})

        content = tasks_digest(config.eval_include_path)
        source_eval = evaluate(source.model, config.eval_tasks, config.eval_include_path, content, config.eval_limit)
        final_eval = evaluate(model, config.eval_tasks, config.eval_include_path, content, config.eval_limit)
        after = {k: v for k, v in history[-1].items() if k.startswith("heldout_")}
        final_metrics = {**_flatten_eval("source", source_eval), **_flatten_eval("final", final_eval),
                         **{f"source.{k}": v for k, v in before.items()}, **{f"final.{k}": v for k, v in after.items()},
                         "final.num_params": float(model.num_params), "source.num_params": float(total),
                         "final.achieved_ratio": (total - model.num_params) / total}
        version = register_model(config.registered_model_name, model.s3_uri, run_id, {
            **lineage, "pipprune.model_fingerprint": model.fingerprint, "pipprune.s3_uri": model.s3_uri,
            "pipprune.manifest_sha256": model.manifest_sha256 or "", "pipprune.mlflow_run_id": run_id,
            "pipprune.iterations": str(config.iterations), "pipprune.method": config.method,
            "pipprune.final_checkpoint": str(config.iterations + int(config.recovery.enabled)),
            "pipprune.recovery_steps": str(config.recovery.steps),
            "pipprune.unit": config.unit, "pipprune.ratio": str(config.ratio)})
        summary = CompressSummary(
            run_key=run_key, mlflow_run_id=run_id, registered_model=config.registered_model_name,
            model_version=version, s3_uri=model.s3_uri or "", out_dir=out_dir, params_before=total,
            params_after=model.num_params, achieved_ratio=(total - model.num_params) / total,
            metrics_before={**before, **_flatten_eval("eval", source_eval)},
            metrics_after={**after, **_flatten_eval("eval", final_eval)}, iterations_resumed=len(done),
            metrics_before_recovery=pre_recovery)
        log_final(run_id, final_metrics, summary.model_dump())
        if out_dir:
            export(model, Path(out_dir), summary)
        close_tracking_run(run_id)
        return summary
    except BaseException:
        close_tracking_run(run_id, "FAILED")
        raise


def _recovery_stage(config: CompressConfig, run_key: str, run_id: str, lineage: dict[str, str], model: ModelRef,
                    calib: CalibrationRef, source_digest: str, done: list[dict],
                    total: int) -> tuple[ModelRef, dict[str, float]]:
    """LoRA recovery as checkpoint stage N+1 (resumed from S3 when that stage already finished)."""
    stage = config.iterations + 1
    if len(done) >= stage and done[stage - 1].get("stage") == "recovery":
        return ModelRef(**done[stage - 1]["model"]), done[stage - 1]["metrics"]
    result = recover(model, calib, config.calibration, source_digest, config.recovery, config.seed, config.max_length)
    metrics = {**quick_eval(result.model, calib, config.max_length), "num_params": float(result.model.num_params),
               "achieved_ratio": (total - result.model.num_params) / total,
               "recovery_texts": float(result.n_texts), "recovery_first_loss": result.first_loss,
               "recovery_last_loss": result.last_loss, "recovery_seconds": result.seconds}
    recovered = checkpoint(run_key, stage, result.model, None, {
        "iteration": stage, "stage": "recovery", "units_removed": [], "metrics": metrics,
        "recovery": config.recovery.model_dump(), "pruned_model_fingerprint": model.fingerprint,
        "model": result.model.model_dump(), "lineage": lineage})
    log_recovery(run_id, stage, metrics, list(result.losses), config.recovery.model_dump())
    return recovered, metrics


def export(model: ModelRef, out: Path, summary: CompressSummary) -> None:
    """Copy the final model to `out` atomically, with a provenance file beside the weights."""
    from tasks.models import ensure_local

    src = ensure_local(model)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    (tmp / "pipprune_provenance.json").write_text(summary.model_dump_json(indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
