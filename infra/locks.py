"""Run-level locks: two runs with the same run key (a retried schedule, two people launching the same
job) take turns, and the second finds the first's checkpoints and cached results instead of racing
on the same files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from filelock import FileLock

from infra.settings import Settings

log = logging.getLogger(__name__)


@contextmanager
def run_lock(settings: Settings, run_key: str) -> Iterator[None]:
    """Hold HOME/locks/<run_key>.lock for the body; waits (with a log line) while another run holds it."""
    path = settings.home / "locks" / f"{run_key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except TimeoutError:
        log.warning("run %s is already in progress here; waiting for it to finish, then reusing its results", run_key)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
