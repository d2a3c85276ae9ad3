"""Choose units to remove and remove them physically: smaller matrices, fewer heads or layers.

No masks: the pruned model is smaller and faster, and saves as ordinary weights.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from pip_core.errors import PruneError
from pip_core.units import Unit, check_supported, decoder_layers, layer_shape, param_count


@dataclass
class PruneReport:
    params_before: int
    params_after: int
    removed: list[Unit] = field(default_factory=list)

    @property
    def params_removed(self) -> int:
        return self.params_before - self.params_after


def select(units: Sequence[Unit], scores: Sequence[float] | torch.Tensor, target_params: int,
           protect_first: int = 1, protect_last: int = 1) -> list[Unit]:
    """Lowest-scoring units first until `target_params` are covered (overshoot < one unit).

    Kinds are ranked separately and each gets a share of the target proportional to its
    prunable parameters, because scores of a whole attention group and of a single MLP channel
    are not on one scale. The first/last `protect_*` layers are never touched, and every layer
    keeps at least one attention group, one MLP channel, and the model at least one block.
    """
    scores = [float(s) for s in (scores.tolist() if isinstance(scores, torch.Tensor) else scores)]
    if len(scores) != len(units):
        raise PruneError(f"{len(scores)} scores for {len(units)} units")
    if target_params <= 0:
        return []
    num_layers = 1 + max(u.layer for u in units)
    protected = set(range(min(protect_first, num_layers))) | set(range(max(0, num_layers - protect_last), num_layers))
    per_layer_count: dict[tuple[str, int], int] = defaultdict(int)
    for u in units:
        per_layer_count[(u.kind, u.layer)] += 1
    candidates: dict[str, list[tuple[float, Unit]]] = defaultdict(list)
    for u, s in zip(units, scores):
        if u.layer not in protected:
            candidates[u.kind].append((s, u))
    prunable = {k: sum(u.num_params for _, u in v) for k, v in candidates.items()}
    total_prunable = sum(prunable.values())
    if total_prunable < target_params:
        raise PruneError(f"cannot remove {target_params:,} parameters: only {total_prunable:,} are in prunable units "
                         f"(protect_first={protect_first}, protect_last={protect_last}); lower the ratio")
    chosen: list[Unit] = []
    remaining = target_params
    kinds = sorted(candidates, key=lambda k: prunable[k])
    for n, kind in enumerate(kinds):
        share = remaining if n == len(kinds) - 1 else round(target_params * prunable[kind] / total_prunable)
        got = 0
        left = dict(per_layer_count)
        blocks_left = sum(1 for u in units if u.kind == "block")
        for _, u in sorted(candidates[kind], key=lambda t: (t[0], t[1].layer, t[1].index or 0)):
            if got >= share:
                break
            if kind == "block":
                if blocks_left <= 1:
                    continue
                blocks_left -= 1
            elif left[(kind, u.layer)] <= 1:
                continue
            left[(kind, u.layer)] -= 1
            chosen.append(u)
            got += u.num_params
        remaining -= got
    if sum(u.num_params for u in chosen) < target_params - max(u.num_params for u in units):
        raise PruneError(f"could only select {sum(u.num_params for u in chosen):,} of {target_params:,} parameters "
                         "without emptying a layer; lower the ratio or change the unit kind")
    return chosen


def _keep_linear(linear: nn.Linear, dim: int, keep: torch.Tensor) -> nn.Linear:
    """A new Linear keeping rows (dim 0, also the bias) or columns (dim 1) listed in `keep`."""
    weight = linear.weight.data.index_select(dim, keep.to(linear.weight.device))
    bias = linear.bias
    if bias is not None and dim == 0:
        bias = bias.data.index_select(0, keep.to(bias.device))
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    new.weight.data.copy_(weight)
    if bias is not None:
        new.bias.data.copy_(bias.data if isinstance(bias, nn.Parameter) else bias)
    new.weight.requires_grad_(linear.weight.requires_grad)
    return new


def _prune_attention(layer: nn.Module, groups: set[int]) -> None:
    s = layer_shape(layer)
    if len(groups) >= s.num_kv_heads:
        raise PruneError("cannot remove every attention group of a layer; remove the block instead")
    keep_kv = [g for g in range(s.num_kv_heads) if g not in groups]
    kv_rows = torch.tensor([g * s.head_dim + d for g in keep_kv for d in range(s.head_dim)])
    q_rows = torch.tensor([(g * s.group_size + h) * s.head_dim + d
                           for g in keep_kv for h in range(s.group_size) for d in range(s.head_dim)])
    attn = layer.self_attn
    attn.q_proj = _keep_linear(attn.q_proj, 0, q_rows)
    attn.k_proj = _keep_linear(attn.k_proj, 0, kv_rows)
    attn.v_proj = _keep_linear(attn.v_proj, 0, kv_rows)
    attn.o_proj = _keep_linear(attn.o_proj, 1, q_rows)
    for name, value in (("num_heads", len(keep_kv) * s.group_size), ("num_key_value_heads", len(keep_kv))):
        if hasattr(attn, name):
            setattr(attn, name, value)


def _prune_mlp(layer: nn.Module, channels: set[int]) -> None:
    inter = layer.mlp.gate_proj.out_features
    if len(channels) >= inter:
        raise PruneError("cannot remove every MLP channel of a layer; remove the block instead")
    keep = torch.tensor([c for c in range(inter) if c not in channels])
    mlp = layer.mlp
    mlp.gate_proj = _keep_linear(mlp.gate_proj, 0, keep)
    mlp.up_proj = _keep_linear(mlp.up_proj, 0, keep)
    mlp.down_proj = _keep_linear(mlp.down_proj, 1, keep)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = len(keep)


def _remove_blocks(model: nn.Module, drop: set[int]) -> None:
    layers = decoder_layers(model)
    if len(drop) >= len(layers):
        raise PruneError("cannot remove every decoder block")
    kept = [layer for i, layer in enumerate(layers) if i not in drop]
    model.model.layers = nn.ModuleList(kept)
    for new_idx, layer in enumerate(kept):
        for module in (layer, layer.self_attn):
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
    config = model.config
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [t for i, t in enumerate(config.layer_types) if i not in drop]
    widths = getattr(config, "layer_widths", None)
    if isinstance(widths, list) and len(widths) == len(layers):
        config.layer_widths = [w for i, w in enumerate(widths) if i not in drop]
    config.num_hidden_layers = len(kept)


def sync_config(model: nn.Module) -> None:
    """Make the config describe the module shapes (uniform fields, or `layer_widths` if they differ)."""
    shapes = [layer_shape(layer) for layer in decoder_layers(model)]
    config = model.config
    config.num_hidden_layers = len(shapes)
    widths = [{"num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
               "intermediate_size": s.intermediate} for s in shapes]
    if all(w == widths[0] for w in widths):
        config.num_attention_heads = widths[0]["num_attention_heads"]
        config.num_key_value_heads = widths[0]["num_key_value_heads"]
        config.intermediate_size = widths[0]["intermediate_size"]
        if hasattr(config, "layer_widths"):
            config.layer_widths = None
    else:
        config.layer_widths = widths


@torch.no_grad()
def apply(model: nn.Module, units: Sequence[Unit]) -> PruneReport:
    """Remove `units` (indices refer to the model as it is now) and return the parameter accounting."""
    check_supported(model)
    before = param_count(model)
    layers = decoder_layers(model)
    attn: dict[int, set[int]] = defaultdict(set)
    mlp: dict[int, set[int]] = defaultdict(set)
    blocks: set[int] = set()
    for u in units:
        if not 0 <= u.layer < len(layers):
            raise PruneError(f"unit {u} refers to layer {u.layer}, model has {len(layers)}")
        if u.kind == "block":
            blocks.add(u.layer)
        elif u.kind in ("attn", "mlp"):
            (attn if u.kind == "attn" else mlp)[u.layer].add(int(u.index))
        else:
            raise PruneError(f"unknown unit kind {u.kind!r}")
    for i, groups in attn.items():
        if i not in blocks:
            _prune_attention(layers[i], groups)
    for i, channels in mlp.items():
        if i not in blocks:
            _prune_mlp(layers[i], channels)
    if blocks:
        _remove_blocks(model, blocks)
    sync_config(model)
    return PruneReport(params_before=before, params_after=param_count(model), removed=list(units))
