"""bf16 matrix products for an fp32 model on a CPU that computes bf16 natively (avx512_bf16, AMX).

Forward-only work on such a CPU (the general held-out set, quick evaluation) runs 1.45-1.7x faster under bf16
autocast, with fp32 accumulation and fp32 weights kept: on SmolLM2-135M the general-set perplexity ratio of a
pruned model was 1.8738 in fp32 and 1.8734 under autocast (30,117 tokens). A decode loop is another matter:
autocast casts every weight at every step, and the KV cache (fp32 once the rotary embedding has promoted the keys)
at every step too; there `cpu_bf16_weights` runs the model on bf16 copies of its weights, with a bf16 cache.
Where the CPU lacks native bf16 (emulated, slower) or the model is not fp32 on a CPU, nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def native_cpu_bf16(model: nn.Module) -> bool:
    """Whether `model` is fp32 on a CPU with native bf16 matrix products."""
    weight = next(model.parameters())
    return native_for(weight.device.type, weight.dtype)


def native_for(device_type: str, dtype: torch.dtype) -> bool:
    """`native_cpu_bf16` of a model placed on `device_type` in `dtype`, before it is read."""
    return device_type == "cpu" and dtype == torch.float32 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_bf16_autocast(model: nn.Module, wanted: bool = True) -> torch.autocast:
    """bf16 autocast where `wanted` and it pays (`native_cpu_bf16`), else a disabled one."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=wanted and native_cpu_bf16(model))


@contextmanager
def cpu_bf16_weights(model: nn.Module, wanted: bool = True) -> Iterator[bool]:
    """Within: `model`'s fp32 parameters hold bf16 copies of their values, where `wanted` and it pays
    (`native_cpu_bf16`); after: the very fp32 tensors they held before, whatever happened within. Yields whether
    the weights were swapped. For forward-only work (no optimizer holds the parameters); shared (tied) parameters
    are one parameter and get one copy. Costs half the fp32 weights' memory while it lasts."""
    if not (wanted and native_cpu_bf16(model)):
        yield False
        return
    kept = [(p, p.data) for p in model.parameters() if p.dtype == torch.float32]
    try:
        for p, data in kept:
            p.data = data.to(torch.bfloat16)
        yield True
    finally:
        for p, data in kept:
            p.data = data


def precision_name(device_type: str, dtype: torch.dtype, wanted: bool = True) -> str:
    """What `cpu_bf16_autocast` computes in for a model on `device_type` in `dtype`, for records and cache keys."""
    return "bf16 autocast" if wanted and native_for(device_type, dtype) else str(dtype).removeprefix("torch.")


def weights_precision_name(device_type: str, dtype: torch.dtype, wanted: bool = True) -> str:
    """What `cpu_bf16_weights` computes in for a model on `device_type` in `dtype`, for records and cache keys."""
    return "bf16 weights" if wanted and native_for(device_type, dtype) else str(dtype).removeprefix("torch.")
