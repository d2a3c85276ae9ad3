"""The wall time of a `make` target on a clean clone against its limit (`make bench`: 90 minutes, `make test`: 15, on
the 2-core machine).

For `make bench` the Makefile passes the epoch second it read when make started, so the figure covers everything
the target does (install, reference build, runs, tables). `make test` does not time itself (a suite run must not
change committed results): its figure is written from a timed clean-clone run's start and end (`--since`, `--until`,
`--commit`). The result is JSON + a markdown row like every other benchmark.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import datetime, timezone

from benchmarks.common import write
from infra.version import git_sha


def _stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds")


def measure(since: float, until: float, target: str, limit_min: float, commit: str) -> tuple[dict, list[str]]:
    """The result (JSON payload, markdown table) of a target that ran from `since` to `until` (epoch seconds)."""
    if until <= since:
        raise ValueError(f"the end ({until}) must be after the start ({since})")
    wall = until - since
    payload = {"target": target, "wall_s": round(wall, 1), "limit_s": limit_min * 60, "met": wall <= limit_min * 60,
               "started": _stamp(since), "finished": _stamp(until), "commit": commit, "cpus": os.cpu_count()}
    minutes, seconds = divmod(round(wall), 60)
    table = ["| target | wall | limit | cpus | commit | started (UTC) |", "|---|---|---|---|---|---|",
             f"| `{target}` | {minutes} min {seconds} s | {limit_min:g} min | {payload['cpus']} | {commit} | "
             f"{payload['started']} |"]
    return payload, table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--since", type=float, required=True, help="epoch second the target started")
    parser.add_argument("--until", type=float, default=None, help="epoch second it ended (default: now)")
    parser.add_argument("--name", default="make_bench", help="result name (benchmarks/results/<name>.json)")
    parser.add_argument("--target", default="make bench", help="what was timed, as the table shows it")
    parser.add_argument("--limit-min", type=float, default=90.0, help="the wall-time limit, minutes")
    parser.add_argument("--commit", default=None, help="the commit that ran (default: HEAD)")
    args = parser.parse_args(argv)
    try:
        payload, table = measure(args.since, time.time() if args.until is None else args.until, args.target,
                                 args.limit_min, args.commit or git_sha())
    except ValueError as exc:
        parser.error(str(exc))
    print(write(args.name, payload, table))


if __name__ == "__main__":
    main()
