"""Data-parallel scoring: one step's calibration pairs spread over the workers of a Dask cluster.

Each worker loads the step's model once (the process's model hand-off keeps it for later shards of the
same fingerprint), scores its contiguous shard of pairs with `pip_core.importance.score_sums`, and
returns per-unit float64 sums with their count; `reduce_sums` adds them in shard order and divides
once, so the scores are the single-process scores up to float64 summation order (the test compares
them, and the units removed, on the tiny reference with 2 workers).

The cluster is a local one (`runtime.scoring_workers` processes, `runtime.scoring_threads` torch
threads each) unless `runtime.scoring_cluster` names an existing scheduler; on a node with several
GPUs each worker takes the GPU of its shard's index (`cuda:i mod n`). Workers of a remote cluster read
the model from its S3 checkpoint (ModelRef.s3_uri) when its local directory is not on their machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

from infra.config import RuntimeSettings
from pip_core import importance
from pip_core.errors import PipCoreError
from pip_core.schedule import ScoringOptions, StepSpec
from pip_core.units import Unit, discover
from tasks.refs import ModelRef

log = logging.getLogger(__name__)


def wants_cluster(runtime: RuntimeSettings, method: str) -> bool:
    """True when `runtime` asks for workers and `method` sums over the calibration set (others score here)."""
    asked = runtime.scoring_workers > 1 or runtime.scoring_cluster is not None
    if asked and method not in importance.SHARDABLE_METHODS:
        log.warning("method %s does not split over calibration shards; scoring it in this process", method)
    return asked and method in importance.SHARDABLE_METHODS


def shards(items: Sequence[Any], n: int) -> list[list[Any]]:
    """`items` cut into at most `n` contiguous, non-empty shards whose sizes differ by at most one."""
    n = max(1, min(n, len(items)))
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        out.append(list(items[start:stop]))
        start = stop
    return out


@contextmanager
def dask_client(runtime: RuntimeSettings):  # noqa: ANN201 - distributed.Client
    """A client of `runtime.scoring_cluster`, or of a local cluster of `scoring_workers` single-threaded processes."""
    from distributed import Client, LocalCluster

    if runtime.scoring_cluster:
        with Client(runtime.scoring_cluster, timeout="30s") as client:
            yield client
        return
    env = {"OMP_NUM_THREADS": str(runtime.scoring_threads), "MKL_NUM_THREADS": str(runtime.scoring_threads)}
    with LocalCluster(n_workers=runtime.scoring_workers, threads_per_worker=1, processes=True,
                      host="127.0.0.1", dashboard_address=None, env=env,
                      silence_logs=logging.WARNING) as cluster, Client(cluster) as client:
        yield client


def score_on_cluster(model: ModelRef, pairs: Sequence[tuple[str, str]], spec: StepSpec, options: ScoringOptions,
                     runtime: RuntimeSettings, client: Any = None) -> tuple[list[Unit], list[float]]:
    """`pip_core.schedule.score_step`'s result, computed over the cluster's workers (one shard of pairs each)."""
    if client is None:
        with dask_client(runtime) as own:
            return score_on_cluster(model, pairs, spec, options, runtime, own)
    n_workers = len(client.scheduler_info()["workers"]) or runtime.scoring_workers
    parts = shards(list(pairs), n_workers)
    log.info("scoring %d pairs on %d Dask workers (%s)", len(pairs), len(parts),
             ", ".join(str(len(p)) for p in parts))
    futures = [client.submit(score_shard, model.model_dump(mode="json"), shard, spec.seed, options,
                             runtime.model_dump(mode="json"), i, pure=False) for i, shard in enumerate(parts)]
    results = client.gather(futures)
    unit_lists = [tuple(units) for units, _, _ in results]
    if any(u != unit_lists[0] for u in unit_lists):
        raise PipCoreError("workers found different units on the same model; check they run the same code")
    scores = importance.reduce_sums([(sums, count) for _, sums, count in results])
    return list(unit_lists[0]), [float(x) for x in scores.tolist()]


def score_shard(model_json: dict, pairs: list[tuple[str, str]], seed: int, options: ScoringOptions,
                runtime_json: dict, index: int) -> tuple[list[Unit], Any, int]:
    """On a worker: (units, per-unit sums, count) of one shard. The model is loaded once per worker process."""
    import torch

    from tasks.models import load_model

    runtime = RuntimeSettings(**runtime_json)
    threads = int(os.environ.get("OMP_NUM_THREADS", runtime.scoring_threads))
    torch.set_num_threads(threads)
    if runtime.device == "auto" and torch.cuda.device_count() > 1:  # a multi-GPU node: one GPU per worker
        runtime = runtime.model_copy(update={"device": f"cuda:{index % torch.cuda.device_count()}"})
    net, tokenizer = load_model(ModelRef(**model_json), runtime, seq_len=options.max_length)
    units = discover(net, options.kind)
    data = importance.CalibrationData(tokenizer, pairs, texts=[original for original, _ in pairs])
    sums, count = importance.score_sums(net, options.method, units, data, seed=seed, max_length=options.max_length,
                                        progress=False, gradient_checkpointing=options.gradient_checkpointing)
    return units, sums.cpu(), count
