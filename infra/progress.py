"""How a run shows progress: live bars on a terminal, one plain line per step in a log, or nothing.

Bars rewrite one line with carriage returns: right on a terminal, but in a CI or scheduler log they
become single lines many kilobytes long that say nothing about how far a run is. So outside a
terminal every tqdm bar (pipprune's, lm-eval's, transformers', datasets') is switched off through
their environment variables and each pruning step logs one line instead.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

from infra.memory import peak_bytes

Mode = Literal["bar", "log", "off"]

#: the logger of stage lines: what a person follows on the console (pipprune.commands.console shows it)
CONSOLE_LOGGER = "pipprune.console"
#: what switches every tqdm bar off (set outside a terminal; the tests' CLI fork server treats it as set by a run)
BARS_OFF = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def choose_mode(quiet: bool, terminal: bool) -> Mode:
    return "off" if quiet else ("bar" if terminal else "log")


def configure(mode: Mode) -> None:
    """Apply `mode` to this process (before torch, transformers or Prefect are imported)."""
    os.environ["PIPPRUNE_PROGRESS"] = mode
    if mode != "bar":
        os.environ.update(BARS_OFF)
    if mode == "off":
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def current_mode() -> Mode:
    mode = os.environ.get("PIPPRUNE_PROGRESS", "log")
    return mode if mode in ("bar", "log", "off") else "log"  # type: ignore[return-value]


class StepProgress:
    """One line per pruning step: `step i/n: scored U units, removed R, params P -> Q (-x%), elapsed T`."""

    def __init__(self, steps: int) -> None:
        self.steps, self.started = steps, time.monotonic()

    def line(self, step: int, units_scored: int, units_removed: int, params_before: int, params_now: int) -> str:
        removed = params_before - params_now
        return (f"step {step}/{self.steps}: scored {units_scored} units, removed {units_removed}; params "
                f"{params_before:,} -> {params_now:,} (-{removed / max(params_before, 1):.1%}), "
                f"elapsed {time.monotonic() - self.started:.0f}s")

    def step(self, step: int, units_scored: int, units_removed: int, params_before: int, params_now: int) -> None:
        if current_mode() == "off":
            return
        line = self.line(step, units_scored, units_removed, params_before, params_now)
        _logger().info(line)
        logging.getLogger(CONSOLE_LOGGER).info(line)


class StageClock:
    """Wall seconds of each named stage of a run, and the process's peak resident memory when it ended, kept for
    its summary: where a run's minutes went, and which stage raised its peak (the peak is a high-water mark, so a
    stage whose figure is above the one before it set a new peak)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, int] = {}

    def lap(self, name: str) -> None:
        """The time since the previous lap (or the start) belongs to stage `name` (added to it when repeated)."""
        now = time.monotonic()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self.last, 2)
        self.peaks[name] = peak_bytes()
        self.last = now


def stage(message: str) -> None:
    """One line a person reads on the console: a stage of a run began or ended (silent with --quiet)."""
    if current_mode() != "off":
        logging.getLogger(CONSOLE_LOGGER).info(message)


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger inside a flow (the line also reaches the Prefect UI), else a plain one."""
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger

        try:
            return get_run_logger()
        except MissingContextError:
            pass
    except ImportError:
        pass
    return logging.getLogger("pipprune.progress")
