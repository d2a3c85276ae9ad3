"""`pipprune lineage` and `pipprune promote`: audit and gated promotion of registered versions."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from infra.tags import S3_URI
from pipprune.commands.common import FAILED, json_output, runtime
from pipprune.commands.common import fail as _fail


def lineage(
    name: str = typer.Argument(..., help="registered model name"),
    version: Optional[str] = typer.Option(None, help="version number or alias (default: latest)"),
    public_key: Optional[Path] = typer.Option(None, help="PEM public key that must verify the model signature "
                                              "(default: the public half of PIPPRUNE_SIGNING_KEY / the install's key)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Print the chain behind a model version, re-verify every hash and the model signature; exit 1 on any mismatch."""
    key = _public_key(public_key)
    with json_output(json_out) as doc:
        settings = runtime(check=False)
        from infra.lineage import LineageError, trace
        from infra.mlflow_utils import mlflow_client
        from infra.s3store import CheckpointStore
        from infra.signing import check_version_signature

        try:
            result = trace(mlflow_client(), lambda run_key: CheckpointStore.from_settings(settings, run_key), name,
                           version, verify_signature=lambda tags, store: check_version_signature(
                               tags, store, key or _install_public_key(settings), settings.work_dir))
        except LineageError as exc:
            _fail(str(exc))
        if json_out:
            doc.emit({"ok": not result.problems, **result.model_dump(mode="json")})
        else:
            _print_lineage(result)
        if result.problems:
            raise typer.Exit(FAILED)


def _public_key(path: Path | None) -> bytes | None:
    """The --public-key PEM, checked before anything else runs (exit 2 naming the file)."""
    if path is None:
        return None
    from infra.signing import SigningError, load_public_key

    try:
        return load_public_key(path)
    except SigningError as exc:
        _fail(str(exc))


def _install_public_key(settings) -> bytes | None:  # noqa: ANN001
    """The public half of the key this install signs with, or None when there is none."""
    from infra.signing import SigningError, public_key_pem, signing_key_path

    try:
        return public_key_pem(signing_key_path(settings))
    except SigningError:
        return None


def _signature_verifier(settings, key: bytes | None):  # noqa: ANN001
    """tags -> SignatureCheck of that version's signature against the model in S3."""
    from infra.s3store import CheckpointStore
    from infra.signing import check_version_signature

    def verify(tags: dict[str, str]):
        store = CheckpointStore.for_uri(settings, tags[S3_URI]) if tags.get(S3_URI) else None
        return check_version_signature(tags, store, key or _install_public_key(settings), settings.work_dir)

    return verify


def _gguf_line(info: dict) -> str:
    state = ("sha256 re-checked: matches" if info["checked"] else "sha256 differs") if info["present"] \
        else "file not on this machine: not re-checked"
    return f"{info['file']} sha256 {info['sha256']} ({info['quant_types']}; {state})"


def _vocab_line(info: dict) -> str:
    state = ("trimmed copy re-checked: matches" if info["checked"] else "trimmed copy differs") if info["present"] \
        else "trimmed copy not on this machine: not re-checked"
    return (f"{info['tokens']} tokens, trimmed to {info['corpus']} (sha256 {str(info['corpus_sha256'])[:16]}); kept ids "
            f"sha256 {info['kept_sha256']} ({state})")


def _print_lineage(result) -> None:  # noqa: ANN001 - rich output only
    from rich.console import Console
    from rich.table import Table

    console = Console()
    head = Table(title=f"{result.name} version {result.version}", show_header=False)
    for label, value in [("source model", result.source_model), ("source sha256", result.source_fingerprint),
                         ("calibration sha256", result.calibration_hash), ("config digest", result.config_digest),
                         ("code digest", result.code_digest), ("git sha", result.git_sha),
                         ("Prefect flow run", result.prefect_flow_run_id), ("MLflow run", result.mlflow_run_id),
                         ("final checkpoint", result.final_s3_uri), ("signature", _signature_line(result.signature)),
                         ("MLflow logged model", result.logged_model_id or "-"),
                         *((("source GGUF", _gguf_line(result.source_gguf)),) if result.source_gguf else ()),
                         *((("vocabulary", _vocab_line(result.vocab)),) if result.vocab else ()),
                         *((f"dataset {ctx} digest", f"{d['digest']} ({d['name']})")
                           for ctx, d in sorted(result.datasets.items()))]:
        head.add_row(label, value)
    if result.export is not None:  # a GGUF child: its file, then the parent's chain below
        e = result.export
        for label, value in [("GGUF file", f"{e.uri}{e.file} ({e.quant})"), ("GGUF sha256", e.sha256),
                             ("GGUF file verified", "yes" if e.file_verified else "NO"),
                             ("parent version", f"{e.parent_name} v{e.parent_version}"),
                             ("parent signature", _signature_line(result.parent_signature))]:
            head.add_row(label, value)
    console.print(head)
    steps = Table(title="iterations")
    for column in ("iter", "params", "removed", "units", "held-out ppl", "files verified", "S3"):
        steps.add_column(column)
    for it in result.iterations:
        ppl = it.metrics.get("heldout_perplexity")
        label = str(it.iteration) if it.stage == "prune" else f"{it.iteration} ({it.stage})"
        steps.add_row(label, f"{it.num_params:,}" if it.num_params else "?",
                      f"{it.achieved_ratio:.2%}" if it.achieved_ratio is not None else "?", str(it.units_removed),
                      f"{ppl:.3f}" if ppl is not None else "", str(it.files_verified), it.s3_uri)
    console.print(steps)
    if result.problems:
        for problem in result.problems:
            console.print(f"[red]MISMATCH[/red] {problem}", soft_wrap=True)  # unwrapped: file names stay whole
    else:
        console.print("[green]lineage verified: every tag and sha256 matches"
                      + (", and the model signature verifies" if result.signature else "") + "[/green]")


def _signature_line(check) -> str:  # noqa: ANN001
    if check is None:
        return "not checked"
    if not check.signed:
        return "UNSIGNED"
    status = "verified" if check.verified else "NOT VERIFIED"
    return f"{status}: {check.uri} (signed by key {check.key_fingerprint[:16]})"


def promote(
    name: str = typer.Argument(..., help="registered model name"),
    version: str = typer.Option(..., help="version to promote"),
    alias: str = typer.Option(..., help="alias to set, e.g. champion"),
    gates: Optional[Path] = typer.Option(None, help="YAML gate file (default: PIPPRUNE_GATES_FILE or no gates)"),
    reason: str = typer.Option("", help="why, recorded on the version"),
    public_key: Optional[Path] = typer.Option(None, help="PEM public key that must verify the model signature "
                                              "(default: the public half of PIPPRUNE_SIGNING_KEY / the install's key)"),
) -> None:
    """Move ALIAS to VERSION only if its logged metrics pass every gate and its model signature verifies
    (unless the gate file says `require_signature: false`)."""
    from pydantic import ValidationError

    from infra.promotion import PromotionError, PromotionGates, check_alias

    try:
        check_alias(alias)
        gate_cfg = PromotionGates.from_file(gates) if gates else PromotionGates()
    except ValidationError as exc:
        _fail("gate file: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    except PromotionError as exc:
        _fail(str(exc))
    key = _public_key(public_key)
    settings = runtime(check=False)
    from infra.mlflow_utils import mlflow_client
    from infra.promotion import promote as do_promote

    try:
        outcome = do_promote(mlflow_client(), name, version, alias, gate_cfg, reason,
                             verify_signature=_signature_verifier(settings, key))
    except PromotionError as exc:
        _fail(str(exc))
    for gate in outcome.gates:
        mark = "PASS" if gate.passed else "FAIL"
        typer.echo(f"{mark} {gate.gate}: {gate.detail}")
    if not outcome.promoted:
        _fail(f"{name} v{version} not promoted to {alias!r}: failing gates listed above", code=FAILED)
    typer.echo(f"{name} v{version} is {alias!r}" + ("" if outcome.changed else " (already; nothing changed)"))
