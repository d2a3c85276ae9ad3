"""Llama-layout models whose layers have their own widths (heads, KV groups, MLP channels).

This file is copied next to the weights of every per-layer-pruned model (`auto_map`), so it must
import only torch and transformers. pipprune itself registers these classes in-process and never
needs `trust_remote_code`; other tools (lm-eval, plain `from_pretrained`) load it with
`trust_remote_code=True`.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)


def _check_widths(config) -> None:  # noqa: ANN001
    widths = config.layer_widths
    if widths is None:
        return
    if len(widths) != config.num_hidden_layers:
        raise ValueError(f"layer_widths lists {len(widths)} layers, num_hidden_layers is {config.num_hidden_layers}")
    for i, w in enumerate(widths):
        heads, kv = int(w["num_attention_heads"]), int(w["num_key_value_heads"])
        if kv < 1 or heads % kv or heads // kv != config.num_attention_heads // config.num_key_value_heads:
            raise ValueError(f"layer {i}: {heads} heads / {kv} KV heads break the model's GQA ratio")
        if int(w["intermediate_size"]) < 1:
            raise ValueError(f"layer {i}: intermediate_size must be >= 1")


def _apply_widths(model: nn.Module, config) -> None:  # noqa: ANN001
    """Replace each layer's projections by ones of that layer's width (weights load afterwards)."""
    if config.layer_widths is None:
        return
    for layer, w in zip(model.model.layers, config.layer_widths):
        attn, mlp = layer.self_attn, layer.mlp
        hidden, head_dim = attn.q_proj.in_features, attn.head_dim
        q_out, kv_out = int(w["num_attention_heads"]) * head_dim, int(w["num_key_value_heads"]) * head_dim
        inter = int(w["intermediate_size"])
        attn.q_proj = nn.Linear(hidden, q_out, bias=attn.q_proj.bias is not None)
        attn.k_proj = nn.Linear(hidden, kv_out, bias=attn.k_proj.bias is not None)
        attn.v_proj = nn.Linear(hidden, kv_out, bias=attn.v_proj.bias is not None)
        attn.o_proj = nn.Linear(q_out, hidden, bias=attn.o_proj.bias is not None)
        mlp.gate_proj = nn.Linear(hidden, inter, bias=mlp.gate_proj.bias is not None)
        mlp.up_proj = nn.Linear(hidden, inter, bias=mlp.up_proj.bias is not None)
        mlp.down_proj = nn.Linear(inter, hidden, bias=mlp.down_proj.bias is not None)


@strict
class PipprunedLlamaConfig(LlamaConfig):
    model_type = "pipprune_llama"
    layer_widths: list | None = None

    def validate_architecture(self) -> None:
        _check_widths(self)


@strict
class PipprunedMistralConfig(MistralConfig):
    model_type = "pipprune_mistral"
    layer_widths: list | None = None

    def validate_architecture(self) -> None:
        _check_widths(self)


@strict
class PipprunedQwen2Config(Qwen2Config):
    model_type = "pipprune_qwen2"
    layer_widths: list | None = None
    #: stock Qwen2 derives head size from hidden/heads, which pruning heads would change
    head_dim: int | None = None

    def validate_architecture(self) -> None:
        _check_widths(self)


class PipprunedLlamaForCausalLM(LlamaForCausalLM):
    config_class = PipprunedLlamaConfig

    def __init__(self, config: PipprunedLlamaConfig) -> None:
        super().__init__(config)
        _apply_widths(self, config)


class PipprunedMistralForCausalLM(MistralForCausalLM):
    config_class = PipprunedMistralConfig

    def __init__(self, config: PipprunedMistralConfig) -> None:
        super().__init__(config)
        _apply_widths(self, config)


class PipprunedQwen2ForCausalLM(Qwen2ForCausalLM):
    config_class = PipprunedQwen2Config

    def __init__(self, config: PipprunedQwen2Config) -> None:
        super().__init__(config)
        _apply_widths(self, config)


#: base model_type -> (config class, model class) for per-layer widths
PRUNED_CLASSES = {
    "llama": (PipprunedLlamaConfig, PipprunedLlamaForCausalLM),
    "mistral": (PipprunedMistralConfig, PipprunedMistralForCausalLM),
    "qwen2": (PipprunedQwen2Config, PipprunedQwen2ForCausalLM),
}
