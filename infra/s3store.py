"""Checkpoints in S3: upload verified, manifest written last, downloads checked against the manifest.

Layout: s3://BUCKET/runs/<run_key>/iter-<i>/<files...> + manifest.json. A manifest exists only
once every file it lists was uploaded and verified, so "has a manifest" means "complete"; a
file whose bytes no longer match its manifest hash is never handed back.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from infra.credentials import load_credentials
from infra.hashing import sha256_bytes, sha256_dir, sha256_file
from infra.settings import Settings

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_ITER = re.compile(r"iter-(\d+)/$")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's bytes in S3 do not match its manifest."""


class UploadVerificationError(RuntimeError):
    """An uploaded object does not read back as the local file."""


@dataclass(frozen=True)
class CheckpointRef:
    iteration: int
    uri: str  # s3://bucket/runs/<key>/iter-<i>/
    manifest_sha256: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


def s3_client(settings: Settings):  # noqa: ANN201
    """boto3 client with bounded, backed-off retries.

    Credentials come from the standard AWS chain; for the embedded stack's own endpoint, when the
    environment names no key, from the install's 0600 credentials file (so the exports that
    `stack up` prints are enough to use it).
    """
    config = Config(retries={"max_attempts": settings.s3_max_attempts, "mode": "standard"},
                    connect_timeout=5, read_timeout=60, s3={"addressing_style": "path"})
    keys = {}
    if not os.environ.get("AWS_ACCESS_KEY_ID") and settings.s3_endpoint_url == embedded_s3_url(settings):
        stored = load_credentials(settings.stack_dir)
        if stored is not None:
            keys = {"aws_access_key_id": stored.access_key_id, "aws_secret_access_key": stored.secret_access_key}
    # a session of its own: boto3's default session resolves the AWS chain once per process and keeps the
    # first keys it saw, so a long-lived process (a worker, a test run) would sign with stale credentials
    return boto3.session.Session().client("s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region,
                                          config=config, **keys)


def embedded_s3_url(settings: Settings) -> str:
    return f"http://127.0.0.1:{settings.s3_port}"


def split_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri}")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


class CheckpointStore:
    """Checkpoints of one run (`run_key`) in one bucket."""

    def __init__(self, client, bucket: str, run_key: str) -> None:  # noqa: ANN001
        self.client, self.bucket, self.run_key = client, bucket, run_key
        self.prefix = f"runs/{run_key}/"

    @classmethod
    def from_settings(cls, settings: Settings, run_key: str) -> CheckpointStore:
        return cls(s3_client(settings), settings.s3_bucket, run_key)

    @classmethod
    def for_uri(cls, settings: Settings, uri: str) -> CheckpointStore:
        bucket, key = split_uri(uri)
        parts = key.split("/")
        if len(parts) < 2 or parts[0] != "runs":
            raise ValueError(f"{uri} is not a pipprune checkpoint URI")
        return cls(s3_client(settings), bucket, parts[1])

    def iteration_uri(self, iteration: int) -> str:
        return f"s3://{self.bucket}/{self.prefix}iter-{iteration}/"

    # ------------------------------------------------------------------ upload
    def upload_checkpoint(self, iteration: int, local_dir: Path, metadata: dict[str, Any]) -> CheckpointRef:
        """Upload every file, verify each read-back, then write the manifest (last)."""
        local_dir = Path(local_dir)
        files = sha256_dir(local_dir)
        if not files:
            raise ValueError(f"nothing to upload in {local_dir}")
        base = f"{self.prefix}iter-{iteration}/"
        # a stale manifest from an earlier attempt must not vouch for new files
        self.client.delete_object(Bucket=self.bucket, Key=base + MANIFEST)
        entries: dict[str, dict[str, Any]] = {}
        for rel, digest in files.items():
            entries[rel] = {"sha256": digest, "size": self.put_verified(local_dir / rel, base + rel, digest)}
        manifest = {"run_key": self.run_key, "iteration": iteration, "files": entries,
                    "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "metadata": metadata}
        body = json.dumps(manifest, indent=1, sort_keys=True, default=str).encode()
        self.client.put_object(Bucket=self.bucket, Key=base + MANIFEST, Body=body, ContentType="application/json")
        return CheckpointRef(iteration=iteration, uri=self.iteration_uri(iteration), manifest_sha256=sha256_bytes(body),
                             files=entries, metadata=metadata)

    def put_verified(self, path: Path, key: str, digest: str | None = None) -> int:
        """Upload one file with its sha256 as object metadata and check the read-back; returns its size."""
        digest = digest or sha256_file(path)
        self.client.upload_file(str(path), self.bucket, key, ExtraArgs={"Metadata": {"sha256": digest}})
        head = self.client.head_object(Bucket=self.bucket, Key=key)
        size = Path(path).stat().st_size
        if head["ContentLength"] != size or head.get("Metadata", {}).get("sha256") != digest:
            raise UploadVerificationError(f"s3://{self.bucket}/{key} did not verify after upload")
        return size

    # ------------------------------------------------------------------ read
    def _manifest(self, iteration: int) -> CheckpointRef | None:
        key = f"{self.prefix}iter-{iteration}/{MANIFEST}"
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        manifest = json.loads(body)
        return CheckpointRef(iteration=iteration, uri=self.iteration_uri(iteration), manifest_sha256=sha256_bytes(body),
                             files=manifest["files"], metadata=manifest.get("metadata", {}))

    def iterations(self) -> list[int]:
        found: set[int] = set()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                m = _ITER.search(common["Prefix"])
                if m:
                    found.add(int(m.group(1)))
        return sorted(found)

    def complete_checkpoints(self) -> list[CheckpointRef]:
        """Checkpoints that have a manifest, in iteration order (files not yet re-hashed)."""
        refs = [self._manifest(i) for i in self.iterations()]
        return [r for r in refs if r is not None]

    def latest_complete(self) -> CheckpointRef | None:
        """Highest iteration whose manifest exists and whose files all exist with the listed sizes."""
        for ref in reversed(self.complete_checkpoints()):
            if not self._missing_or_resized(ref):
                return ref
        return None

    def _missing_or_resized(self, ref: CheckpointRef) -> list[str]:
        _, base = split_uri(ref.uri)
        problems = []
        for rel, entry in ref.files.items():
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=base + rel)
            except self.client.exceptions.ClientError:
                problems.append(f"{rel}: missing")
                continue
            if head["ContentLength"] != entry["size"]:
                problems.append(f"{rel}: size {head['ContentLength']} != {entry['size']}")
        return problems

    def verify_checkpoint(self, ref: CheckpointRef) -> list[str]:
        """Re-hash every object of `ref` from S3; returns one line per mismatch (empty = verified)."""
        _, base = split_uri(ref.uri)
        problems = []
        for rel, entry in sorted(ref.files.items()):
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=base + rel)["Body"].read()
            except self.client.exceptions.NoSuchKey:
                problems.append(f"{ref.uri}{rel}: missing")
                continue
            if sha256_bytes(body) != entry["sha256"]:
                problems.append(f"{ref.uri}{rel}: sha256 {sha256_bytes(body)[:12]} != manifest {entry['sha256'][:12]}")
        return problems

    def download_uri(self, uri: str, local_dir: Path) -> Path:
        """Download the checkpoint files under `uri` (an iteration prefix or a sub-folder of one)."""
        bucket, key = split_uri(uri)
        m = re.search(r"iter-(\d+)/", key)
        if bucket != self.bucket or not m:
            raise ValueError(f"{uri} is not a checkpoint of run {self.run_key} in {self.bucket}")
        ref = self._manifest(int(m.group(1)))
        if ref is None:
            raise CorruptCheckpointError(f"{uri} has no manifest: the checkpoint is incomplete")
        sub = key.split(f"iter-{ref.iteration}/", 1)[1]
        return self.download_checkpoint(ref, Path(local_dir), subdir=sub)

    def download_checkpoint(self, ref: CheckpointRef, local_dir: Path, subdir: str = "") -> Path:
        """Download and verify into a temp dir, then move into place; never leaves corrupt files."""
        _, base = split_uri(ref.uri)
        local_dir = Path(local_dir)
        local_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=local_dir.parent))
        try:
            for rel, entry in ref.files.items():
                if not rel.startswith(subdir):
                    continue
                target = tmp / rel[len(subdir):]
                target.parent.mkdir(parents=True, exist_ok=True)
                self.client.download_file(self.bucket, base + rel, str(target))
                if sha256_file(target) != entry["sha256"]:
                    raise CorruptCheckpointError(f"{ref.uri}{rel} does not match its manifest sha256")
            if local_dir.exists():
                shutil.rmtree(local_dir)
            tmp.rename(local_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return local_dir

    # ------------------------------------------------------------------ single objects (signatures)
    def files_under(self, uri: str) -> dict[str, str]:
        """file (relative to `uri`) -> sha256, as the manifest of the checkpoint holding `uri` lists them."""
        bucket, key = split_uri(uri)
        m = re.search(r"iter-(\d+)/", key)
        ref = self._manifest(int(m.group(1))) if bucket == self.bucket and m else None
        if ref is None:
            raise CorruptCheckpointError(f"{uri} is not under a complete checkpoint of run {self.run_key}")
        sub = key.split(f"iter-{ref.iteration}/", 1)[1]
        return {rel[len(sub):]: entry["sha256"] for rel, entry in ref.files.items() if rel.startswith(sub)}

    def put_bytes(self, uri: str, body: bytes) -> None:
        """Write one small object pipprune owns (a signature) and check it reads back byte for byte."""
        bucket, key = split_uri(uri)
        self.client.put_object(Bucket=bucket, Key=key, Body=body)
        if self.get_bytes(uri) != body:
            raise UploadVerificationError(f"{uri} did not verify after upload")

    def get_bytes(self, uri: str) -> bytes | None:
        """One object's bytes, or None when it does not exist."""
        bucket, key = split_uri(uri)
        try:
            return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def download_prefix(self, uri: str, local_dir: Path) -> list[str]:
        """Every object under `uri` as it is in S3, NOT checked against any manifest (for signature checks)."""
        bucket, prefix = split_uri(uri)
        prefix = prefix.rstrip("/") + "/"
        names = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):]
                target = (Path(local_dir) / rel).resolve()
                if not rel or not target.is_relative_to(Path(local_dir).resolve()):
                    raise CorruptCheckpointError(f"unsafe object name under {uri}: {obj['Key']!r}")
                target.parent.mkdir(parents=True, exist_ok=True)
                self.client.download_file(bucket, obj["Key"], str(target))
                names.append(rel)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        return sorted(names)
