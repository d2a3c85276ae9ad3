"""Model families as data, and the layout of a prunable unit written once.

A `Family` row says where a decoder's layers are and which tensors an attention KV group (with
its query heads) or an MLP channel owns, as `Slot`s: (module path inside the layer, dim, parts).
Counting, scoring, pruning and rebuilding all walk the same slots through `owners()`, which
maps every row (or column) of a slot's tensor to the unit that owns it. Adding a family is one
row in `FAMILIES`; nothing else branches on `model_type`.

This file is copied beside the weights of per-layer-pruned models (imported by
`modeling_pipprune`), so it imports only torch and the standard library.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

#: rows (along a slot's dim) one unit owns in a part: "q" = the group's query heads,
#: "kv" = its one key or value head, "ch" = one MLP channel
PART_ROWS = {"q": lambda s: s.group_size * s.head_dim, "kv": lambda s: s.head_dim, "ch": lambda s: 1}


@dataclass(frozen=True)
class Slot:
    """A tensor region units own: `module` inside the layer, the `dim` its units lie on, and the
    unit-strided `parts` laid end to end along that dim (a fused qkv_proj is ("q", "kv", "kv"))."""

    module: str
    dim: int
    parts: tuple[str, ...]


@dataclass(frozen=True)
class LayerShape:
    """Widths of one layer, read from its modules (pruned layers may differ from the config)."""

    num_kv_heads: int
    group_size: int
    head_dim: int
    intermediate: int

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group_size

    def units(self, kind: str) -> int:
        return self.num_kv_heads if kind == "attn" else self.intermediate


@dataclass(frozen=True)
class Family:
    """Everything pipprune needs to know about one decoder family."""

    model_type: str
    config_class: str
    model_class: str
    attn: tuple[Slot, ...]
    mlp: tuple[Slot, ...]
    layers: str = "model.layers"
    attention: str = "self_attn"
    mlp_module: str = "mlp"
    #: config lists with one entry per decoder layer, kept aligned when blocks are removed
    layer_fields: tuple[str, ...] = ()
    #: the attention module reads head counts from its own `config` (Phi-3 splits qkv by them)
    attn_reads_config_heads: bool = False
    #: (kind, config flag) pairs: the stock config switch that gives every Linear slot of that kind a bias
    #: (Llama's `attention_bias` for q/k/v/o, `mlp_bias` for gate/up/down); kinds without one cannot hold a bias
    bias_switches: tuple[tuple[str, str], ...] = ()
    #: a norm applied to the MLP's output before the residual add (Gemma 2/3, OLMo 2): the MLP's contribution is then
    #: not linear in down_proj's weight, so a linear patch cannot be folded into it
    mlp_output_norm: str | None = None

    def slots(self, kind: str) -> tuple[Slot, ...]:
        return self.attn if kind == "attn" else self.mlp

    def bias_switch(self, kind: str) -> str | None:
        return dict(self.bias_switches).get(kind)


_Q, _K, _V, _O = (Slot("self_attn.q_proj", 0, ("q",)), Slot("self_attn.k_proj", 0, ("kv",)),
                  Slot("self_attn.v_proj", 0, ("kv",)), Slot("self_attn.o_proj", 1, ("q",)))
_ATTN = (_Q, _K, _V, _O)
#: OLMo 2 normalises the whole q/k projection, so its norm weights belong to the heads
_ATTN_PROJ_NORMS = _ATTN + (Slot("self_attn.q_norm", 0, ("q",)), Slot("self_attn.k_norm", 0, ("kv",)))
_MLP = (Slot("mlp.gate_proj", 0, ("ch",)), Slot("mlp.up_proj", 0, ("ch",)), Slot("mlp.down_proj", 1, ("ch",)))
_LAYER_TYPES = ("layer_types",)
_ATTN_BIAS = (("attn", "attention_bias"),)
_POST_MLP_NORM = "post_feedforward_layernorm"

#: one row per supported family (Qwen3 / Gemma 3 q_norm, k_norm act per head_dim: not sliced)
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaConfig", "LlamaForCausalLM", _ATTN, _MLP, bias_switches=_ATTN_BIAS + (("mlp", "mlp_bias"),)),
    Family("mistral", "MistralConfig", "MistralForCausalLM", _ATTN, _MLP),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _ATTN, _MLP, layer_fields=_LAYER_TYPES),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _ATTN, _MLP, layer_fields=_LAYER_TYPES, bias_switches=_ATTN_BIAS),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", _ATTN, _MLP, layer_fields=_LAYER_TYPES, bias_switches=_ATTN_BIAS,
           mlp_output_norm=_POST_MLP_NORM),
    Family("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", _ATTN, _MLP, layer_fields=_LAYER_TYPES,
           bias_switches=_ATTN_BIAS, mlp_output_norm=_POST_MLP_NORM),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM",
           (Slot("self_attn.qkv_proj", 0, ("q", "kv", "kv")), _O),
           (Slot("mlp.gate_up_proj", 0, ("ch", "ch")), Slot("mlp.down_proj", 1, ("ch",))),
           attn_reads_config_heads=True),
    Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _ATTN_PROJ_NORMS, _MLP, bias_switches=_ATTN_BIAS,
           mlp_output_norm=_POST_MLP_NORM),
)}
#: prefix of the model_type of a per-layer-pruned model ("pipprune_llama")
PRUNED_PREFIX = "pipprune_"


class LayoutError(ValueError):
    """A model's modules do not match its family's row (unknown layer layout)."""


class UnsupportedFamilyError(ValueError):
    """The model_type has no row in FAMILIES."""


def supported() -> str:
    return ", ".join(FAMILIES)


def family_for(model_type: str | None) -> Family:
    """The row for `model_type` (a per-layer-pruned `pipprune_<type>` maps to its base row)."""
    base = (model_type or "").removeprefix(PRUNED_PREFIX)
    if base not in FAMILIES:
        raise UnsupportedFamilyError(f"unsupported model family {model_type!r}; pipprune prunes: {supported()}")
    return FAMILIES[base]


def get_module(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def decoder_layers(model: nn.Module, family: Family) -> nn.ModuleList:
    return model.get_submodule(family.layers)


def layer_shape(layer: nn.Module, family: Family) -> LayerShape:
    """Widths from the modules: head_dim and group size from the attention, counts from the slots."""
    attn = get_module(layer, family.attention)
    head_dim, group = int(attn.head_dim), int(attn.num_key_value_groups)
    probe = LayerShape(num_kv_heads=1, group_size=group, head_dim=head_dim, intermediate=1)
    counts = {}
    for kind in ("attn", "mlp"):
        slot = family.slots(kind)[0]
        length = _weight(layer, slot).shape[slot.dim]
        per_unit = sum(PART_ROWS[p](probe) for p in slot.parts)
        if length % per_unit:
            raise LayoutError(f"{slot.module} has {length} rows along dim {slot.dim}, not a multiple of {per_unit}")
        counts[kind] = length // per_unit
    return LayerShape(num_kv_heads=counts["attn"], group_size=group, head_dim=head_dim, intermediate=counts["mlp"])


def _weight(layer: nn.Module, slot: Slot) -> torch.Tensor:
    return get_module(layer, slot.module).weight


def owners(slot: Slot, shape: LayerShape, kind: str) -> torch.Tensor:
    """Unit index owning each position along the slot's dim (parts laid end to end)."""
    n = shape.units(kind)
    return torch.cat([torch.arange(n, device="cpu").repeat_interleave(PART_ROWS[p](shape)) for p in slot.parts])


def slot_tensors(layer: nn.Module, slot: Slot) -> list[tuple[torch.Tensor, int]]:
    """(tensor, dim) pairs a slot covers: the weight, and the bias when rows are owned."""
    module = get_module(layer, slot.module)
    out = [(module.weight, slot.dim)]
    if slot.dim == 0 and getattr(module, "bias", None) is not None:
        out.append((module.bias, 0))
    return out


def check_layout(layer: nn.Module, family: Family, where: str = "layer") -> LayerShape:
    """Raise LayoutError naming the first slot the layer lacks or whose size does not fit."""
    for kind in ("attn", "mlp"):
        for slot in family.slots(kind):
            try:
                module = get_module(layer, slot.module)
            except AttributeError:
                raise LayoutError(f"{where} has no module {slot.module!r}, which the {family.model_type} layout "
                                  f"expects; unknown layer layout") from None
            if not isinstance(getattr(module, "weight", None), torch.Tensor):
                raise LayoutError(f"{where}: {slot.module} has no weight tensor; unknown layer layout")
    try:
        shape = layer_shape(layer, family)
    except AttributeError as exc:
        raise LayoutError(f"{where}: attention module lacks {exc}; unknown layer layout") from None
    for kind in ("attn", "mlp"):
        for slot in family.slots(kind):
            expected = len(owners(slot, shape, kind))
            actual = _weight(layer, slot).shape[slot.dim]
            if actual != expected:
                raise LayoutError(f"{where}: {slot.module} has {actual} positions along dim {slot.dim}, the "
                                  f"{family.model_type} layout implies {expected}; unknown layer layout")
    return shape


def unit_params(layer: nn.Module, family: Family, kind: str) -> int:
    """Parameters one unit of `kind` owns in `layer` (every unit of a kind owns the same amount)."""
    shape = layer_shape(layer, family)
    n = shape.units(kind)
    total = 0
    for slot in family.slots(kind):
        total += sum(tensor.numel() // n for tensor, _ in slot_tensors(layer, slot))
    return total


def _keep(module: nn.Module, dim: int, keep: torch.Tensor) -> nn.Module:
    """A copy of a Linear (rows with their bias, or columns) or a norm (elements) keeping `keep`."""
    weight = module.weight.data.index_select(dim, keep.to(module.weight.device))
    if isinstance(module, nn.Linear):
        bias = module.bias
        new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                        dtype=weight.dtype)
        new.weight.data = weight
        if bias is not None:
            new.bias.data = bias.data.index_select(0, keep.to(bias.device)) if dim == 0 else bias.data.clone()
        new.weight.requires_grad_(module.weight.requires_grad)
        return new
    new = copy.deepcopy(module)  # a norm: same hyper-parameters, sliced weight
    new.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    return new


def keep_units(layer: nn.Module, family: Family, kind: str, keep: Sequence[int]) -> None:
    """Shrink every slot of `kind` in `layer` to the units in `keep` (in that order) and update the
    modules' own width attributes. Pruning and the per-layer rebuild both call this."""
    shape = layer_shape(layer, family)
    n = shape.units(kind)
    keep = [int(j) for j in keep]  # index tensors stay on the CPU even under a meta-device context
    if not keep:
        raise ValueError(f"cannot remove every {kind} unit of a layer; remove the block instead")
    if min(keep) < 0 or max(keep) >= n or len(set(keep)) != len(keep):
        raise ValueError(f"{kind} unit indices {keep} are not distinct indices below {n}")
    keep_t = torch.tensor(keep, dtype=torch.long, device="cpu")
    position = torch.full((n,), -1, dtype=torch.long, device="cpu")
    position[keep_t] = torch.arange(len(keep), device="cpu")
    for slot in family.slots(kind):
        own = owners(slot, shape, kind)
        rows = torch.nonzero(position[own] >= 0).squeeze(1)
        set_module(layer, slot.module, _keep(get_module(layer, slot.module), slot.dim, rows))
    kept = int(keep_t.numel())
    if kind == "attn":
        attn = get_module(layer, family.attention)
        values = {"num_heads": kept * shape.group_size, "num_key_value_heads": kept}
        for name, value in values.items():
            if hasattr(attn, name):
                setattr(attn, name, value)
        if family.attn_reads_config_heads:
            attn.config = copy.copy(attn.config)
            attn.config.num_attention_heads, attn.config.num_key_value_heads = values.values()
    else:
        mlp = get_module(layer, family.mlp_module)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = kept


def resize(layer: nn.Module, family: Family, num_kv_heads: int, intermediate: int) -> None:
    """Give a freshly built layer the given widths (its weights are loaded afterwards)."""
    shape = layer_shape(layer, family)
    if num_kv_heads != shape.num_kv_heads:
        keep_units(layer, family, "attn", range(num_kv_heads))
    if intermediate != shape.intermediate:
        keep_units(layer, family, "mlp", range(intermediate))


def layer_widths(shapes: Iterable[LayerShape]) -> list[dict[str, int]]:
    return [{"num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
             "intermediate_size": s.intermediate} for s in shapes]


def unit_slices(layer: nn.Module, family: Family, kind: str, index: int) -> list[tuple[torch.Tensor, int, slice]]:
    """(tensor, dim, slice) triples covering exactly what unit `index` of `kind` owns in `layer`
    (a fused projection gives one triple per part)."""
    shape = layer_shape(layer, family)
    n = shape.units(kind)
    out = []
    for slot in family.slots(kind):
        offset = 0
        for part in slot.parts:
            rows = PART_ROWS[part](shape)
            piece = slice(offset + index * rows, offset + (index + 1) * rows)
            out.extend((tensor, dim, piece) for tensor, dim in slot_tensors(layer, slot))
            offset += n * rows
    return out
