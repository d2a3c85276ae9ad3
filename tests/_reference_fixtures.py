"""The tiny reference model, built once and reused across test runs while its builder is unchanged."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILDER = ROOT / "pipprune" / "infra" / "reference"


def builder_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(BUILDER.glob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def tiny_reference_dir() -> Path:
    """Path to a built `tiny` reference model (about two minutes the first time)."""
    from pipprune.infra.reference.build import build_reference

    out = ROOT / ".pipprune" / "test-cache" / f"tiny-{builder_digest()}"
    if not (out / "manifest.json").is_file():
        build_reference("tiny", out, ROOT / ".pipprune" / "cache", seed=0, progress=False)
    return out
