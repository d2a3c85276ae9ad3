"""What the MLflow UI shows about a compress run besides metrics: experiment kind, source, system
metrics, and the markdown description. Pure helpers; the tracking tasks call them.
"""

from __future__ import annotations

import getpass
import logging
import re
from typing import Any

from infra.tags import GIT_SHA

log = logging.getLogger(__name__)

#: MLflow 3 files untagged experiments by guessing (ours landed under "GenAI -> Evaluation runs")
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
#: MLflow shows this tag as the run's (markdown) description
DESCRIPTION_TAG = "mlflow.note.content"
ENTRY_POINT = "flows/compress.py:compress_flow"
SYSTEM_METRICS_INTERVAL_S = 5.0


def source_tags(lineage: dict[str, str]) -> dict[str, str]:
    """MLflow's standard source tags: what ran (entry point), which commit, who started it."""
    tags = {"mlflow.source.type": "JOB", "mlflow.source.name": ENTRY_POINT, "mlflow.project.entryPoint": "compress"}
    sha = lineage.get(GIT_SHA, "")
    if re.fullmatch(r"[0-9a-f]{40}(-dirty)?", sha):
        tags["mlflow.source.git.commit"] = sha.removesuffix("-dirty")
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        pass
    return tags


def protected_layers(params: dict[str, str]) -> tuple[int, int]:
    """(protect_first, protect_last) as the run applied them; uniform width cuts every layer alike."""
    if params.get("scoring.unit") == "width" and params.get("scoring.width_mode", "uniform") == "uniform":
        return 0, 0
    return int(params.get("scoring.protect_first", 0)), int(params.get("scoring.protect_last", 0))


def describe_running(params: dict[str, Any]) -> str:
    scoring = params.get("scoring", {})
    return (f"**Compressing** `{params.get('model')}` with **{scoring.get('method')}** on "
            f"**{scoring.get('unit')}** units to ratio {params.get('ratio')} in {scoring.get('iterations')} steps "
            "(running).")


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def describe_finished(params: dict[str, str], summary: dict[str, Any]) -> str:
    """The run's markdown description: model, method, unit, ratio achieved, quality before/after, where it is."""
    before, after = summary.get("metrics_before", {}), summary.get("metrics_after", {})
    lines = [
        f"### `{params.get('model')}` compressed with {params.get('scoring.method')} "
        f"({params.get('scoring.unit')} units)",
        "",
        "| | before | after |",
        "|---|---|---|",
        f"| parameters | {summary['params_before']:,} | {summary['params_after']:,} |",
    ]
    for key in sorted(set(before) | set(after)):
        lines.append(f"| {key} | {_fmt(before.get(key, '-'))} | {_fmt(after.get(key, '-'))} |")
    recovery = summary.get("metrics_before_recovery")
    lines += [
        "",
        f"- ratio asked {params.get('ratio')}, **achieved {summary['achieved_ratio']:.3f}** "
        f"in {params.get('scoring.iterations')} steps" + (_recovery_words(params) if recovery else ""),
        f"- registered: `{summary['registered_model']}` version {summary['model_version']} "
        f"(`models:/{summary['registered_model']}/{summary['model_version']}`)",
        f"- final checkpoint: `{summary['s3_uri']}`",
        f"- run key `{summary['run_key']}`; `pipprune lineage {summary['registered_model']} "
        f"--version {summary['model_version']}` re-verifies every hash",
    ]
    return "\n".join(lines)


def start_system_metrics(run_id: str):  # noqa: ANN201 - mlflow's monitor, or None
    """Sample CPU, memory, disk and network (GPU when present) into the run; None if MLflow cannot."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, samples_before_logging=1)
        monitor.start()
        return monitor
    except Exception as exc:  # noqa: BLE001 - metrics are an aid; the run must not fail for them
        log.warning("system metrics are off for run %s: %s", run_id, exc)
        return None


def stop_system_metrics(monitor) -> None:  # noqa: ANN001
    if monitor is None:
        return
    try:
        monitor.finish()
    except Exception as exc:  # noqa: BLE001
        log.warning("system metrics monitor did not stop cleanly: %s", exc)


def _recovery_words(params: dict) -> str:
    if params.get("recovery.kind") == "kd":
        return f", then distillation from the dense model ({params.get('recovery.kd_params')} weights)"
    return ", then LoRA recovery"
