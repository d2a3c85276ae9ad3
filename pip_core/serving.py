"""Serving speed of one model with transformers: prefill and decode tokens/s, latency, memory.

Dense and pruned are measured by the same function on the same token ids, so the speedup compares
like with like. Decoding is greedy with the model's own KV cache and EOS ignored, so every run
produces exactly N tokens; prefill (the prompt up to the first token) and decode (the N - 1 steps
after it) are timed separately and directly, as a server's time to first token and time per
output token are.

The ideal speedup is 1 / (1 - FLOP cut), where the cut is that of the matmul weights a decoded
token multiplies through (every nn.Linear, the LM head included; the embedding is a lookup).
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BatchStats:
    batch: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    latency_p50_s: float
    latency_p95_s: float


@dataclass(frozen=True)
class ServingStats:
    """One model's figures; `peak_memory_bytes` is the CUDA allocator's peak, on CPU weights + KV cache + logits."""

    backend: str
    device: str
    prompt_tokens: int
    new_tokens: int
    batches: tuple[BatchStats, ...]
    peak_memory_bytes: int
    matmul_params: int

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ServingStats:
        """The inverse of `as_dict` (figures measured earlier in the run, passed on as JSON)."""
        return cls(**{**data, "batches": tuple(BatchStats(**b) for b in data["batches"])})


def matmul_params(model: nn.Module) -> int:
    """Weights a decoded token multiplies through: every Linear (a tied LM head counts: it is a matmul)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def prompt_ids(tokenizer, texts: Sequence[str], count: int, length: int) -> torch.Tensor:  # noqa: ANN001
    """`count` prompts of exactly `length` tokens from `texts` (cycled; a short text is repeated to length)."""
    if not texts:
        raise ValueError("no prompt texts to measure serving speed with")
    rows = []
    for i in range(count):
        ids = tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id or 0]
        while len(ids) < length:
            ids = ids + ids
        rows.append(ids[:length])
    return torch.tensor(rows, dtype=torch.long)


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_timed(model: nn.Module, ids: torch.Tensor, new_tokens: int,
                 keep_one: bool = False) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, decode seconds, generated ids) of greedy decoding `new_tokens` with the KV cache.

    Timed step by step, as a server sees it: the prompt's forward pass up to the first token, then
    `new_tokens - 1` one-token steps. Both are measured directly, so neither can come out negative
    on a noisy machine (a difference of two end-to-end generate timings can).
    """
    device = ids.device
    mask = torch.ones_like(ids)
    extra = {"logits_to_keep": 1} if keep_one else {}
    cache = _cache_name(model)
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **extra)
    token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    prefilled = time.perf_counter()
    past, tokens = getattr(out, cache), [token]
    for _ in range(new_tokens - 1):
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        out = model(input_ids=token, attention_mask=mask, use_cache=True, **{cache: past})
        token, past = out.logits[:, -1:].argmax(-1), getattr(out, cache)
        tokens.append(token)
    _sync(device)
    return prefilled - start, time.perf_counter() - prefilled, torch.cat(tokens, dim=1)


def _cache_name(model: nn.Module) -> str:
    """The KV-cache argument and output field: `cache` in transformers >= 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def measure(model: nn.Module, tokenizer, prompts: torch.Tensor, *, new_tokens: int, batch_sizes: Sequence[int],  # noqa: ANN001
            repeats: int = 3) -> ServingStats:
    """Time greedy decoding of `new_tokens` on `prompts` (rows of token ids) at each batch size."""
    del tokenizer  # the prompts are token ids already; kept for the backends' common signature
    device = next(model.parameters()).device
    keep_one = "logits_to_keep" in inspect.signature(model.forward).parameters
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.eval()
    out, cpu_peak = [], 0
    for batch in batch_sizes:
        ids = prompts.repeat((batch + len(prompts) - 1) // len(prompts), 1)[:batch].to(device)
        greedy_timed(model, ids, new_tokens, keep_one)  # warm-up
        timings = [greedy_timed(model, ids, new_tokens, keep_one)[:2] for _ in range(repeats)]
        prefill = statistics.median(t[0] for t in timings)
        decode = statistics.median(t[1] for t in timings)
        latencies = [a + b for a, b in timings]
        out.append(BatchStats(batch=batch, prefill_tokens_per_s=batch * ids.shape[1] / prefill,
                              decode_tokens_per_s=batch * (new_tokens - 1) / decode,
                              latency_p50_s=_percentile(latencies, 50), latency_p95_s=_percentile(latencies, 95)))
        if device.type != "cuda":
            cpu_peak = max(cpu_peak, _cpu_footprint(model, batch, ids.shape[1] + new_tokens))
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else cpu_peak
    return ServingStats(backend="transformers", device=str(device), prompt_tokens=int(prompts.shape[1]),
                        new_tokens=new_tokens, batches=tuple(out), peak_memory_bytes=peak,
                        matmul_params=matmul_params(model))


def _cpu_footprint(model: nn.Module, batch: int, tokens: int) -> int:
    """Weights + the KV cache at `tokens` + one step's logits, in bytes, from the model's own modules."""
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    width = next(iter(params)).element_size()
    kv = 0
    for module in model.modules():
        k_proj = getattr(module, "k_proj", None)
        if isinstance(k_proj, nn.Linear):
            kv += 2 * k_proj.out_features * tokens * batch * width
        qkv = getattr(module, "qkv_proj", None)
        if isinstance(qkv, nn.Linear) and hasattr(module, "num_key_value_heads"):
            kv += 2 * module.num_key_value_heads * module.head_dim * tokens * batch * width
    vocab = model.get_output_embeddings().weight.shape[0]
    return weights + kv + batch * vocab * 4


@dataclass(frozen=True)
class Comparison:
    """Dense against pruned: the flow logs these as `serving.*` metrics and version tags."""

    decode_speedup: float
    ideal_speedup: float
    fraction_of_ideal: float
    flop_cut: float
    per_batch: dict[int, float]

    def metrics(self) -> dict[str, float]:
        return {"serving.decode_speedup": self.decode_speedup, "serving.ideal_speedup": self.ideal_speedup,
                "serving.fraction_of_ideal": self.fraction_of_ideal, "serving.flop_cut": self.flop_cut,
                **{f"serving.decode_speedup.b{b}": s for b, s in self.per_batch.items()}}


def compare(dense: ServingStats, pruned: ServingStats) -> Comparison:
    """Decode speedup at each batch size (headline: the smallest batch, where decode is weight-bound) vs the ideal."""
    per_batch = {p.batch: p.decode_tokens_per_s / d.decode_tokens_per_s
                 for d, p in zip(dense.batches, pruned.batches, strict=True)}
    headline = per_batch[min(per_batch)]
    cut = 1.0 - pruned.matmul_params / dense.matmul_params
    ideal = 1.0 / (1.0 - cut)
    return Comparison(decode_speedup=headline, ideal_speedup=ideal, fraction_of_ideal=headline / ideal, flop_cut=cut,
                      per_batch=per_batch)


def stats_metrics(prefix: str, stats: ServingStats) -> dict[str, float]:
    """One model's figures as flat metric names: `<prefix>.b<batch>.decode_tokens_per_s`, ..."""
    out = {f"{prefix}.peak_memory_bytes": float(stats.peak_memory_bytes)}
    for b in stats.batches:
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s", "latency_p50_s", "latency_p95_s"):
            out[f"{prefix}.b{b.batch}.{name}"] = float(getattr(b, name))
    return out
