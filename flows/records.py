"""Small named constructors for the records the compress flow writes: lineage tags, step metrics,
checkpoint metadata, version tags, the summary. Pure functions, so the flow body reads as the DAG.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel

from infra.config import CompressConfig
from infra.version import code_digest, git_sha
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
    #: the GGUF child versions of the optional export stage (flows.export.ExportSummary as JSON)
    exports: list[dict] = []


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
        "pipprune.run_key": run_key,
        "pipprune.source_model": config.model,
        "pipprune.source_fingerprint": source.model.fingerprint,
        "pipprune.calibration_hash": calib.data_hash,
        "pipprune.wordlist_hash": calib.wordlist_hash,
        "pipprune.config_digest": config.digest(),
        "pipprune.code_digest": code_digest(),
        "pipprune.git_sha": git_sha(),
        "pipprune.prefect_flow_run_id": flow_run_id,
    }


def run_params(config: CompressConfig, calib: CalibrationRef) -> dict:
    return {**config.model_dump(mode="json"), "n_pairs": calib.n_pairs, "n_not_perturbable": calib.n_skipped}


def history_row(iteration: int, model: ModelRef, metrics: dict[str, float]) -> dict[str, float]:
    return {"iteration": iteration, "num_params": model.num_params, **metrics}


def step_metrics(quick: dict[str, float], pruned: ModelRef, total: int, selection: PrunePlan,
                 stats: StatsRef) -> dict[str, float]:
    return {**quick, "num_params": float(pruned.num_params), "achieved_ratio": removed_fraction(total, pruned.num_params),
            "units_removed": float(len(selection.units)), "scoring_seconds": stats.seconds}


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


def final_metrics(total: int, model: ModelRef, before: dict[str, float], after: dict[str, float],
                  source_eval: dict, final_eval: dict) -> dict[str, float]:
    return {**flatten_eval("source", source_eval), **flatten_eval("final", final_eval),
            **{f"source.{k}": v for k, v in before.items()}, **{f"final.{k}": v for k, v in after.items()},
            "final.num_params": float(model.num_params), "source.num_params": float(total),
            "final.achieved_ratio": removed_fraction(total, model.num_params)}


def version_tags(config: CompressConfig, lineage: dict[str, str], model: ModelRef, run_id: str,
                 signature: SignatureRef | None = None, eval_provenance: dict | None = None) -> dict[str, str]:
    """Lineage tags of the registered version: everything `pipprune lineage` re-verifies (the signature too),
    and what produced its evaluation figures (a digest of the provenance record plus its key fields)."""
    from infra.eval_provenance import tags as provenance_tags

    return {**(provenance_tags(eval_provenance) if eval_provenance else {}),
            **lineage, "pipprune.model_fingerprint": model.fingerprint, "pipprune.s3_uri": model.s3_uri or "",
            "pipprune.manifest_sha256": model.manifest_sha256 or "", "pipprune.mlflow_run_id": run_id,
            "pipprune.iterations": str(config.scoring.iterations), "pipprune.method": config.scoring.method,
            "pipprune.final_checkpoint": str(config.scoring.iterations + int(config.recovery.enabled)),
            "pipprune.recovery_steps": str(config.recovery.steps), **recovery_tags(config),
            "pipprune.unit": config.scoring.unit, "pipprune.ratio": str(config.ratio),
            **(signature.tags() if signature else {})}


def recovery_tags(config: CompressConfig) -> dict[str, str]:
    """How the recovery stage trained (only when it ran): kind, and for KD which weights and the temperature."""
    r = config.recovery
    if not r.enabled:
        return {}
    kd = {"pipprune.recovery_kd_params": r.kd_params, "pipprune.recovery_temperature": str(r.temperature)}
    return {"pipprune.recovery_kind": r.kind, **(kd if r.kind == "kd" else {})}


def summary(config: CompressConfig, run_key: str, run_id: str, version: str, model: ModelRef, total: int,
            before: dict[str, float], after: dict[str, float], source_eval: dict, final_eval: dict,
            resumed: int, pre_recovery: dict[str, float] | None, out_dir: str | None) -> CompressSummary:
    return CompressSummary(
        run_key=run_key, mlflow_run_id=run_id, registered_model=config.registered_model_name, model_version=version,
        s3_uri=model.s3_uri or "", out_dir=out_dir, params_before=total, params_after=model.num_params,
        achieved_ratio=removed_fraction(total, model.num_params),
        metrics_before={**before, **flatten_eval("eval", source_eval)},
        metrics_after={**after, **flatten_eval("eval", final_eval)}, iterations_resumed=resumed,
        metrics_before_recovery=pre_recovery)
