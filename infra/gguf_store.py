"""A GGUF export in S3, beside the checkpoint it was made from, and its lineage back to the dense source.

Layout (the parent checkpoint's own objects are untouched, so its manifest and signature still verify):

    s3://B/runs/<run_key>/iter-<i>/model/...                   the parent (a registered HF model)
    s3://B/runs/<run_key>/iter-<i>/gguf-<quant>/<file>.gguf    the export (the child version's s3_uri)
    s3://B/runs/<run_key>/iter-<i>/gguf-<quant>.manifest.json  its sha256, size, parent and measurement
    s3://B/runs/<run_key>/iter-<i>/gguf-<quant>.sig            OpenSSF model signature of gguf-<quant>/

The manifest is written last, as for checkpoints: "has a manifest" means "complete".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from infra.hashing import sha256_bytes, sha256_file
from infra.signing import SignatureCheck
from infra.tags import (
    FORMAT,
    GGUF_FILE,
    GGUF_MANIFEST_SHA256,
    GGUF_MANIFEST_URI,
    GGUF_QUANT,
    GGUF_SHA256,
    MANIFEST_SHA256,
    MODEL_FINGERPRINT,
    PARENT_MANIFEST_SHA256,
    PARENT_MODEL_FINGERPRINT,
    PARENT_NAME,
    PARENT_VERSION,
    RUN_KEY,
    S3_URI,
    SOURCE_FINGERPRINT,
    SOURCE_MODEL,
)

TAGS = {
    "quant": GGUF_QUANT,
    "sha256": GGUF_SHA256,
    "file": GGUF_FILE,
    "manifest_uri": GGUF_MANIFEST_URI,
    "manifest_sha256": GGUF_MANIFEST_SHA256,
    "parent_name": PARENT_NAME,
    "parent_version": PARENT_VERSION,
    "parent_fingerprint": PARENT_MODEL_FINGERPRINT,
    "parent_manifest_sha256": PARENT_MANIFEST_SHA256,
}
#: the parent's lineage tags copied onto the child, which must still equal the parent's
INHERITED = (RUN_KEY, SOURCE_MODEL, SOURCE_FINGERPRINT)


def export_uri(parent_model_uri: str, quant: str) -> str:
    """s3://B/runs/K/iter-N/model/ -> s3://B/runs/K/iter-N/gguf-<quant>/"""
    root = parent_model_uri.rstrip("/")
    if not root.endswith("/model"):
        raise ValueError(f"{parent_model_uri} is not a checkpoint's model folder")
    return f"{root[: -len('model')]}gguf-{quant}/"


def manifest_uri(uri: str) -> str:
    return uri.rstrip("/") + ".manifest.json"


@dataclass(frozen=True)
class PublishedGguf:
    uri: str  # the folder (s3_uri of the child version)
    file: str
    sha256: str
    size: int
    manifest_uri: str
    manifest_sha256: str


def publish(store, path: Path, quant: str, parent_model_uri: str, metadata: dict[str, Any]) -> PublishedGguf:  # noqa: ANN001
    """Upload the GGUF file (verified read-back) next to its parent, then its manifest; idempotent per file digest."""
    from infra.s3store import split_uri

    uri = export_uri(parent_model_uri, quant)
    digest, size = sha256_file(path), path.stat().st_size
    m_uri = manifest_uri(uri)
    existing = store.get_bytes(m_uri)
    if existing is not None:
        old = json.loads(existing)
        if old.get("file") == path.name and old.get("sha256") == digest:
            return PublishedGguf(uri, path.name, digest, size, m_uri, sha256_bytes(existing))
    _, base = split_uri(uri)
    bucket, m_key = split_uri(m_uri)
    store.client.delete_object(Bucket=bucket, Key=m_key)  # a stale manifest must not vouch for a new file
    store.put_verified(path, base + path.name, digest)
    body = json.dumps({"file": path.name, "sha256": digest, "size": size, "quant": quant,
                       "parent_model_uri": parent_model_uri,
                       "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "metadata": metadata}, indent=1, sort_keys=True, default=str).encode()
    store.put_bytes(m_uri, body)
    return PublishedGguf(uri, path.name, digest, size, m_uri, sha256_bytes(body))


# ------------------------------------------------------------------------------------------- lineage
class ExportRecord(BaseModel):
    """The GGUF step of a lineage: the file, its parent, and what was re-verified."""

    uri: str
    file: str
    quant: str
    sha256: str
    manifest_uri: str
    parent_name: str
    parent_version: str
    file_verified: bool
    metrics: dict[str, float] = {}


def is_export(tags: dict[str, str]) -> bool:
    return tags.get(FORMAT) == "gguf"


def trace_export(client, mv, store_for_run_key, trace_parent: Callable[..., Any],  # noqa: ANN001, ANN201 - Lineage
                 verify_signature: Callable[[dict[str, str], Any], SignatureCheck] | None = None,
                 dense_check: Callable[[str, str], str | None] | None = None):
    """Lineage of a GGUF child version: its own file, manifest and signature, then the parent's whole chain.

    `trace_parent(name, version, verify_signature)` is `infra.lineage.trace`; the parent's problems come back
    prefixed with the parent version. `dense_check(source_model, fingerprint)` re-fingerprints the dense source
    where it is reachable (None: verified or not reachable; a string: the mismatch).
    """
    tags = dict(mv.tags)
    problems: list[str] = []
    store = store_for_run_key(tags.get(RUN_KEY, ""))
    uri, m_uri = tags.get(S3_URI, ""), tags.get(TAGS["manifest_uri"], "")
    body = store.get_bytes(m_uri) if m_uri else None
    manifest: dict[str, Any] = {}
    if body is None:
        problems.append(f"GGUF manifest {m_uri or '(no tag)'} is missing from S3")
    else:
        manifest = json.loads(body)
        if sha256_bytes(body) != tags.get(TAGS["manifest_sha256"]):
            problems.append(f"GGUF manifest {m_uri}: sha256 {sha256_bytes(body)[:12]} != registered "
                            f"{tags.get(TAGS['manifest_sha256'], '')[:12]}")
    file_name = tags.get(TAGS["file"], "")
    data = store.get_bytes(uri.rstrip("/") + "/" + file_name) if uri and file_name else None
    file_ok = False
    if data is None:
        problems.append(f"GGUF file {uri}{file_name} is missing from S3")
    else:
        actual = sha256_bytes(data)
        file_ok = actual == tags.get(TAGS["sha256"]) == manifest.get("sha256")
        if not file_ok:
            problems.append(f"GGUF file {uri}{file_name}: sha256 {actual[:12]}, registered "
                            f"{tags.get(TAGS['sha256'], '')[:12]}, manifest {str(manifest.get('sha256', ''))[:12]}")
    parent_name, parent_version = tags.get(TAGS["parent_name"], ""), tags.get(TAGS["parent_version"], "")
    parent = trace_parent(parent_name, parent_version, verify_signature)
    parent_tags = dict(client.get_model_version(parent_name, parent_version).tags)
    for key, parent_key in ((TAGS["parent_fingerprint"], MODEL_FINGERPRINT),
                            (TAGS["parent_manifest_sha256"], MANIFEST_SHA256),
                            *((k, k) for k in INHERITED)):
        if tags.get(key) != parent_tags.get(parent_key):
            problems.append(f"tag {key}: GGUF version says {tags.get(key)!r}, parent {parent_name} v{parent_version} "
                            f"says {parent_tags.get(parent_key)!r}")
    if manifest and manifest.get("parent_model_uri") != parent_tags.get(S3_URI):
        problems.append(f"GGUF manifest names parent {manifest.get('parent_model_uri')}, the parent version is at "
                        f"{parent_tags.get('pipprune.s3_uri')}")
    if uri and parent_tags.get(S3_URI) and uri != export_uri(parent_tags[S3_URI],
                                                                        tags.get(TAGS["quant"], "")):
        problems.append(f"GGUF folder {uri} is not beside its parent checkpoint {parent_tags['pipprune.s3_uri']}")
    signature = verify_signature(tags, store) if verify_signature is not None else None
    if signature is not None:
        problems.extend(signature.problems)
    dense_check = dense_check or dense_source_check
    mismatch = dense_check(tags.get(SOURCE_MODEL, ""), tags.get(SOURCE_FINGERPRINT, ""))
    if mismatch:
        problems.append(mismatch)
    problems.extend(f"parent {parent_name} v{parent_version}: {p}" for p in parent.problems)
    run = client.get_run(mv.run_id) if mv.run_id else None
    metrics = dict(run.data.metrics) if run is not None else {}
    record = ExportRecord(uri=uri, file=file_name, quant=tags.get(TAGS["quant"], ""), sha256=tags.get(TAGS["sha256"], ""),
                          manifest_uri=m_uri, parent_name=parent_name, parent_version=parent_version,
                          file_verified=file_ok, metrics={k: float(v) for k, v in metrics.items()})
    return parent.model_copy(update={"name": mv.name, "version": str(mv.version), "final_s3_uri": uri,
                                     "mlflow_run_id": mv.run_id or "", "signature": signature, "problems": problems,
                                     "export": record, "parent_signature": parent.signature,
                                     "logged_model_id": None})


def dense_source_check(source_model: str, fingerprint: str) -> str | None:
    """Re-fingerprint the dense source where it is a local directory here: None when it matches or is not here."""
    path = Path(source_model).expanduser()
    if not source_model or not (path / "config.json").is_file():
        return None
    from pip_core.io import model_fingerprint

    actual = model_fingerprint(path)
    if actual != fingerprint:
        return f"dense source {source_model}: fingerprint {actual[:12]} != registered {fingerprint[:12]}"
    return None
