"""The compress flow: wiring only. Each box of the DAG is a task in `tasks`.

plan budget -> calibrate -> for each step [score units -> select units -> prune -> checkpoint (S3) -> quick
eval -> log] -> optional recovery, LoRA or KD (checkpointed as step N+1) -> evaluate (lm-eval) -> measure
serving -> register.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows import records
from flows.export import check_export, export_stage
from flows.records import CompressSummary
from infra.calibration import CalibrationSource
from infra.config import CompressConfig
from infra.locks import run_lock
from infra.progress import StepProgress
from infra.settings import Settings
from pip_core.schedule import plan, step_spec
from tasks.budget import aligned, log_budget, plan_budget
from tasks.calibration import prepare_calibration
from tasks.evaluation import eval_provenance, evaluate, quick_eval, tasks_digest
from tasks.models import resolve_source
from tasks.pruning import checkpoint, prune_step
from tasks.recovery import recover
from tasks.refs import CalibrationRef, ModelRef
from tasks.registry import register_model
from tasks.resume import find_resume_point
from tasks.scoring import score_units, select_units
from tasks.serving import log_serving, measure_serving
from tasks.signing import sign_checkpoint
from tasks.tracking import log_datasets, log_eval_provenance, log_final, log_iteration, log_recovery, tracking_run

log = logging.getLogger(__name__)

__all__ = ["compress_flow", "CompressSummary", "run_key_for"]
run_key_for = records.run_key_for


@flow(name="compress", persist_result=False)
def compress_flow(config: CompressConfig, out_dir: str | None = None, overwrite: bool = False) -> CompressSummary:
    """Prune `config.model` by `config.ratio` in re-scored steps; track, checkpoint, evaluate, register."""
    # 1. inputs: the source model and the calibration pairs, both content-addressed
    source = resolve_source(config.model)
    check_export(config, source.model)  # export: a model GGUF cannot express is refused before any work
    budget = plan_budget(config, source)  # the target as a removal ratio and aligned widths, from config.json alone
    scoring = aligned(config.scoring, budget)
    source_digest = CalibrationSource(config.calibration.source, config.calibration.wordlist).digest()
    calib = prepare_calibration(config.calibration, config.seed, source_digest)
    run_key = records.run_key_for(config, source.model.fingerprint, calib.data_hash, calib.wordlist_hash)
    lineage = records.lineage_tags(config, run_key, source, calib, str(flow_run.id))
    max_length, total, rt = config.calibration.max_length, source.model.num_params, config.runtime
    with run_lock(Settings(), run_key), tracking_run(run_key, records.run_params(config, calib), lineage) as run_id:
        log_datasets(run_id, config.calibration.source, calib)
        # 2. prune in re-scored steps; each is checkpointed to S3, and a rerun resumes after the last one
        before = quick_eval(source.model, calib, max_length, rt, reference=source.model)
        done = find_resume_point(run_key)
        model, history = records.resumed_history(source.model, before, done[:config.scoring.iterations])
        progress = StepProgress(config.scoring.iterations)
        for i, cumulative in list(enumerate(plan(budget.ratio, config.scoring.iterations), start=1))[len(done):]:
            spec = step_spec(i, cumulative, total, model.num_params, config.seed)
            stats = score_units(model, calib, scoring, spec, max_length, rt)
            selection = select_units(stats, scoring, spec)
            pruned = prune_step(model, selection, rt)
            metrics = records.step_metrics(quick_eval(pruned, calib, max_length, rt, reference=source.model), pruned,
                                           total, selection, stats)
            model = checkpoint(run_key, i, pruned, selection.table_path,
                               records.step_record(i, selection, metrics, pruned, lineage))
            history.append(records.history_row(i, model, metrics))
            log_iteration(run_id, i, metrics, selection.table_path, list(selection.units), history)
            progress.step(i, stats.n_units, len(selection.units), total, model.num_params)
        # 3. optional recovery, then the final evaluation of both models and the registered version
        pre_recovery = records.heldout(history[-1]) if config.recovery.enabled else None
        model = _recovery_stage(config, run_key, run_id, lineage, model, calib, source_digest, done, history,
                                source.model)
        ev, content = config.evaluation, tasks_digest(config.evaluation.include_path)
        final_eval = evaluate(model, ev.tasks, ev.include_path, content, ev.limit, rt)  # while it is in memory
        source_eval = evaluate(source.model, ev.tasks, ev.include_path, content, ev.limit, rt)
        after = records.heldout(history[-1])
        serving = log_serving(run_id, measure_serving(source.model, model, calib, config.serving, rt))
        provenance = eval_provenance(source.model, calib, max_length, final_eval, source_eval)  # what made each figure
        log_eval_provenance(run_id, provenance)
        signature = sign_checkpoint(model)  # OpenSSF model signature of the final checkpoint, beside it in S3
        version = register_model(config.registered_model_name, model, run_id,
                                 {**records.version_tags(config, lineage, model, run_id, signature, provenance),
                                  **log_budget(run_id, budget, model, total), **serving})
        summary = records.summary(config, run_key, run_id, version, model, total, before, after, source_eval.results,
                                  final_eval.results, len(done), pre_recovery, out_dir)
        log_final(run_id, records.final_metrics(total, model, before, after, source_eval.results, final_eval.results),
                  summary.model_dump())
        summary.exports = export_stage(config, version, model, source.model, run_id, calib)  # optional: GGUF children
        if out_dir:
            export(model, Path(out_dir), summary, overwrite)
        return summary


def _recovery_stage(config: CompressConfig, run_key: str, run_id: str, lineage: dict[str, str], model: ModelRef,
                    calib: CalibrationRef, source_digest: str, done: list[dict], history: list[dict],
                    dense: ModelRef | None = None) -> ModelRef:
    """Recovery (LoRA on the LM loss, or KD from `dense`) as checkpoint stage N+1 (resumed from S3 when that stage
    already finished); off: `model`."""
    if not config.recovery.enabled:
        return model
    stage, total = config.scoring.iterations + 1, history[0]["num_params"]
    if len(done) >= stage and done[stage - 1].get("stage") == "recovery":
        recovered, metrics = records.resumed_step(done[stage - 1])
        history.append(records.history_row(stage, recovered, metrics))
        return recovered
    max_length, rt = config.calibration.max_length, config.runtime
    teacher = dense if config.recovery.kind == "kd" else None  # distillation: the dense model teaches
    result = recover(model, calib, config.calibration.source, source_digest, config.recovery, config.seed, max_length,
                     rt, teacher)
    metrics = {**quick_eval(result.model, calib, max_length, rt, reference=dense),
               "num_params": float(result.model.num_params),
               "achieved_ratio": records.removed_fraction(total, result.model.num_params),
               "recovery_texts": float(result.n_texts), "recovery_first_loss": result.first_loss,
               "recovery_last_loss": result.last_loss, "recovery_seconds": result.seconds,
               "recovery_tokens": float(result.tokens)}
    recovered = checkpoint(run_key, stage, result.model, None, {
        "iteration": stage, "stage": "recovery", "units_removed": [], "metrics": metrics,
        "recovery": config.recovery.model_dump(), "pruned_model_fingerprint": model.fingerprint,
        "teacher_fingerprint": teacher.fingerprint if teacher else None,
        "model": result.model.model_dump(), "lineage": lineage})
    log_recovery(run_id, stage, metrics, list(result.losses), config.recovery.model_dump())
    history.append(records.history_row(stage, recovered, metrics))
    return recovered


def export(model: ModelRef, out: Path, summary: CompressSummary, overwrite: bool = False) -> None:
    """Copy the final model to `out` atomically, never over anything pipprune did not write (infra.output_dir)."""
    from infra.output_dir import write_output_dir
    from tasks.models import ensure_local

    write_output_dir(ensure_local(model), out, summary.model_dump(mode="json"), overwrite=overwrite)
