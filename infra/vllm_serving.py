"""Serving speed with vLLM (optional extra `pipprune[vllm]`, GPU only): what production would see.

Same figures as `pip_core.serving.measure` (prefill as a one-token generate, decode as the extra
tokens over the extra time), on the same token ids. Imported only when vLLM is installed and CUDA
is present (`available()`).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path

from pip_core.serving import BatchStats, ServingStats, _percentile


def available() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def measure(model_dir: Path, prompts: list[list[int]], *, new_tokens: int, batch_sizes: list[int], repeats: int,
            matmul_params: int, dtype: str = "auto") -> ServingStats:
    """Greedy generation of exactly `new_tokens` per prompt through a vLLM engine on `model_dir`."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLM(model=str(model_dir), dtype=dtype, gpu_memory_utilization=0.45, enforce_eager=False,
                 max_model_len=len(prompts[0]) + new_tokens + 8)

    def run(batch: int, n: int) -> float:
        rows = [TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]) for i in range(batch)]
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        engine.generate(rows, params, use_tqdm=False)
        return time.perf_counter() - start

    out = []
    torch.cuda.reset_peak_memory_stats()
    for batch in batch_sizes:
        run(batch, new_tokens)
        first = [run(batch, 1) for _ in range(repeats)]
        full = [run(batch, new_tokens) for _ in range(repeats)]
        t1, tn = statistics.median(first), statistics.median(full)
        out.append(BatchStats(batch=batch, prefill_tokens_per_s=batch * len(prompts[0]) / t1,
                              decode_tokens_per_s=batch * (new_tokens - 1) / max(tn - t1, 1e-9),
                              latency_p50_s=_percentile(full, 50), latency_p95_s=_percentile(full, 95)))
    peak = int(torch.cuda.max_memory_allocated())
    return ServingStats(backend="vllm", device="cuda", prompt_tokens=len(prompts[0]), new_tokens=new_tokens,
                        batches=tuple(out), peak_memory_bytes=peak, matmul_params=matmul_params)
