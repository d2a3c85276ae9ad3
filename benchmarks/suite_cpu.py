"""Where the test suite's time goes: CPU seconds by kind of process, sampled from /proc while a command runs.

`make test` keeps both cores busy most of the time, so its wall time is work; this says whose work it is (CLI
subprocesses, the servers of each stack, the pytest processes, pool workers) without touching the tests.
Each process's user + system time is read every second and its last reading kept, so a process that lives
less than a second may be missed. Linux only.

    python -m benchmarks.suite_cpu -- make test        # writes benchmarks/results/suite_cpu.{json,md}
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import write

#: (category, pattern on the command line), first match wins
KINDS: tuple[tuple[str, str], ...] = (
    ("S3 server (SeaweedFS)", r"\bweed\b"),
    ("MLflow server", r"mlflow server|uvicorn|gunicorn|huey"),
    ("Prefect server", r"prefect server start"),
    ("Prefect flow-run processes", r"prefect\.runner|-m prefect\b"),
    ("pipprune CLI: {}", r"pipprune(?:\.cli|/bin/pipprune)? (\w+)"),
    ("pytest-xdist workers", r"exec\(eval\(sys\.stdin"),
    ("pytest controller (and the tiny model build)", r"-m pytest"),
    ("process-pool workers (multiprocessing spawn)", r"multiprocessing\.spawn"),
    ("pip", r"-m pip\b|bin/pip\b"),
)


@dataclass
class Proc:
    kind: str
    cmdline: str
    cpu_seconds: float = 0.0


def kind_of(cmdline: str) -> str:
    for label, pattern in KINDS:
        found = re.search(pattern, cmdline)
        if found:
            return label.format(*found.groups()) if found.groups() else label
    return "other python" if "python" in cmdline else "other"


class Sampler:
    """Reads every process's CPU time once a second in a thread; `procs` is keyed by (pid, start time)."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval, self.procs = interval, {}
        self._stop = threading.Event()
        self._hz = os.sysconf("SC_CLK_TCK")
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rfind(")") + 2:].split()
                key = (pid, fields[19])  # pid numbers are reused; the start time tells processes apart
                if key not in self.procs:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    if not cmdline.strip():
                        continue  # kernel threads, or a process caught between fork and exec
                    self.procs[key] = Proc(kind_of(cmdline), cmdline[:300])
                self.procs[key].cpu_seconds = (int(fields[11]) + int(fields[12])) / self._hz
            except (OSError, IndexError, ValueError):
                continue  # the process ended between listing and reading


def summarise(procs: list[Proc], wall_seconds: float, cores: int) -> dict:
    kinds: dict[str, dict] = {}
    for p in procs:
        row = kinds.setdefault(p.kind, {"kind": p.kind, "processes": 0, "cpu_seconds": 0.0})
        row["processes"] += 1
        row["cpu_seconds"] += p.cpu_seconds
    rows = sorted(kinds.values(), key=lambda r: -r["cpu_seconds"])
    total = sum(r["cpu_seconds"] for r in rows)
    for r in rows:
        r["share"] = r["cpu_seconds"] / total if total else 0.0
        r["per_process"] = r["cpu_seconds"] / r["processes"]
    return {"wall_seconds": wall_seconds, "cores": cores, "cpu_seconds": total,
            "utilisation": total / (wall_seconds * cores) if wall_seconds else 0.0, "kinds": rows}


def table(summary: dict, command: str) -> list[str]:
    lines = [f"# CPU time by kind of process while `{command}` ran", "",
             f"Wall {summary['wall_seconds']:.0f} s on {summary['cores']} cores; {summary['cpu_seconds']:.0f} "
             f"CPU-seconds sampled ({summary['utilisation']:.0%} of the cores' time).", "",
             "| kind | processes | CPU s | share | CPU s per process |", "|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['processes']} | {r['cpu_seconds']:.0f} | {r['share']:.1%} | {r['per_process']:.1f} |"
              for r in summary["kinds"] if r["cpu_seconds"] >= 1]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="suite_cpu")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args()
    command = [c for c in args.command if c != "--"] or ["make", "test"]
    started = time.monotonic()
    with Sampler() as sampler:
        rc = subprocess.run(command, check=False).returncode
    summary = summarise(list(sampler.procs.values()), time.monotonic() - started, os.cpu_count() or 1)
    summary.update(command=" ".join(command), returncode=rc)
    print(write(args.name, summary, table(summary, " ".join(command))))
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
