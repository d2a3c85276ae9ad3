"""The compress flow: wiring only. Each box of the DAG is a task in `tasks`.

trim the vocabulary (optional) -> plan budget -> calibrate -> measure the dense model (held-out, lm-eval, serving,
samples) -> for each step [score units -> select units -> prune -> repair (optional, closed form) -> quick eval ->
checkpoint (S3) -> log] -> optional recovery, LoRA or KD (checkpointed as step N+1) -> measure the compressed model
as the dense one was -> quality verdict -> sign -> register.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows import records
from flows.export import check_export, export_stage
from flows.records import CompressSummary
from infra.config import CompressConfig
from infra.locks import run_lock
from infra.memory import MemoryWatch
from infra.progress import StageClock, StepProgress, stage
from infra.settings import Settings
from pip_core.schedule import plan, step_spec
from pip_core.vocabulary import PERTURBATION_METHODS
from tasks.budget import aligned, log_budget, plan_budget
from tasks.calibration import prepare_calibration, resolve_calibration
from tasks.evaluation import eval_provenance, evaluate, general_eval, quick_eval, tasks_digest
from tasks.models import placement_for, resolve_source
from tasks.pruning import checkpoint, prune_step
from tasks.recovery import recover
from tasks.refs import BudgetRef, ModelRef
from tasks.registry import register_model
from tasks.repair import repair_step
from tasks.resume import find_resume_point
from tasks.samples import generate_samples
from tasks.scoring import score_units, select_units
from tasks.serving import compare_serving, log_serving, measure_serving
from tasks.signing import sign_checkpoint
from tasks.tracking import (
    log_datasets,
    log_eval_provenance,
    log_final,
    log_iteration,
    log_recovery,
    log_samples,
    tracking_run,
)
from tasks.vocab import trim_vocabulary

log = logging.getLogger(__name__)

__all__ = ["compress_flow", "CompressSummary", "run_key_for"]
run_key_for = records.run_key_for


@flow(name="compress", persist_result=False)
def compress_flow(config: CompressConfig, out_dir: str | None = None, overwrite: bool = False) -> CompressSummary:
    """Prune `config.model` by `config.ratio` in re-scored steps; track, checkpoint, evaluate, register."""
    memory = MemoryWatch.start()  # before any model is read: the baseline the run's own memory is measured from
    clock = StageClock()
    # 1. inputs: the source model and the calibration texts, both content-addressed; pairs only for a method that
    # perturbs, recovery texts (apart from the scored ones) only when recovery is on
    source = resolve_source(config.model)
    if config.vocab.enabled:  # the vocabulary first: the rows it drops count towards the target, the layers pay the rest
        source = trim_vocabulary(source, config.vocab)
    check_export(config, source.model)  # export: a model GGUF cannot express is refused before any work
    budget = plan_budget(config, source)  # the target as a removal ratio and aligned widths, from config.json alone
    clock.lap("inputs")
    perturb = config.scoring.method in PERTURBATION_METHODS
    texts = resolve_calibration(config.calibration, config.seed, source.model, config.runtime, perturb=perturb,
                                recovery_texts=config.calibration.recovery_samples if config.recovery.enabled else 0)
    clock.lap("calibration texts")
    calib = prepare_calibration(texts, config.seed, perturb=perturb)
    clock.lap("calibration sets")
    run_key = records.run_key_for(config, source.model.fingerprint, calib.data_hash, calib.wordlist_hash)
    lineage = records.lineage_tags(config, run_key, source, calib, str(flow_run.id))
    stage(f"inputs: {config.model}: {source.params_before:,} parameters"
          + (f" ({records.describe_vocab(source.vocab)})" if source.vocab else "") + f"; {calib.n_texts} calibration texts"
          + (f" ({calib.n_pairs} perturbed pairs)" if calib.n_pairs else "")
          + (f", {calib.n_recovery} recovery texts" if calib.n_recovery else ""))
    with run_lock(Settings(), run_key), tracking_run(run_key, records.run_params(config, calib), lineage) as run_id:
        log_datasets(run_id, calib)
        run = records.RunContext(config, run_key, run_id, lineage, source, calib, memory, out_dir, overwrite, clock)
        # 2. the dense model, measured once while it is the model in hand (no copy of it is kept beside the pruned)
        dense = _measure_dense(run)
        clock.lap("dense model measured")
        # 3. prune in re-scored steps; each is checkpointed to S3, and a rerun resumes after the last one
        model, history, done = _prune_steps(run, budget, dense.heldout)
        clock.lap("pruning steps")
        # 4. optional recovery (LoRA or KD), checkpointed as step N+1
        pre_recovery = records.heldout(history[-1]) if config.recovery.enabled else None
        model = _recovery_stage(run, model, done, history)
        clock.lap("recovery")
        # 5. the compressed model measured as the dense one was, judged, signed, registered
        return _finish(run, model, budget, dense, history, records.Resumed(len(done), pre_recovery))


def _measure_dense(run: records.RunContext) -> records.DenseFigures:
    """Held-out perplexity (and the dense log-probabilities later steps compare with), the general held-out set
    (and the dense per-token figures the final model is compared with), lm-eval, serving, samples."""
    config, rt, ev = run.config, run.config.runtime, run.config.evaluation
    before = quick_eval(run.source.model, run.calib, rt, reference=run.source.model)
    general = general_eval(run.source.model, rt)
    lm_eval = evaluate(run.source.model, ev.tasks, ev.include_path, tasks_digest(ev.include_path, ev.tasks), ev.limit,
                       rt)
    serving = measure_serving(run.source.model, run.calib, config.serving, rt)
    samples = generate_samples(run.source.model, ev.prompts, ev.new_tokens, rt)
    run.memory.between_stages()
    stage(f"dense model measured: {records.describe_figures(before, lm_eval.results)}")
    return records.DenseFigures(heldout=before, lm_eval=lm_eval, serving=serving, samples=samples, general=general)


def _prune_steps(run: records.RunContext, budget: BudgetRef,
                 before: dict[str, float]) -> tuple[ModelRef, list[dict], list[dict]]:
    """Score, select, prune, repair (when asked), quick-eval, checkpoint and log each step not yet in S3."""
    config, rt = run.config, run.config.runtime
    scoring, total = aligned(config.scoring, budget), run.source.model.num_params
    done = find_resume_point(run.run_key)
    model, history = records.resumed_history(run.source.model, before, done[:config.scoring.iterations])
    progress = StepProgress(config.scoring.iterations)
    for i, cumulative in list(enumerate(plan(budget.ratio, config.scoring.iterations), start=1))[len(done):]:
        spec = step_spec(i, cumulative, total, model.num_params, config.seed)
        stats = score_units(model, run.calib, scoring, spec, rt)
        selection = select_units(stats, scoring, spec)
        pruned = prune_step(model, selection, rt)
        repaired = repair_step(pruned, run.source.model, run.calib, config.repair, rt) if config.repair.enabled else None
        pruned = repaired.model if repaired else pruned
        quick = quick_eval(pruned, run.calib, rt, reference=run.source.model)
        metrics = records.step_metrics(quick, pruned, run.source.params_before, selection, stats, repaired)
        model = checkpoint(run.run_key, i, pruned, selection.table_path,
                           records.step_record(i, selection, metrics, pruned, run.lineage))
        history.append(records.history_row(i, model, metrics))
        log_iteration(run.run_id, i, metrics, selection.table_path, list(selection.units), history)
        progress.step(i, stats.n_units, len(selection.units), run.source.params_before, model.num_params)
        run.memory.between_stages()
    return model, history, done


def _recovery_stage(run: records.RunContext, model: ModelRef, done: list[dict], history: list[dict]) -> ModelRef:
    """Recovery (LoRA on the LM loss, or KD from the dense model) as checkpoint stage N+1 (resumed from S3 when
    that stage already finished); off: `model`."""
    config = run.config
    if not config.recovery.enabled:
        return model
    stage_no = config.scoring.iterations + 1
    if len(done) >= stage_no and done[stage_no - 1].get("stage") == "recovery":
        recovered, metrics = records.resumed_step(done[stage_no - 1])
        history.append(records.history_row(stage_no, recovered, metrics))
        return recovered
    stage(f"recovery: {config.recovery.kind}, {config.recovery.steps} steps")
    rt = config.runtime
    teacher = run.source.model if config.recovery.kind == "kd" else None  # distillation: the dense model teaches
    result = recover(model, run.calib, config.recovery, config.seed, rt, teacher)
    quick = quick_eval(result.model, run.calib, rt, reference=run.source.model)
    metrics = records.recovery_metrics(quick, result, run.source.params_before)
    recovered = checkpoint(run.run_key, stage_no, result.model, None,
                           records.recovery_record(stage_no, config, metrics, model, result, teacher, run.lineage))
    log_recovery(run.run_id, stage_no, metrics, list(result.losses), config.recovery.model_dump())
    history.append(records.history_row(stage_no, recovered, metrics))
    return recovered


def _finish(run: records.RunContext, model: ModelRef, budget: BudgetRef, dense: records.DenseFigures,
            history: list[dict], resumed: records.Resumed) -> CompressSummary:
    """lm-eval, general held-out set, serving and samples of the compressed model, the quality verdict, signature,
    version, summary."""
    config, rt, ev = run.config, run.config.runtime, run.config.evaluation
    final_eval = evaluate(model, ev.tasks, ev.include_path, tasks_digest(ev.include_path, ev.tasks), ev.limit, rt)
    general = general_eval(model, rt, reference=run.source.model)
    serving = log_serving(run.run_id, compare_serving(dense.serving, measure_serving(model, run.calib, config.serving,
                                                                                      rt)))
    continuations = generate_samples(model, ev.prompts, ev.new_tokens, rt)
    samples = log_samples(run.run_id, records.sample_rows(ev.prompts, dense.samples.texts, continuations.texts))
    figures = records.model_figures(general, continuations, dense.samples)  # what the verdict reads beside KL
    verdict = records.quality_verdict(ev, {**records.heldout(history[-1]), **figures})
    provenance = eval_provenance(model, run.calib, final_eval, dense.lm_eval)
    log_eval_provenance(run.run_id, provenance)
    budget_tags = log_budget(run.run_id, budget, model, run.source.params_before)
    signature = sign_checkpoint(model)  # OpenSSF model signature of the final checkpoint, beside it in S3
    version = register_model(config.registered_model_name, model, run.run_id, {
        **records.version_tags(config, run.lineage, model, run.run_id, signature, provenance), **budget_tags,
        **serving, **records.verdict_tags(verdict, general.heldout)})
    stage(f"registered {config.registered_model_name} version {version}: {verdict['verdict']}")
    exports = export_stage(config, version, model, run.source.model, run.run_id, run.calib)  # optional: GGUF
    memory = records.memory_figures(run.memory, run.source.model.num_params,  # the whole run's peak, export included
                                    placement_for(run.source.model, rt).dtype)
    summary = records.summary(run, version, model, history, dense, final_eval.results, resumed,
                              records.Judgement(verdict=verdict, samples=samples, memory=memory, figures=figures,
                                                general_set=general.heldout))
    summary.exports = exports
    log_final(run.run_id, records.final_metrics(run.source.params_before, model, history, dense, final_eval.results,
                                                memory, figures), summary.model_dump())
    if run.out_dir:
        export(model, Path(run.out_dir), summary, run.overwrite)
    return summary


def export(model: ModelRef, out: Path, summary: CompressSummary, overwrite: bool = False) -> None:
    """Copy the final model to `out` atomically, never over anything pipprune did not write (infra.output_dir)."""
    from infra.output_dir import write_output_dir
    from tasks.models import ensure_local

    write_output_dir(ensure_local(model), out, summary.model_dump(mode="json"), overwrite=overwrite)
