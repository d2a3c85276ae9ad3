"""Structural units of a supported decoder: whole blocks, GQA attention groups, MLP channels.

Which tensors a unit owns is written once, as the family's slots (`pip_core.families`); this
module only enumerates units. Shapes are read from the modules themselves, never from the
config, because after pruning each layer may have its own width. A unit's `num_params` is
exactly what removing it takes away.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pip_core import families
from pip_core.errors import PipCoreError, UnsupportedArchitectureError
from pip_core.families import Family, LayerShape
from pip_core.vocabulary import KINDS, UnitKind

#: model_type values pipprune prunes (stock rows, and their per-layer-pruned `pipprune_` types)
SUPPORTED_MODEL_TYPES = tuple(families.FAMILIES) + tuple(families.PRUNED_PREFIX + t for t in families.FAMILIES)

__all__ = ["Unit", "UnitKind", "LayerShape", "KINDS", "SUPPORTED_MODEL_TYPES", "family_of", "check_supported",
           "check_layout", "decoder_layers", "layer_shape", "discover", "param_count", "unit_tensors", "unit_slices"]


@dataclass(frozen=True)
class Unit:
    """One removable piece: `index` is the KV group (attn) or channel (mlp); None for a block."""

    kind: UnitKind
    layer: int
    index: int | None
    num_params: int


def family_of(model: nn.Module) -> Family:
    """The family row of `model`, or UnsupportedArchitectureError naming the supported families."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        return families.family_for(model_type)
    except families.UnsupportedFamilyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {type(model).__name__} (model_type={model_type!r}); "
            f"pipprune prunes these families: {families.supported()}") from None


def check_supported(model: nn.Module) -> Family:
    """Raise unless `model` is a supported family whose layers match its row, on a real device."""
    family = check_layout(model)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise PipCoreError(f"{type(model).__name__} has weights on the meta device; load real weights first")
    return family


def check_layout(model: nn.Module) -> Family:
    """Raise unless `model` is a supported family whose every layer matches the family's slots."""
    family = family_of(model)
    try:
        layers = decoder_layers(model)
    except AttributeError:
        raise UnsupportedArchitectureError(f"{type(model).__name__} has no decoder layers at {family.layers!r}; "
                                           "unknown layer layout") from None
    for i, layer in enumerate(layers):
        try:
            families.check_layout(layer, family, where=f"layer {i} of {type(model).__name__}")
        except families.LayoutError as exc:
            raise UnsupportedArchitectureError(str(exc)) from None
    return family


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return families.decoder_layers(model, family_of(model))


def layer_shape(layer: nn.Module, family: Family) -> LayerShape:
    return families.layer_shape(layer, family)


def block_params(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def discover(model: nn.Module, kind: str) -> list[Unit]:
    """All units of `kind` ('block', 'attn', 'mlp' or 'width' = attn + mlp) in layer order."""
    if kind not in KINDS:
        raise PipCoreError(f"unknown unit kind {kind!r}; use one of {sorted(KINDS)}")
    family = check_supported(model)
    found: list[Unit] = []
    for i, layer in enumerate(families.decoder_layers(model, family)):
        for k in KINDS[kind]:
            if k == "block":
                found.append(Unit("block", i, None, block_params(layer)))
                continue
            n = families.unit_params(layer, family, k)
            found.extend(Unit(k, i, j, n) for j in range(layer_shape(layer, family).units(k)))
    return found


def param_count(model: nn.Module) -> int:
    """Parameters counted once even when tied (embeddings shared with the LM head)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def unit_tensors(model: nn.Module, unit: Unit) -> list[torch.Tensor]:
    """The tensors `unit` owns part of (all of a block's)."""
    family = family_of(model)
    layer = families.decoder_layers(model, family)[unit.layer]
    if unit.kind == "block":
        return list(layer.parameters())
    return [t for slot in family.slots(unit.kind) for t, _ in families.slot_tensors(layer, slot)]


def unit_slices(model: nn.Module, unit: Unit) -> list[tuple[torch.Tensor, int, slice]]:
    """(tensor, dim, slice) triples covering exactly the weights `unit` owns (a block: all of it)."""
    family = family_of(model)
    layer = families.decoder_layers(model, family)[unit.layer]
    if unit.kind == "block":
        return [(p, 0, slice(None)) for p in layer.parameters()]
    return families.unit_slices(layer, family, unit.kind, int(unit.index))
