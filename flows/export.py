"""The export flow: wiring only. A registered version -> GGUF file -> measured -> S3 -> signed -> child version.

`pipprune export` runs `export_flow`; the compress flow's optional last stage (config `export:`) calls
`export_version` for each type on the version it just registered.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows import records
from infra.config import CompressConfig, EvaluationSettings
from infra.layout import model_dir_layout
from tasks.export import (
    ExportSummary,
    ParentRef,
    check_exportable_source,
    child_tags,
    gguf_name,
    measure_gguf,
    parent_of_run,
    publish_gguf,
    register_gguf,
    resolve_parent,
    sign_gguf,
    write_gguf_file,
)
from tasks.refs import CalibrationRef, ModelRef


def linked_name(parent_name: str) -> str:
    """The registered model holding a model's GGUF versions."""
    return f"{parent_name}-gguf"


def export_version(parent: ParentRef, quant: str, heldout: str, max_length: int,
                   registered_name: str | None = None, gate: EvaluationSettings = EvaluationSettings()) -> ExportSummary:
    """One type: write, measure against the dense model (read back by transformers), judge by `gate`'s bounds (as
    compress judges its output: a `not usable` file is refused promotion), upload, sign, register."""
    gguf = write_gguf_file(parent.model, quant, gguf_name(parent, quant))
    metrics = measure_gguf(gguf, parent.model, parent.dense, heldout, max_length)
    verdict = records.quality_verdict(gate, {"heldout_kl": metrics["final.heldout_kl"],
                                             "heldout_ppl_ratio": metrics["final.heldout_ppl_ratio"]})
    published = publish_gguf(gguf, parent, metrics)
    signature = sign_gguf(gguf, published)
    tags = {**child_tags(parent, gguf, published, signature, heldout), **records.verdict_tags(verdict)}
    name = registered_name or linked_name(parent.name)
    version, run_id = register_gguf(name, parent, tags, metrics, {
        "quant": quant, "parent": f"{parent.name}/{parent.version}", "heldout": heldout, "max_length": str(max_length),
        "gguf_file_type": str(gguf.info["file_type"])})
    return ExportSummary(registered_model=name, model_version=version, parent=f"{parent.name} v{parent.version}",
                         quant=quant, file=published.file, sha256=published.sha256, size_bytes=published.size,
                         s3_uri=published.uri, signature_uri=signature.uri, mlflow_run_id=run_id,
                         tensor_types=gguf.info["tensor_types"], fallbacks=gguf.info["fallbacks"], metrics=metrics,
                         quality=verdict)


@flow(name="export", persist_result=False)
def export_flow(name: str, version: str, quants: list[str], heldout: str, max_length: int = 256,
                registered_name: str | None = None) -> list[ExportSummary]:
    """Export `name`/`version` as one GGUF child version per type in `quants`."""
    parent = resolve_parent(name, version)
    return [export_version(parent, quant, heldout, max_length, registered_name) for quant in quants]


def check_export(config: CompressConfig, source: ModelRef) -> None:
    """The compress flow's first check when `export:` is set: refuse a model GGUF cannot express before any work."""
    if config.export.quant:
        check_exportable_source(source, config.export.quant)


def export_stage(config: CompressConfig, version: str, model: ModelRef, dense: ModelRef, run_id: str,
                 calib: CalibrationRef) -> list[dict]:
    """The compress flow's optional last stage: each `export.quant` type as a child of the version just registered,
    measured on the flow's own held-out texts (those of its quick eval), or the reference's Persuasion without."""
    if not config.export.quant:
        return []
    heldout = Path(calib.heldout_path)
    if calib.n_heldout == 0:
        heldout = model_dir_layout(dense.local_dir).heldout
        if not heldout.is_file():
            raise ValueError("export: no held-out texts to measure the GGUF file on (calibration.heldout_samples is 0 "
                             "and the source has no tasks/persuasion.jsonl)")
    parent = parent_of_run(config.registered_model_name, version, run_id, model, dense)
    return [export_version(parent, quant, str(heldout), calib.max_length, config.export.registered_model_name,
                           config.evaluation).model_dump(mode="json") for quant in config.export.quant]
