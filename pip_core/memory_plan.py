"""Memory each stage of a compress run needs, computed from a model config alone (no weights loaded).

Parameters are counted on the model built on the meta device, so every family is counted by
its own code, with no per-family arithmetic here.

Lets `pipprune plan` answer "will this fit?" for a 70B model before anything is downloaded, and
lets compress refuse up front with the figure instead of dying mid-run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers

from pip_core.chunked_loss import chunk_tokens_for

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def meta_model(config: Any) -> torch.nn.Module:
    """The model `config` describes, built on the meta device (no memory, no weights).

    A dict (config.json) or a config object; per-layer-pruned `pipprune_*` types use their own
    classes. Raises UnsupportedArchitectureError for a family without a row, and for a model
    whose modules do not match its row (unknown layer layout).
    """
    from pip_core import families, modeling_pipprune
    from pip_core.errors import UnsupportedArchitectureError
    from pip_core.units import check_layout

    model_type = _get(config, "model_type")
    try:
        family = families.family_for(model_type)
    except families.UnsupportedFamilyError as exc:
        raise UnsupportedArchitectureError(str(exc)) from None
    if str(model_type).startswith(families.PRUNED_PREFIX):
        config_cls, model_cls = modeling_pipprune.PRUNED_CLASSES[family.model_type]
    else:
        config_cls = getattr(transformers, family.config_class)
        model_cls = getattr(transformers, family.model_class)
    if isinstance(config, dict):
        config = config_cls.from_dict({k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = model_cls(config)
    check_layout(model)
    return model


def param_count_from_config(config: Any) -> int:
    """Exact parameter count of the model `config` describes (tied weights once), from its meta build."""
    model = meta_model(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


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
                gradient_checkpointing: bool = False, chunk_tokens: int | None = None) -> MemoryPlan:
    """Estimate memory for weights, the largest live gradient, activations and logits.

    `batch` counts sequences per forward: PIP puts both views of a pair in one batch (2).
    Gradients are reduced per parameter as they arrive, so at most one parameter's gradient
    (the largest, usually the embedding) is alive; activations follow the standard transformer
    estimate s*b*h*(34 + 5*a*s/h) bytes per layer at 16-bit, scaled for fp32. Logits exist one
    slice of `chunk_tokens` positions at a time (pip_core.chunked_loss), never for the whole sequence.
    The slice's float32 logits are bounded by the same byte budget the loss uses.
    """
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_BYTES)}")
    width = _DTYPE_BYTES[dtype]
    model = meta_model(config)
    params = {id(p): p for p in model.parameters()}.values()
    n = sum(p.numel() for p in params)
    hidden = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    vocab = int(_get(config, "vocab_size"))
    weights = n * width
    grads = max(p.numel() for p in params) * width
    per_layer = layer_activations(config, dtype, batch, seq_len)
    if gradient_checkpointing:
        activations = layers * seq_len * batch * hidden * width + per_layer
    else:
        activations = layers * per_layer
    chunk = min(seq_len, chunk_tokens or chunk_tokens_for(vocab, batch, vocab * hidden * width))
    logits = 3 * batch * chunk * vocab * 4  # one slice: fp32 logits, log-softmax and its gradient
    peak_scoring = weights + grads + activations + logits
    peak_eval = weights + batch * chunk * vocab * 4 + per_layer // 4
    return MemoryPlan(num_params=n, dtype=dtype, weights=weights, gradients_peak=grads, activations=activations,
                      logits=logits, peak_scoring=peak_scoring, peak_eval=peak_eval,
                      gradient_checkpointing=gradient_checkpointing)


def layer_activations(config: Any, dtype: str = "float32", batch: int = 2, seq_len: int = 128) -> int:
    """Bytes one layer stores for backward: the standard transformer estimate s*b*h*(34 + 5*a*s/h) at 16-bit,
    scaled to `dtype` (it counts dropout masks and attention scores, which SDPA training does not keep)."""
    hidden = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    return int(seq_len * batch * hidden * (34 + 5 * heads * seq_len / hidden) * _DTYPE_BYTES[dtype] / 2)


def training_layer_activations(config: Any, dtype: str = "float32", batch: int = 8, seq_len: int = 128) -> int:
    """Bytes one gated-MLP decoder layer keeps for backward with SDPA attention, counted from its widths.

    Per token of a padded batch: 3 hidden-wide tensors (the norms), 5 query-wide (queries, keys and
    values widened to every query head, the attention output and its reshaped copy), the mask's
    row and 4 MLP-wide (gate, its activation, up, their product); no [s x s] attention scores.
    Measured with saved-tensor hooks on SmolLM2-135M at 8 x 128 with LoRA on every linear: 42.8 MB
    per layer dense (this count: 44.6), 34.3 MB width-pruned by 0.2 (34.9); the transformer
    estimate (`layer_activations`) says 52 and 48.
    """
    hidden = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    head_dim = int(_get(config, "head_dim", None) or hidden // heads)
    per_token = 3 * hidden + 5 * heads * head_dim + seq_len + 4 * int(_get(config, "intermediate_size"))
    return batch * seq_len * per_token * _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class TrainingPlan:
    """What a recovery's training adds to the weights in hand (bytes), and how many layers it must checkpoint.

    A checkpointed layer keeps only its input and rebuilds the rest in backward (one layer's worth
    alive at a time), so checkpointing `k` of the layers trades k layers' forward for their memory:
    the fewest layers that fit are checkpointed (the first ones, `pip_core.recompute`), not all or
    nothing.
    """

    layers: int
    #: one layer's stored activations, and what a checkpointed layer keeps instead (its input)
    layer: int
    checkpointed_layer: int
    #: the trained parameters: values, gradients and AdamW's two moments
    optimizer: int
    #: the loss's slice at its peak (logits, log-probabilities and their gradient)
    loss_slice: int

    def peak(self, checkpointed: int) -> int:
        """Bytes on top of the weights with the first `checkpointed` layers checkpointed.

        Backward reaches the first layers last, when the others' activations are freed: a rebuilt
        layer then sits beside the checkpointed inputs only, not beside everything stored.
        """
        inputs = checkpointed * self.checkpointed_layer
        stored = max((self.layers - checkpointed) * self.layer, self.layer if checkpointed else 0) + inputs
        return stored + self.optimizer + self.loss_slice

    def layers_to_checkpoint(self, headroom: int) -> int | None:
        """The fewest layers to checkpoint for the training to fit in `headroom` bytes; None when all do not."""
        return next((k for k in range(self.layers + 1) if self.peak(k) <= headroom), None)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def plan_training(config: Any, dtype: str = "float32", batch: int = 8, seq_len: int = 128, trained_params: int = 0,
                  chunk_tokens: int | None = None, slice_tensors: int = 7) -> TrainingPlan:
    """The training plan of a recovery at `batch` x `seq_len` that trains `trained_params` parameters.

    The loss runs over slices of `chunk_tokens` positions (default: the distillation loss's own
    choice for two models' rows, pip_core.distill); a slice holds about `slice_tensors` float32
    [batch x chunk x vocab] tensors at its peak (both models' log-probabilities, their difference,
    the student's gradient).
    """
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_BYTES)}")
    width = _DTYPE_BYTES[dtype]
    hidden, vocab = int(_get(config, "hidden_size")), int(_get(config, "vocab_size"))
    chunk = min(seq_len, chunk_tokens or chunk_tokens_for(vocab, 2 * batch, vocab * hidden * width))
    return TrainingPlan(layers=int(_get(config, "num_hidden_layers")),
                        layer=training_layer_activations(config, dtype, batch, seq_len),
                        checkpointed_layer=batch * seq_len * hidden * width, optimizer=4 * trained_params * 4,
                        loss_slice=slice_tensors * batch * chunk * vocab * 4)


def available_bytes(device: str | torch.device = "cpu") -> int:
    """Free memory on `device` now (GPU: free device memory; CPU: available system memory)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)
