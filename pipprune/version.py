"""Code identity for cache keys and lineage.

`code_digest` hashes the algorithm's source files, so a cache entry is reused only while the code
that computed it is unchanged; `git_sha` is what lineage shows to humans.
"""

from __future__ import annotations

import hashlib
import subprocess
from functools import lru_cache
from pathlib import Path

from pipprune import __version__

_PACKAGE_DIR = Path(__file__).resolve().parent
_RESULT_DEFINING = ("pip_core", "tasks", "config.py", "version.py")


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the sources that determine results (pip_core, tasks, config)."""
    h = hashlib.sha256(__version__.encode())
    for name in _RESULT_DEFINING:
        root = _PACKAGE_DIR / name
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for path in files:
            h.update(str(path.relative_to(_PACKAGE_DIR)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def git_sha() -> str:
    """The checkout's commit (with '-dirty' when it has local changes), or 'unknown'."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=_PACKAGE_DIR, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_PACKAGE_DIR, capture_output=True, text=True, timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
