"""Structural units of Llama-layout decoders: whole blocks, GQA attention groups, MLP channels.

Shapes are read from the modules themselves, never from the config, because after pruning each
layer may have its own width. A unit's `num_params` is exactly what removing it takes away.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pip_core.errors import PipCoreError, UnsupportedArchitectureError
from pip_core.vocabulary import KINDS, UnitKind

#: model_type values whose decoder layers have the Llama layout (q/k/v/o + gate/up/down)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "pipprune_llama", "pipprune_mistral", "pipprune_qwen2")


@dataclass(frozen=True)
class Unit:
    """One removable piece: `index` is the KV group (attn) or channel (mlp); None for a block."""

    kind: UnitKind
    layer: int
    index: int | None
    num_params: int


@dataclass(frozen=True)
class LayerShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def check_supported(model: nn.Module) -> None:
    """Raise unless `model` is a Llama-layout causal LM on a real device."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not hasattr(getattr(model, "model", None), "layers"):
        raise UnsupportedArchitectureError(
            f"unsupported architecture {type(model).__name__} (model_type={model_type!r}); "
            f"pipprune prunes Llama-layout decoders: {', '.join(SUPPORTED_MODEL_TYPES[:3])}")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise PipCoreError(f"{type(model).__name__} has weights on the meta device; load real weights first")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def layer_shape(layer: nn.Module) -> LayerShape:
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = int(attn.head_dim)
    return LayerShape(num_heads=attn.q_proj.out_features // head_dim,
                      num_kv_heads=attn.k_proj.out_features // head_dim,
                      head_dim=head_dim, intermediate=mlp.gate_proj.out_features)


def _bias_numel(linear: nn.Linear) -> int:
    return 0 if linear.bias is None else 1


def attn_group_params(layer: nn.Module) -> int:
    """Parameters one GQA group owns: its query heads, its K and V head, their o_proj columns."""
    s = layer_shape(layer)
    attn = layer.self_attn
    hidden = attn.q_proj.in_features
    rows_q = s.group_size * s.head_dim
    n = rows_q * hidden + rows_q * _bias_numel(attn.q_proj)
    n += 2 * (s.head_dim * hidden)
    n += s.head_dim * (_bias_numel(attn.k_proj) + _bias_numel(attn.v_proj))
    n += rows_q * attn.o_proj.out_features
    return n


def mlp_channel_params(layer: nn.Module) -> int:
    """Parameters one intermediate channel owns: a gate row, an up row, a down column."""
    mlp = layer.mlp
    hidden = mlp.gate_proj.in_features
    return 2 * hidden + mlp.down_proj.out_features + _bias_numel(mlp.gate_proj) + _bias_numel(mlp.up_proj)


def block_params(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def discover(model: nn.Module, kind: str) -> list[Unit]:
    """All units of `kind` ('block', 'attn', 'mlp' or 'width' = attn + mlp) in layer order."""
    if kind not in KINDS:
        raise PipCoreError(f"unknown unit kind {kind!r}; use one of {sorted(KINDS)}")
    check_supported(model)
    found: list[Unit] = []
    for i, layer in enumerate(decoder_layers(model)):
        for k in KINDS[kind]:
            if k == "block":
                found.append(Unit("block", i, None, block_params(layer)))
            elif k == "attn":
                n = attn_group_params(layer)
                found.extend(Unit("attn", i, g, n) for g in range(layer_shape(layer).num_kv_heads))
            else:
                n = mlp_channel_params(layer)
                found.extend(Unit("mlp", i, c, n) for c in range(layer_shape(layer).intermediate))
    return found


def param_count(model: nn.Module) -> int:
    """Parameters counted once even when tied (embeddings shared with the LM head)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def unit_slices(layer: nn.Module, unit: Unit) -> list[tuple[torch.Tensor, int, slice]]:
    """(tensor, dim, slice) triples covering exactly the weights `unit` owns in `layer`."""
    if unit.kind == "block":
        return [(p, 0, slice(None)) for p in layer.parameters()]
    if unit.kind == "attn":
        s = layer_shape(layer)
        attn = layer.self_attn
        q = slice(unit.index * s.group_size * s.head_dim, (unit.index + 1) * s.group_size * s.head_dim)
        kv = slice(unit.index * s.head_dim, (unit.index + 1) * s.head_dim)
        out = [(attn.q_proj.weight, 0, q), (attn.k_proj.weight, 0, kv), (attn.v_proj.weight, 0, kv),
               (attn.o_proj.weight, 1, q)]
        for proj, rows in ((attn.q_proj, q), (attn.k_proj, kv), (attn.v_proj, kv)):
            if proj.bias is not None:
                out.append((proj.bias, 0, rows))
        return out
    mlp = layer.mlp
    c = slice(unit.index, unit.index + 1)
    out = [(mlp.gate_proj.weight, 0, c), (mlp.up_proj.weight, 0, c), (mlp.down_proj.weight, 1, c)]
    out += [(p.bias, 0, c) for p in (mlp.gate_proj, mlp.up_proj) if p.bias is not None]
    return out
