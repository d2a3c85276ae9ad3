"""Orchestration overhead: the compress flow (Prefect + MLflow + S3) against the bare pip_core loop doing the
same work (same model, pairs, unit, ratio, steps, dtype and device; load, score, prune, save), and the
speedup of an identical (cached) rerun.

Flow and bare loop are timed alternately with different seeds (a fresh, uncached flow run each time)
and the best of each is compared, so a noisy shared machine biases neither side. Starts its own
local stack on free ports. Usage: python -m benchmarks.overhead [--model DIR] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, ROOT, Timer, calibration_pairs, write


def _default_model() -> Path:
    """The small reference when built, else the tiny reference the tests build."""
    if (DEFAULT_MODEL / "config.json").is_file():
        return DEFAULT_MODEL
    tiny = sorted((ROOT / ".pipprune" / "test-cache").glob("tiny*/config.json"))
    if not tiny:
        raise SystemExit("no reference model: run `pipprune reference build` (or the tests) first, or pass --model")
    return tiny[-1].parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--pairs", type=int, default=32, help="calibration pairs (32: a short job, where fixed costs weigh most)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model_dir = args.model or _default_model()
    home = Path(tempfile.mkdtemp(prefix="pipprune-overhead-"))
    from infra.settings import Settings, apply_process_env
    from infra.stack import LocalStack, free_stack_ports

    settings = Settings(home=home, **free_stack_ports(), s3_endpoint_url=None, mlflow_tracking_uri=None,
                        prefect_api_url=None)
    stack = LocalStack(settings)
    stack.up(wait=True, timeout=240)
    try:
        os.environ.update({**stack.client_env(), "PIPPRUNE_HOME": str(home)})
        apply_process_env(Settings())
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from flows.compress import compress_flow
        from infra.config import CompressConfig
        from pip_core import io, schedule
        from pip_core.importance import CalibrationData

        def config(seed: int) -> CompressConfig:
            return CompressConfig(model=str(model_dir), calibration=str(model_dir), ratio=0.2, unit="block",
                                  method="pip", iterations=2, n_samples=args.pairs, heldout_samples=0, seed=seed,
                                  device="cpu", registered_model_name="overhead",
                                  serving={"measure": False})  # extra work the bare loop does not do

        def direct_loop(seed: int) -> None:
            pairs, texts = calibration_pairs(model_dir, args.pairs, seed=seed)
            model, tok = io.load(model_dir, device="cpu")
            schedule.prune_iteratively(model, CalibrationData(tok, pairs, texts=texts),
                                       schedule.ScoringOptions("pip", "block"), 0.2, 2, seed=seed, progress=False)
            io.save_pruned(model, tok, home / f"direct-{seed}")

        direct_loop(100)  # warm-up: imports, kernels and file caches must not be charged to either side
        directs, flows = [], []
        with temporary_settings(updates={PREFECT_API_URL: os.environ["PREFECT_API_URL"]}):
            compress_flow(config(100))  # warm-up of the flow's own imports and server connections
            for seed in range(args.repeats):
                with Timer() as direct:
                    direct_loop(seed)
                with Timer() as flow:
                    compress_flow(config(seed))
                directs.append(direct.seconds)
                flows.append(flow.seconds)
            with Timer() as cached:
                compress_flow(config(0))
    finally:
        stack.down()
    best_direct, best_flow = min(directs), min(flows)
    row = {"model": model_dir.name, "direct_s": best_direct, "flow_s": best_flow, "direct_runs": directs,
           "flow_runs": flows, "cached_rerun_s": cached.seconds, "overhead": best_flow / best_direct - 1,
           "extra_s_per_iteration": (best_flow - best_direct) / 2, "cached_speedup": best_flow / cached.seconds}
    print(row)
    table = [f"# Pipeline overhead ({model_dir.name}, block, PIP, ratio 0.2, 2 iterations, {args.pairs} pairs, "
             f"CPU, best of {args.repeats})", "",
             "| bare pip_core loop s | compress flow s | overhead | extra s / iteration | identical rerun s | "
             "rerun speedup |", "|---|---|---|---|---|---|",
             f"| {best_direct:.1f} | {best_flow:.1f} | {row['overhead']:+.0%} | {row['extra_s_per_iteration']:.1f} | "
             f"{cached.seconds:.1f} | {row['cached_speedup']:.1f}x |"]
    print(write("overhead", {"row": row, "args": {**vars(args), "model": str(model_dir)}}, table))


if __name__ == "__main__":
    main()
