"""Memory each stage of a compress run needs, computed from a model config alone (no weights loaded).

Lets `pipprune plan` answer "will this fit?" for a 70B model before anything is downloaded, and
lets compress refuse up front with the figure instead of dying mid-run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def param_count_from_config(config: Any) -> int:
    """Exact parameter count of a Llama/Mistral/Qwen2-layout decoder described by `config`."""
    hidden = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads") or heads)
    head_dim = int(_get(config, "head_dim") or hidden // heads)
    inter = int(_get(config, "intermediate_size"))
    vocab = int(_get(config, "vocab_size"))
    tied = bool(_get(config, "tie_word_embeddings", False))
    model_type = _get(config, "model_type", "llama")
    qkv_bias = model_type == "qwen2" or bool(_get(config, "attention_bias", False))
    mlp_bias = bool(_get(config, "mlp_bias", False))
    attn = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    if qkv_bias:
        attn += head_dim * (heads + 2 * kv_heads) + (hidden if model_type != "qwen2" else 0)
    mlp = 3 * hidden * inter + ((2 * inter + hidden) if mlp_bias else 0)
    per_layer = attn + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * per_layer + embeddings + hidden


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per stage; `peak_scoring` is what must fit on one device for PIP scoring."""

    num_params: int
    dtype: str
    weights: int
    gradients_peak: int
    activations: int
    logits: int
    peak_scoring: int
    peak_eval: int
    gradient_checkpointing: bool

    def as_dict(self) -> dict[str, int | str | bool]:
        return asdict(self)


def plan_memory(config: Any, dtype: str = "float32", batch: int = 2, seq_len: int = 128,
                gradient_checkpointing: bool = False) -> MemoryPlan:
    """Estimate memory for weights, the largest live gradient, activations and logits.

    `batch` counts sequences per forward: PIP puts both views of a pair in one batch (2).
    Gradients are reduced per parameter as they arrive, so at most one parameter's gradient
    (the largest, usually the embedding) is alive; activations follow the standard transformer
    estimate s*b*h*(34 + 5*a*s/h) bytes per layer at 16-bit, scaled for fp32.
    """
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_BYTES)}")
    width = _DTYPE_BYTES[dtype]
    n = param_count_from_config(config)
    hidden = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    heads = int(_get(config, "num_attention_heads"))
    inter = int(_get(config, "intermediate_size"))
    vocab = int(_get(config, "vocab_size"))
    weights = n * width
    largest = max(vocab * hidden, hidden * inter)
    grads = largest * width
    scale = width / 2
    per_layer = int(seq_len * batch * hidden * (34 + 5 * heads * seq_len / hidden) * scale)
    if gradient_checkpointing:
        activations = layers * seq_len * batch * hidden * width + per_layer
    else:
        activations = layers * per_layer
    logits = 3 * batch * seq_len * vocab * 4  # fp32 logits, log-softmax and its gradient
    peak_scoring = weights + grads + activations + logits
    peak_eval = weights + batch * seq_len * vocab * 4 + per_layer // 4
    return MemoryPlan(num_params=n, dtype=dtype, weights=weights, gradients_peak=grads, activations=activations,
                      logits=logits, peak_scoring=peak_scoring, peak_eval=peak_eval,
                      gradient_checkpointing=gradient_checkpointing)


def available_bytes(device: str | torch.device = "cpu") -> int:
    """Free memory on `device` now (GPU: free device memory; CPU: available system memory)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)
