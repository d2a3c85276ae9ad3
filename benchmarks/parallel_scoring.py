"""Data-parallel scoring speedup on this machine: one process with T threads against N Dask workers with 1 thread
each, scoring the same calibration pairs (PIP, one step) on the same model.

For the workers, the local cluster's start and each worker's model load are timed apart from the scoring
(`warm` = the model already loaded on every worker, as for every step after a run's first): a long run
pays them once. Scores are checked equal to the single-process ones. The machine is shared, so each
configuration is timed `--repeats` times alternately and the best kept.
Usage: python -m benchmarks.parallel_scoring [--model DIR] [--pairs 32] [--unit block] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import calibration_pairs, write
from benchmarks.overhead import _default_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--unit", default="block")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default="parallel_scoring")
    args = parser.parse_args()
    model_dir = args.model or _default_model()

    from infra.config import RuntimeSettings, ScoringSettings
    from pip_core import io, schedule
    from pip_core.importance import CalibrationData
    from pip_core.schedule import StepSpec
    from tasks import parallel_scoring
    from tasks.refs import ModelRef
    from tasks.scoring import scoring_options

    pairs, _ = calibration_pairs(model_dir, args.pairs, seed=0)
    net, tokenizer = io.load(model_dir, dtype=torch.float32, device="cpu")
    total = sum(p.numel() for p in net.parameters())
    spec = StepSpec(step=1, target_ratio=0.2, params_to_remove=int(0.2 * total), seed=0)
    options = scoring_options(ScoringSettings(unit=args.unit, method="pip"), max_length=args.max_length)
    ref = ModelRef(local_dir=str(model_dir), fingerprint=io.model_fingerprint(model_dir), num_params=total)

    def single(threads: int) -> tuple[float, list[float]]:
        torch.set_num_threads(threads)
        started = time.perf_counter()
        _, scores = schedule.score_step(net, CalibrationData(tokenizer, pairs), spec, options, progress=False)
        return time.perf_counter() - started, scores

    rows: dict[str, dict] = {}
    runtime = RuntimeSettings(device="cpu", dtype="float32", scoring_workers=2, scoring_threads=1)
    started = time.perf_counter()
    with parallel_scoring.dask_client(runtime) as client:
        cluster_start = time.perf_counter() - started
        for repeat in range(args.repeats):
            for threads in (2, 1):
                seconds, base = single(threads)
                row = rows.setdefault(f"1 process x {threads} threads", {"workers": 1, "threads": threads, "s": []})
                row["s"].append(seconds)
            started = time.perf_counter()
            _, spread = parallel_scoring.score_on_cluster(ref, pairs, spec, options, runtime, client)
            seconds = time.perf_counter() - started
            row = rows.setdefault("2 Dask workers x 1 thread", {"workers": 2, "threads": 1, "s": [], "cold_s": None})
            if repeat == 0:
                row["cold_s"] = seconds  # includes each worker's model load
                started = time.perf_counter()
                _, spread = parallel_scoring.score_on_cluster(ref, pairs, spec, options, runtime, client)
                seconds = time.perf_counter() - started
            row["s"].append(seconds)
            worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(spread, base, strict=True))
            row["max_rel_diff"] = max(row.get("max_rel_diff", 0.0), worst)
    base_s = min(rows["1 process x 2 threads"]["s"])
    for row in rows.values():
        row["best_s"] = min(row["s"])
        row["per_pair_s"] = row["best_s"] / len(pairs)
        row["speedup_vs_1x2"] = base_s / row["best_s"]
    title = (f"# Data-parallel scoring ({model_dir.name}, {total:,} params, PIP {args.unit}, {len(pairs)} pairs, "
             f"max_length {args.max_length}, CPU float32, best of {args.repeats}; Dask cluster start "
             f"{cluster_start:.1f} s)")
    table = [title, "", "| configuration | scoring s | s / pair | speedup vs 1 x 2 threads | first call s (loads model) "
             "| max rel. score diff |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        cold = f"{row['cold_s']:.1f}" if row.get("cold_s") else "-"
        diff = f"{row['max_rel_diff']:.1e}" if "max_rel_diff" in row else "-"
        table.append(f"| {name} | {row['best_s']:.1f} | {row['per_pair_s']:.3f} | {row['speedup_vs_1x2']:.2f}x "
                     f"| {cold} | {diff} |")
    md = write(args.name, {"model": str(model_dir), "num_params": total, "pairs": len(pairs), "unit": args.unit,
                           "max_length": args.max_length, "cluster_start_s": cluster_start, "rows": rows}, table)
    print(md.read_text())


if __name__ == "__main__":
    main()
