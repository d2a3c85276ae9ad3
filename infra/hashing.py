"""File and directory digests used by manifests, caches and lineage."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_dir(root: str | Path) -> dict[str, str]:
    """relative POSIX path -> sha256 for every file under `root`."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def tree_digest(root: str | Path) -> str:
    """One sha256 over a directory's file names and contents."""
    h = hashlib.sha256()
    for rel, digest in sha256_dir(root).items():
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()
