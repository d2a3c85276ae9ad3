"""Code identity for cache keys and lineage.

`code_digest` hashes the algorithm's source files, so a cache entry is reused only while the code
that computed it is unchanged; `git_sha` is what lineage shows to humans.
"""

from __future__ import annotations

import hashlib
import subprocess
from functools import lru_cache
from pathlib import Path

#: the distribution's version; `pipprune.__version__` re-exports it
__version__ = "0.1.0"

#: the directory holding the top-level packages (the repository root, or site-packages)
_ROOT = Path(__file__).resolve().parents[1]
_RESULT_DEFINING = ("pip_core", "tasks", "infra/config.py", "infra/version.py")


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the sources that determine results (pip_core, tasks, config)."""
    h = hashlib.sha256(__version__.encode())
    for name in _RESULT_DEFINING:
        root = _ROOT / name
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for path in files:
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def git_sha() -> str:
    """The checkout's commit (with '-dirty' when it has local changes), or 'unknown'."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_ROOT, capture_output=True, text=True, timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
