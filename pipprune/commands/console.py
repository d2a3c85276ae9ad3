"""What a person reads while a long command runs: one line per stage and the summary.

Prefect's task-state lines, MLflow's INFO lines, library warnings and progress bars are the run's
record, not its story: they go to a log file whose path is the first line printed (`--verbose`
keeps them on the terminal instead). The redirect is at the file-descriptor level, as for `--json`,
so what libraries print from C or through their own reference to stdout/stderr moves too.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from infra.progress import CONSOLE_LOGGER


class _ConsoleHandler(logging.Handler):
    """Stage lines (logger `pipprune.console`) to the person's terminal, each prefixed with the elapsed time."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(logging.INFO)
        self.stream, self.started = stream, time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        elapsed = time.monotonic() - self.started
        line = f"[{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] {record.getMessage()}\n"
        for stream in {id(self.stream): self.stream, id(sys.stderr): sys.stderr}.values():  # terminal, and the log
            stream.write(line)
            stream.flush()


class Console:
    """The terminal's own stdout/stderr, kept while fds 1 and 2 point at the log file."""

    def __init__(self, out: TextIO, err: TextIO, log_path: Path | None) -> None:
        self.out, self.err, self.log_path = out, err, log_path


#: the console of the command now running (None: output is not redirected); read by print_error
ACTIVE: list[Console] = []


def log_path_for(home: Path, command: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return home / "logs" / f"{command}-{stamp}-{os.getpid()}.log"


@contextmanager
def console_output(log_path: Path | None) -> Iterator[Console]:
    """Send everything but stage lines and the summary to `log_path` (None: change nothing, `--verbose`)."""
    logger = logging.getLogger(CONSOLE_LOGGER)
    logger.setLevel(logging.INFO)
    if log_path is None:
        handler = _ConsoleHandler(sys.stderr)
        logger.addHandler(handler)
        try:
            yield Console(sys.stdout, sys.stderr, None)
        finally:
            logger.removeHandler(handler)
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    out = os.fdopen(os.dup(saved_out), "w", buffering=1, encoding="utf-8", errors="replace")
    err = os.fdopen(os.dup(saved_err), "w", buffering=1, encoding="utf-8", errors="replace")
    err.write(f"log: {log_path}  (--verbose shows it here)\n")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    handler = _ConsoleHandler(err)
    logger.addHandler(handler)
    console = Console(out, err, log_path)
    ACTIVE.append(console)
    try:
        yield console
    finally:
        ACTIVE.remove(console)
        logger.removeHandler(handler)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        out.flush()
        err.flush()
