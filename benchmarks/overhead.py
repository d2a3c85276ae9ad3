"""Orchestration overhead: the compress flow (Prefect + MLflow + S3) vs the same pip_core loop called
directly on the same inputs, and the speedup of an identical (cached) rerun.

Starts its own local stack on free ports. Usage: python -m benchmarks.overhead [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, Timer, calibration_pairs, write


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--pairs", type=int, default=16)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="pipprune-overhead-"))
    from infra.settings import Settings, apply_process_env
    from infra.stack import LocalStack

    settings = Settings(home=home, s3_port=_port(), mlflow_port=_port(), prefect_port=_port())
    stack = LocalStack(settings)
    stack.up()
    try:
        os.environ.update({**stack.client_env(), "PIPPRUNE_HOME": str(home)})
        apply_process_env(Settings())
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from infra.config import CompressConfig
        from flows.compress import compress_flow
        from pip_core import io, schedule

        config = CompressConfig(model=str(args.model), calibration=str(args.model), ratio=0.2, unit="block",
                                method="pip", iterations=2, n_samples=args.pairs, heldout_samples=0, seed=0,
                                registered_model_name="overhead")
        def direct_loop() -> None:
            pairs, texts = calibration_pairs(args.model, args.pairs, seed=0)
            model, tok = io.load(args.model)
            schedule.prune_iteratively(model, tok, schedule.ScoringOptions("pip", "block"), 0.2, 2, pairs=pairs, texts=texts, progress=False)
            io.save_pruned(model, tok, home / "direct")

        direct_loop()  # warm-up: imports, kernels and file caches must not be charged to either side
        with Timer() as direct:
            direct_loop()
        with temporary_settings(updates={PREFECT_API_URL: os.environ["PREFECT_API_URL"]}):
            with Timer() as flow:
                compress_flow(config)
            with Timer() as cached:
                compress_flow(config)
    finally:
        stack.down()
    row = {"direct_s": direct.seconds, "flow_s": flow.seconds, "cached_rerun_s": cached.seconds,
           "overhead": flow.seconds / direct.seconds - 1, "cached_speedup": flow.seconds / cached.seconds}
    print(row)
    table = [f"# Pipeline overhead ({args.model.name}, block, PIP, ratio 0.2, 2 iterations, {args.pairs} pairs)", "",
             "| direct pip_core loop s | compress flow s | overhead | identical rerun s | rerun speedup |",
             "|---|---|---|---|---|",
             f"| {direct.seconds:.1f} | {flow.seconds:.1f} | {row['overhead']:+.0%} | {cached.seconds:.1f} | "
             f"{row['cached_speedup']:.1f}x |"]
    print(write("overhead", {"row": row}, table))


if __name__ == "__main__":
    main()
