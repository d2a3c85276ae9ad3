"""`pipprune export NAME --version V --format gguf --quant q8_0`: a registered version as a GGUF child version.

Refused before any weights are read (exit 2): an unknown format or type, a held-out file that is not there,
a version that is not a pipprune-compressed transformers model, and a model GGUF cannot express (checked on
the version's config.json and tokenizer files, read from S3 and verified against its manifest).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import typer

from infra.layout import model_dir_layout
from infra.tags import RUN_KEY, S3_URI, SOURCE_MODEL
from pipprune.commands.common import FAILED, json_output, runtime
from pipprune.commands.common import fail as _fail

FORMATS = ("gguf",)
#: the small files of a checkpoint that decide whether it can be written as GGUF
_METADATA_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export(
    name: str = typer.Argument(..., help="registered model name"),
    version: str = typer.Option(..., help="version number or alias to export"),
    fmt: str = typer.Option("gguf", "--format", help="output format: gguf"),
    quant: str = typer.Option("f16", help="comma-separated weight types the gguf package produces: "
                              "f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0"),
    heldout: Optional[Path] = typer.Option(None, help="held-out texts (JSONL 'text' or blank-line separated) the "
                                           "file's quality is measured on [default: DENSE/tasks/persuasion.jsonl]"),
    max_length: int = typer.Option(256, min=2, help="tokens per held-out text"),
    registered_name: Optional[str] = typer.Option(None, "--name", help="registered model of the GGUF versions "
                                                  "[default: NAME-gguf]"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document (logs: stderr)"),
    auto_stack: Optional[bool] = typer.Option(None, "--auto-stack/--no-auto-stack",
                                              help="start the embedded stack if it is down [default: true]"),
) -> None:
    """Write a registered version as GGUF, measure it against the dense model, sign it and register it as a child."""
    with json_output(json_out) as doc:
        quants = _check_request(fmt, quant, heldout)
        settings = runtime(auto_stack)
        heldout_path = _precheck(settings, name, version, quants, heldout)
        summaries = _run(name, version, quants, str(heldout_path), max_length, registered_name)
        if json_out:
            doc.emit({"ok": True, "exports": [s.model_dump(mode="json") for s in summaries]})
        else:
            _print(summaries)


def _check_request(fmt: str, quant: str, heldout: Path | None) -> list[str]:
    from infra.gguf_write import GgufExportError, check_quant

    if fmt.lower() not in FORMATS:
        _fail(f"--format {fmt!r} is not supported; formats: {', '.join(FORMATS)}")
    try:
        quants = list(dict.fromkeys(check_quant(q) for q in quant.split(",") if q.strip()))
    except GgufExportError as exc:
        _fail(str(exc))
    if not quants:
        _fail("--quant is empty: name at least one type, e.g. --quant q8_0")
    if heldout is not None:
        _check_heldout(heldout)
    return quants


def _check_heldout(path: Path) -> None:
    from pip_core.divergence import read_texts
    from pip_core.errors import PipCoreError

    try:
        read_texts(path)
    except PipCoreError as exc:
        _fail(f"--heldout: {exc}")


def _precheck(settings, name: str, version: str, quants: list[str], heldout: Path | None) -> Path:  # noqa: ANN001
    """The version exists and is exportable, judged from its small files in S3; returns the held-out file."""
    from infra.gguf_store import TAGS, is_export
    from infra.gguf_write import GgufExportError, check_exportable
    from infra.hashing import sha256_bytes
    from infra.lineage import LineageError, resolve_version
    from infra.mlflow_utils import mlflow_client
    from infra.s3store import CheckpointStore, CorruptCheckpointError

    try:
        mv = resolve_version(mlflow_client(), name, version)
    except LineageError as exc:
        _fail(str(exc))
    tags = dict(mv.tags)
    if is_export(tags):
        _fail(f"{name} v{mv.version} is itself a GGUF export; export its parent "
              f"{tags.get(TAGS['parent_name'])} v{tags.get(TAGS['parent_version'])}")
    uri = tags.get(S3_URI)
    if not uri or RUN_KEY not in tags:
        _fail(f"{name} v{mv.version} was not registered by pipprune compress (no S3 checkpoint tags)")
    store = CheckpointStore.for_uri(settings, uri)
    try:
        listed = store.files_under(uri)
    except CorruptCheckpointError as exc:
        _fail(str(exc), code=FAILED)
    if not any(f.endswith(".safetensors") for f in listed):
        _fail(f"{uri} holds no *.safetensors weights (GGUF export reads safetensors)")
    with tempfile.TemporaryDirectory(prefix="pipprune-export-check-") as tmp:
        for rel in (f for f in _METADATA_FILES if f in listed):
            body = store.get_bytes(uri + rel)
            if body is None or sha256_bytes(body) != listed[rel]:
                _fail(f"{uri}{rel} does not match its checkpoint manifest (run `pipprune lineage {name} "
                      f"--version {mv.version}`)", code=FAILED)
            (Path(tmp) / rel).write_bytes(body)
        try:
            for quant in quants:
                check_exportable(Path(tmp), quant, weights=False)
        except GgufExportError as exc:
            _fail(f"{name} v{mv.version}: {exc}")
    if heldout is None:
        heldout = model_dir_layout(tags.get(SOURCE_MODEL, "")).heldout
        if not heldout.is_file():
            _fail(f"no held-out texts: the dense source has no {heldout.relative_to(heldout.parents[1])}; "
                  "pass --heldout FILE")
        _check_heldout(heldout)
    return heldout.resolve()


def _run(name: str, version: str, quants: list[str], heldout: str, max_length: int, registered_name: str | None):
    from flows.export import export_flow
    from infra.gguf_write import GgufExportError
    from infra.lineage import LineageError
    from infra.model_source import ModelNotFoundError
    from infra.runtime import prefect_settings
    from pipprune.commands.common import CliError

    try:
        with prefect_settings():
            return export_flow(name, version, quants, heldout, max_length, registered_name)
    except (GgufExportError, ModelNotFoundError) as exc:
        _fail(str(exc))
    except LineageError as exc:
        _fail(str(exc), code=FAILED)
    except (KeyboardInterrupt, CliError):
        raise
    except Exception as exc:  # noqa: BLE001 - report, exit non-zero
        _fail(f"export failed: {type(exc).__name__}: {exc}", code=FAILED)


def _print(summaries) -> None:  # noqa: ANN001 - rich output only
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="pipprune export (quality read back by transformers' GGUF loader, against the dense model)")
    for column in ("version", "type", "MB", "KL", "top-1", "ppl ratio", "parent KL", "tokenizer", "S3"):
        table.add_column(column)
    for s in summaries:
        m = s.metrics
        table.add_row(f"{s.registered_model} v{s.model_version}", s.quant, f"{s.size_bytes / 1e6:.2f}",
                      f"{m['final.heldout_kl']:.4f}", f"{m['final.heldout_top1_agreement']:.3f}",
                      f"{m['final.heldout_ppl_ratio']:.3f}", f"{m['parent.heldout_kl']:.4f}",
                      f"{m['gguf.tokenizer_match']:.0%}", s.s3_uri + s.file)
    console.print(table)
    for s in summaries:
        if s.fallbacks:
            console.print(f"{s.quant}: {len(s.fallbacks)} tensor(s) stored F16 (rows not whole {s.quant} blocks)")
