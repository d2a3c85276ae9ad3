"""Small named constructors for the records the compress flow writes: lineage tags, step metrics,
checkpoint metadata, version tags, the summary. Pure functions, so the flow body reads as the DAG.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from infra.config import CompressConfig, EvaluationSettings
from infra.memory import MemoryWatch
from infra.progress import StageClock
from infra.tags import (
    CALIBRATION_HASH,
    CODE_DIGEST,
    CONFIG_DIGEST,
    FINAL_CHECKPOINT,
    GIT_SHA,
    ITERATIONS,
    MANIFEST_SHA256,
    METHOD,
    MLFLOW_RUN_ID,
    MODEL_FINGERPRINT,
    PREFECT_FLOW_RUN_ID,
    QUALITY_FIGURE,
    QUALITY_GENERAL_SET_SHA256,
    QUALITY_GENERAL_SET_TOKENS,
    QUALITY_MAX_KL,
    QUALITY_MAX_PPL_RATIO,
    QUALITY_MIN_DISTINCT_RATIO,
    QUALITY_REASONS,
    QUALITY_VERDICT,
    RATIO,
    RECOVERY_KD_PARAMS,
    RECOVERY_KIND,
    RECOVERY_STEPS,
    RECOVERY_TEMPERATURE,
    REPAIR,
    RUN_KEY,
    S3_URI,
    SOURCE_FINGERPRINT,
    SOURCE_GGUF_FILE,
    SOURCE_GGUF_PATH,
    SOURCE_GGUF_QUANT_TYPES,
    SOURCE_GGUF_SHA256,
    SOURCE_MODEL,
    UNIT,
    VOCAB_CORPUS,
    VOCAB_CORPUS_SHA256,
    VOCAB_DENSE_FINGERPRINT,
    VOCAB_KEPT_SHA256,
    VOCAB_TOKENS,
    WORDLIST_HASH,
)
from infra.version import code_digest, git_sha
from pip_core.repetition import ngram_name
from tasks.refs import CalibrationRef, ModelRef, PrunePlan, SignatureRef, SourceRef, StatsRef


class CompressSummary(BaseModel):
    """What one compress run produced; printed by the CLI and stored beside exported models."""

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
    #: lm-eval tasks that ran on both models, and why those (or none)
    tasks: list[str] = []
    tasks_origin: str | None = None
    #: quality gate on the held-out figures: {"verdict": "usable" | "not usable" | "not measured", "reasons": [...]}
    quality: dict[str, Any] = {}
    #: the general held-out set the verdict reads (infra.eval_kit): source, sha256, windows, tokens, max_length
    general_set: dict[str, Any] = {}
    #: fixed prompts with the dense and the compressed model's greedy continuations
    samples: list[dict[str, str]] = []
    #: the process's peak resident memory over the run, and over the weights in the run's dtype
    peak_rss_bytes: int | None = None
    peak_rss_over_weights: float | None = None
    #: wall seconds of each stage of the run (inputs, calibration texts and sets, the dense model's figures, the
    #: pruning steps, recovery, final): where a run's minutes went
    stage_seconds: dict[str, float] = {}
    #: the process's peak resident memory at the end of each stage (a high-water mark: where it rises, that stage
    #: set the run's peak)
    stage_peak_bytes: dict[str, int] = {}
    #: resident memory before any model was read (interpreter and libraries), and the peak less it over the weights
    baseline_rss_bytes: int | None = None
    run_memory_over_weights: float | None = None

    #: the GGUF child versions of the optional export stage (flows.export.ExportSummary as JSON)
    exports: list[dict] = []
    #: the closed-form repair after each pruning step: {"form": ..., "steps": [{iteration, consumers, error_before,
    #: error_after, seconds}]} (form "none": no repair ran)
    repair: dict[str, Any] = {}
    #: the vocabulary trimmed before any unit was pruned (tasks.vocab): its record, without the kept ids (None:
    #: kept whole). `metrics_before` are then of the trimmed model: the run's dense model
    vocab: dict[str, Any] | None = None

@dataclass(frozen=True)
class RunContext:
    """What every stage of one compress run shares: the job, its keys and tracking run, the inputs."""

    config: CompressConfig
    run_key: str
    run_id: str
    lineage: dict[str, str]
    source: SourceRef
    calib: CalibrationRef
    memory: MemoryWatch  # the process baseline, read before any model
    #: where the final model is copied (None: nowhere), and whether a previous pipprune output there may be replaced
    out_dir: str | None = None
    overwrite: bool = False
    #: wall seconds of each stage so far (the summary's `stage_seconds`)
    clock: StageClock = field(default_factory=StageClock)


@dataclass(frozen=True)
class DenseFigures:
    """The dense model's figures, measured once at the start of a run."""

    heldout: dict[str, float]
    lm_eval: Any  # tasks.evaluation.EvalResult
    serving: dict
    samples: Any  # tasks.samples.Samples
    general: Any = None  # tasks.evaluation.GeneralFigures

    def figures(self) -> dict[str, float]:
        """Its general-set and repetition figures (`model_figures`)."""
        return model_figures(self.general, self.samples)


@dataclass(frozen=True)
class Resumed:
    """Steps found complete in S3, and the held-out figures before recovery (when it ran)."""

    steps: int
    pre_recovery: dict[str, float] | None


@dataclass(frozen=True)
class Judgement:
    """What a person needs to decide whether to use the output: the verdict, samples, what the run cost in memory."""

    verdict: dict[str, Any]
    samples: list[dict[str, str]]
    memory: dict[str, float]
    #: the compressed model's general-set and repetition figures (`model_figures`), and the general set's record
    figures: dict[str, float] = field(default_factory=dict)
    general_set: dict[str, Any] = field(default_factory=dict)


def run_key_for(config: CompressConfig, source_fingerprint: str, calibration_hash: str, wordlist_hash: str) -> str:
    """Content address of a run: same source, data, settings and code -> same key (and S3 prefix)."""
    payload = json.dumps([source_fingerprint, calibration_hash, wordlist_hash, config.result_defining(),
                          code_digest()], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def removed_fraction(total: int, now: int) -> float:
    return (total - now) / total


def lineage_tags(config: CompressConfig, run_key: str, source: SourceRef, calib: CalibrationRef,
                 flow_run_id: str) -> dict[str, str]:
    """Tags that tie the run (and later the model version) to its inputs and code."""
    return {
        RUN_KEY: run_key,
        SOURCE_MODEL: config.model,
        SOURCE_FINGERPRINT: source.given.fingerprint,
        CALIBRATION_HASH: calib.data_hash,
        WORDLIST_HASH: calib.wordlist_hash,
        CONFIG_DIGEST: config.digest(),
        CODE_DIGEST: code_digest(),
        GIT_SHA: git_sha(),
        PREFECT_FLOW_RUN_ID: flow_run_id,
        **gguf_tags(source.gguf),
        **vocab_tags(source.vocab),
    }


def vocab_tags(record: dict | None) -> dict[str, str]:
    """What the vocabulary was trimmed to, when it was: the corpus, its sha256, the kept ids' sha256, the tokens
    before and after and the trimmed dense model's fingerprint (the model the run pruned and its teacher)."""
    if not record:
        return {}
    return {VOCAB_CORPUS: record["corpus"][:500], VOCAB_CORPUS_SHA256: record["corpus_sha256"],
            VOCAB_KEPT_SHA256: record["kept_sha256"], VOCAB_TOKENS: f"{record['vocab_before']}->{record['vocab_after']}",
            VOCAB_DENSE_FINGERPRINT: record["dense_fingerprint"]}


def describe_vocab(record: dict) -> str:
    """One line: the trim's tokens and the parameters it took."""
    removed = record["params_before"] - record["params_after"]
    return (f"vocabulary {record['vocab_before']:,} -> {record['vocab_after']:,} tokens, {removed:,} parameters "
            f"({removed / record['params_before']:.1%}) trimmed to {record['corpus']}")


def gguf_tags(record: dict | None) -> dict[str, str]:
    """What a GGUF source was (its dequantized weights are the dense model): the file, its sha256, its types."""
    if not record:
        return {}
    return {SOURCE_GGUF_FILE: record["file"], SOURCE_GGUF_PATH: record["path"],
            SOURCE_GGUF_SHA256: record["sha256"], SOURCE_GGUF_QUANT_TYPES: record["quant_types"]}


def run_params(config: CompressConfig, calib: CalibrationRef) -> dict:
    return {**config.model_dump(mode="json"), "n_pairs": calib.n_pairs, "n_not_perturbable": calib.n_skipped}


def history_row(iteration: int, model: ModelRef, metrics: dict[str, float]) -> dict[str, float]:
    return {"iteration": iteration, "num_params": model.num_params, **metrics}


def step_metrics(quick: dict[str, float], pruned: ModelRef, total: int, selection: PrunePlan,
                 stats: StatsRef, repaired: Any = None) -> dict[str, float]:
    """A pruning step's metrics; `repaired` (tasks.repair.RepairResult) adds what the step's repair did."""
    repair = {} if repaired is None else {
        "repair_consumers": float(repaired.consumers), "repair_error_before": repaired.error_before,
        "repair_error_after": repaired.error_after, "repair_seconds": repaired.seconds,
        "repair_tokens": float(repaired.tokens)}
    return {**quick, "num_params": float(pruned.num_params), "achieved_ratio": removed_fraction(total, pruned.num_params),
            "units_removed": float(len(selection.units)), "scoring_seconds": stats.seconds, **repair}


def step_record(iteration: int, selection: PrunePlan, metrics: dict[str, float], pruned: ModelRef,
                lineage: dict[str, str]) -> dict:
    """The checkpoint manifest's metadata for one pruning step."""
    return {"iteration": iteration, "units_removed": list(selection.units), "metrics": metrics,
            "score_table_sha256": selection.table_sha256, "model": pruned.model_dump(), "lineage": lineage}


def resumed_history(source: ModelRef, before: dict[str, float],
                    done: list[dict]) -> tuple[ModelRef, list[dict[str, float]]]:
    """The model to continue from and the history rows of the dense model and every step already in S3."""
    model, history = source, [history_row(0, source, before)]
    for i, record in enumerate(done, start=1):
        model, metrics = resumed_step(record)
        history.append(history_row(i, model, metrics))
    return model, history


def resumed_step(record: dict) -> tuple[ModelRef, dict[str, float]]:
    """The model and metrics of a step already checkpointed in S3."""
    return ModelRef(**record["model"]), record["metrics"]


def heldout(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("heldout_")}


def flatten_eval(prefix: str, results: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"{prefix}.{task}.{metric}": value for task, metrics in results.items() for metric, value in metrics.items()}


def final_metrics(total: int, model: ModelRef, history: list[dict], dense: DenseFigures, final_eval: dict,
                  memory: dict[str, float], figures: dict[str, float] | None = None) -> dict[str, float]:
    """The run's closing MLflow metrics; `figures`: the compressed model's general-set and repetition figures."""
    before = {**heldout(history[0]), **dense.figures()}
    after = {**heldout(history[-1]), **(figures or {})}
    return {**flatten_eval("source", dense.lm_eval.results), **flatten_eval("final", final_eval),
            **{f"source.{k}": v for k, v in before.items()}, **{f"final.{k}": v for k, v in after.items()},
            "final.num_params": float(model.num_params), "source.num_params": float(total),
            "final.achieved_ratio": removed_fraction(total, model.num_params), **memory}


def describe_figures(heldout_metrics: dict[str, float], lm_eval: dict[str, dict[str, float]]) -> str:
    """One line of a model's figures for the console: held-out perplexity, KL, and each task's first metric."""
    parts = [f"held-out perplexity {heldout_metrics['heldout_perplexity']:.4g}"] \
        if "heldout_perplexity" in heldout_metrics else []
    if heldout_metrics.get("heldout_kl"):
        parts.append(f"KL to dense {heldout_metrics['heldout_kl']:.3f}")
    for task, metrics in sorted(lm_eval.items()):
        name, value = next(iter(sorted(metrics.items())), (None, None))
        if name is not None:
            parts.append(f"{task} {name} {value:.4g}")
    return ", ".join(parts) or "no held-out texts and no lm-eval tasks"


def recovery_metrics(quick: dict[str, float], result: Any, total: int) -> dict[str, float]:
    """Step N+1's metrics: the quick eval after recovery plus what the recovery did (tasks.recovery.RecoveryResult)."""
    return {**quick, "num_params": float(result.model.num_params),
            "achieved_ratio": removed_fraction(total, result.model.num_params),
            "recovery_texts": float(result.n_texts), "recovery_first_loss": result.first_loss,
            "recovery_last_loss": result.last_loss, "recovery_seconds": result.seconds,
            "recovery_tokens": float(result.tokens)}


def recovery_record(stage: int, config: CompressConfig, metrics: dict[str, float], pruned: ModelRef,
                    result: Any, teacher: ModelRef | None, lineage: dict[str, str]) -> dict:
    """The checkpoint manifest's metadata for the recovery stage."""
    return {"iteration": stage, "stage": "recovery", "units_removed": [], "metrics": metrics,
            "recovery": config.recovery.model_dump(), "pruned_model_fingerprint": pruned.fingerprint,
            "teacher_fingerprint": teacher.fingerprint if teacher else None,
            "model": result.model.model_dump(), "lineage": lineage}


def sample_rows(prompts: tuple[str, ...], dense: list[str], compressed: list[str]) -> list[dict[str, str]]:
    return [{"prompt": p, "dense": d, "compressed": c} for p, d, c in zip(prompts, dense, compressed, strict=True)]


def model_figures(general: Any, samples: Any, dense_samples: Any = None) -> dict[str, float]:
    """One model's figures beside the held-out ones: the general set's (tasks.evaluation.GeneralFigures) and the
    share of distinct tokens of its continuations (tasks.samples.Samples), over the dense model's (`dense_samples`;
    None: this is the dense model)."""
    out = dict(general.metrics) if general is not None else {}
    if samples is not None and samples.distinct is not None:
        dense = dense_samples.distinct if dense_samples is not None else samples.distinct
        out["samples_distinct"] = samples.distinct
        if dense:
            out["samples_distinct_ratio"] = samples.distinct / dense
    return out


def quality_verdict(gate: EvaluationSettings, after: dict[str, float]) -> dict[str, Any]:
    """Usable or not, by the configured bounds: KL to the dense model on the calibration source's held-out texts,
    perplexity ratio to it on the general held-out set (on the held-out texts when there is none: a GGUF export
    measures one file), and the share of distinct tokens in the greedy continuations over the dense model's.

    Said in words on the summary, tagged on the version, and a `not usable` version is refused
    promotion: a compressed model that no longer models the language, or loops, is never registered silently.
    A bound whose figure is missing is listed as not measured; the verdict is `not measured` only when no
    bounded figure was.
    """
    bounds = ((("heldout_kl",), gate.max_kl, "KL to the dense model", "nats/token", True),
              (("general_ppl_ratio", "heldout_ppl_ratio"), gate.max_ppl_ratio, "perplexity ratio to the dense model",
               "x", True),
              (("samples_distinct_ratio",), gate.min_distinct_ratio,
               f"share of distinct {ngram_name()} in the continuations over the dense model's", "x", False))
    reasons, unmeasured, judged = [], [], {}
    for metrics, bound, what, unit, upper in bounds:
        if bound is None:
            continue
        metric = next((m for m in metrics if isinstance(after.get(m), float | int) and math.isfinite(after[m])), None)
        if metric is None:
            unmeasured.append(f"{what} not measured")
            continue
        value = judged[metric] = float(after[metric])
        if (value > bound) if upper else (value < bound):
            reasons.append(f"{what} {value:.3g} {unit} {'exceeds' if upper else 'is below'} {bound:g}")
    verdict = "not usable" if reasons else ("not measured" if unmeasured and not judged else "usable")
    return {"verdict": verdict, "reasons": reasons + (unmeasured if verdict == "not measured" else []),
            "not_measured": unmeasured, "figures": judged, "max_kl": gate.max_kl,
            "max_ppl_ratio": gate.max_ppl_ratio, "min_distinct_ratio": gate.min_distinct_ratio}


def verdict_tags(verdict: dict[str, Any], general_set: dict[str, Any] | None = None) -> dict[str, str]:
    """The verdict, its bounds, the figures it read and the general held-out set, as version tags."""
    figures = {QUALITY_FIGURE.format(metric=k): f"{v:.6g}" for k, v in verdict.get("figures", {}).items()}
    held = {QUALITY_GENERAL_SET_SHA256: general_set["sha256"], QUALITY_GENERAL_SET_TOKENS: str(general_set["tokens"])} \
        if general_set else {}
    return {QUALITY_VERDICT: verdict["verdict"], QUALITY_REASONS: "; ".join(verdict["reasons"]),
            QUALITY_MAX_KL: str(verdict["max_kl"]), QUALITY_MAX_PPL_RATIO: str(verdict["max_ppl_ratio"]),
            QUALITY_MIN_DISTINCT_RATIO: str(verdict.get("min_distinct_ratio")), **figures, **held}


def memory_figures(watch: MemoryWatch, num_params: int, dtype: str) -> dict[str, float]:
    """The process's peak resident memory so far, its baseline, and both over the weights in the run's dtype."""
    import torch

    return watch.figures(num_params * torch.empty((), dtype=getattr(torch, dtype)).element_size())


def version_tags(config: CompressConfig, lineage: dict[str, str], model: ModelRef, run_id: str,
                 signature: SignatureRef | None = None, eval_provenance: dict | None = None) -> dict[str, str]:
    """Lineage tags of the registered version: everything `pipprune lineage` re-verifies (the signature too),
    and what produced its evaluation figures (a digest of the provenance record plus its key fields)."""
    from infra.eval_provenance import tags as provenance_tags

    return {**(provenance_tags(eval_provenance) if eval_provenance else {}),
            **lineage, MODEL_FINGERPRINT: model.fingerprint, S3_URI: model.s3_uri or "",
            MANIFEST_SHA256: model.manifest_sha256 or "", MLFLOW_RUN_ID: run_id,
            ITERATIONS: str(config.scoring.iterations), METHOD: config.scoring.method,
            FINAL_CHECKPOINT: str(config.scoring.iterations + int(config.recovery.enabled)),
            RECOVERY_STEPS: str(config.recovery.steps), **recovery_tags(config), REPAIR: config.repair.form,
            UNIT: config.scoring.unit, RATIO: str(config.ratio),
            **(signature.tags() if signature else {})}


def recovery_tags(config: CompressConfig) -> dict[str, str]:
    """How the recovery stage trained (only when it ran): kind, and for KD which weights and the temperature."""
    r = config.recovery
    if not r.enabled:
        return {}
    kd = {RECOVERY_KD_PARAMS: r.kd_params, RECOVERY_TEMPERATURE: str(r.temperature)}
    return {RECOVERY_KIND: r.kind, **(kd if r.kind == "kd" else {})}


def summary(run: RunContext, version: str, model: ModelRef, history: list[dict], dense: DenseFigures,
            final_eval: dict, resumed: Resumed, judgement: Judgement) -> CompressSummary:
    total, ev = run.source.params_before, run.config.evaluation
    return CompressSummary(
        run_key=run.run_key, mlflow_run_id=run.run_id, registered_model=run.config.registered_model_name,
        model_version=version, s3_uri=model.s3_uri or "", out_dir=run.out_dir, params_before=total,
        params_after=model.num_params, achieved_ratio=removed_fraction(total, model.num_params),
        metrics_before={**heldout(history[0]), **dense.figures(), **flatten_eval("eval", dense.lm_eval.results)},
        metrics_after={**heldout(history[-1]), **judgement.figures, **flatten_eval("eval", final_eval)},
        iterations_resumed=resumed.steps,
        metrics_before_recovery=resumed.pre_recovery, tasks=list(ev.tasks), tasks_origin=ev.tasks_origin,
        quality=judgement.verdict, general_set=judgement.general_set, samples=judgement.samples,
        peak_rss_bytes=int(judgement.memory["run.peak_rss_bytes"]),
        peak_rss_over_weights=judgement.memory["run.peak_rss_over_weights"],
        baseline_rss_bytes=int(judgement.memory["run.baseline_rss_bytes"]),
        run_memory_over_weights=judgement.memory["run.run_memory_over_weights"],
        stage_seconds=_final_lap(run.clock), stage_peak_bytes=dict(run.clock.peaks),
        repair=repair_summary(run.config.repair.form, history), vocab=run.source.vocab)


def repair_summary(form: str, history: list[dict]) -> dict[str, Any]:
    """The repair each pruning step recorded (read from the history, so a resumed run reports the steps it
    did not run again)."""
    steps = [{"iteration": int(row["iteration"]), **{k.removeprefix("repair_"): row[k] for k in row
                                                      if k.startswith("repair_")}}
             for row in history if "repair_consumers" in row]
    return {"form": form, "steps": steps}


def _final_lap(clock: StageClock) -> dict[str, float]:
    """Every stage's wall seconds, the last ("final": the compressed model measured, judged, signed, registered)
    ending now."""
    clock.lap("final")
    return dict(clock.seconds)
