"""Choose units to remove and remove them physically: smaller matrices, fewer heads or layers.

No masks: the pruned model is smaller and faster, and saves as ordinary weights.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pip_core import alignment, families, rules
from pip_core.errors import PruneError
from pip_core.families import Family
from pip_core.units import Unit, check_supported, family_of, layer_shape, param_count
from pip_core.vocabulary import WIDTH_MODES, WIDTH_SPLITS


@dataclass
class PruneReport:
    params_before: int
    params_after: int
    removed: list[Unit] = field(default_factory=list)

    @property
    def params_removed(self) -> int:
        return self.params_before - self.params_after


def select(units: Sequence[Unit], scores: Sequence[float] | torch.Tensor, target_params: int,
           protect_first: int = 1, protect_last: int = 1, width_mode: str = "per_layer", align: int = 1,
           width_split: str = "params") -> list[Unit]:
    """Lowest-scoring units first until `target_params` are covered (overshoot < one unit).

    `width_mode="uniform"` dispatches attention/MLP units to `select_uniform` (with `align` and `width_split`);
    blocks are always selected here.

    The rules are `pip_core.rules` (the planner's too): kinds are ranked separately and each gets
    a share of the target proportional to its prunable parameters, because scores of a whole
    attention group and of a single MLP channel are not on one scale. The first/last `protect_*`
    layers are never touched, and every layer keeps at least one attention group, one MLP
    channel, and the model at least one block.
    """
    if width_mode not in WIDTH_MODES:
        raise PruneError(f"unknown width mode {width_mode!r}; use one of {', '.join(WIDTH_MODES)}")
    scores = _as_floats(scores, units)
    if target_params <= 0:
        return []
    if width_mode == "uniform" and all(u.kind in ("attn", "mlp") for u in units):
        return select_uniform(units, scores, target_params, align, width_split)
    protected = rules.protected_layers(1 + max(u.layer for u in units), protect_first, protect_last)
    per_layer_count: dict[tuple[str, int], int] = defaultdict(int)
    for u in units:
        per_layer_count[(u.kind, u.layer)] += 1
    candidates: dict[str, list[tuple[float, Unit]]] = defaultdict(list)
    for u, s in zip(units, scores, strict=True):
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
        share = rules.kind_share(target_params, prunable[kind], total_prunable, remaining, last=n == len(kinds) - 1)
        got = 0
        left = dict(per_layer_count)
        blocks_left = sum(1 for u in units if u.kind == "block")
        for _, u in sorted(candidates[kind], key=lambda t: (t[0], t[1].layer, t[1].index or 0)):
            if got >= share:  # covered: equal blocks make this `rules.blocks_for` (rounded up)
                break
            if kind == "block":
                if blocks_left <= rules.KEEP_BLOCKS:
                    continue
                blocks_left -= 1
            elif left[(kind, u.layer)] <= rules.KEEP_PER_LAYER:
                continue
            left[(kind, u.layer)] -= 1
            chosen.append(u)
            got += u.num_params
        remaining -= got
    if sum(u.num_params for u in chosen) < target_params - max(u.num_params for u in units):
        raise PruneError(f"could only select {sum(u.num_params for u in chosen):,} of {target_params:,} parameters "
                         "without emptying a layer; lower the ratio or change the unit kind")
    return chosen


def _as_floats(scores: Sequence[float] | torch.Tensor, units: Sequence[Unit]) -> list[float]:
    values = [float(s) for s in (scores.tolist() if isinstance(scores, torch.Tensor) else scores)]
    if len(values) != len(units):
        raise PruneError(f"{len(values)} scores for {len(units)} units")
    return values


def select_uniform(units: Sequence[Unit], scores: Sequence[float] | torch.Tensor, target_params: int,
                   align: int = 1, split: str = "params") -> list[Unit]:
    """Remove the same number of units of each kind from EVERY layer, so widths stay uniform and the
    pruned model is the family's stock config. Each layer drops its own lowest-scoring units; the
    per-layer count of each kind is its share of the target (proportional to its parameters, as in
    `select`), the finest kind absorbing the rounding (`alignment.uniform_cuts`); `split="scores"` takes instead the
    split whose removed units score lowest (`_split_by_scores`). With `align` > 1
    every layer keeps a multiple of `align` MLP channels (clamped for narrow models). Uniform widths
    cut every layer, so protect_first/protect_last do not apply (use width_mode per_layer to keep layers whole).
    """
    scores = _as_floats(scores, units)
    by_layer: dict[str, dict[int, list[tuple[float, Unit]]]] = defaultdict(lambda: defaultdict(list))
    for u, s in zip(units, scores, strict=True):
        by_layer[u.kind][u.layer].append((s, u))
    steps: dict[str, int] = {}  # parameters removed by cutting one unit of that kind in every layer
    widths: dict[str, int] = {}
    for kind, layers in by_layer.items():
        sizes = {len(v) for v in layers.values()}
        params = {u.num_params for v in layers.values() for _, u in v}
        if len(sizes) != 1 or len(params) != 1:
            raise PruneError(f"{kind} widths differ between layers (a per-layer-pruned model); uniform width mode "
                             "needs equal widths: use width_mode per_layer")
        steps[kind] = len(layers) * params.pop()
        widths[kind] = sizes.pop()
    kinds = alignment.kind_cuts(steps, widths, align)
    total = sum(c.max_params for c in kinds.values())
    if total < target_params:
        raise PruneError(f"cannot remove {target_params:,} parameters uniformly: at most {total:,} while every layer "
                         f"keeps one unit of each kind (MLP widths multiples of {align}); lower the ratio")
    if split not in WIDTH_SPLITS:
        raise PruneError(f"unknown width split {split!r}; use one of {', '.join(WIDTH_SPLITS)}")
    cut = (_split_by_scores(by_layer, kinds, target_params) if split == "scores" and len(kinds) > 1
           else alignment.uniform_cuts(kinds, target_params))
    remaining = target_params - sum(cut[k] * steps[k] for k in cut)
    if remaining > min(c.granularity for c in kinds.values()):
        raise PruneError(f"uniform widths reach only {target_params - remaining:,} of {target_params:,} parameters "
                         "without emptying a layer; lower the ratio or use width_mode per_layer")
    chosen: list[Unit] = []
    for kind, layers in by_layer.items():
        for layer in sorted(layers):
            ranked = sorted(layers[layer], key=lambda t: (t[0], t[1].index))
            chosen.extend(u for _, u in ranked[:cut[kind]])
    return chosen


def _split_by_scores(by_layer: dict[str, dict[int, list[tuple[float, Unit]]]], kinds: dict[str, alignment.KindCut],
                     target_params: int) -> dict[str, int]:
    """The uniform cut whose removed units have the lowest parameter-weighted sum of standardised scores.

    Scores of an attention group and of an MLP channel are not on one scale, so each kind's are standardised over
    all its units (every layer); then every option of the coarsest kind is tried with the finest kind making up the
    rest of the target (its nearest option), and the split that removes the least important parameters, by that
    measure, wins. Splits that miss the target by more than the finest kind's granularity are not candidates; when
    none is left the parameter split stands.
    """
    if len(kinds) != 2:
        return alignment.uniform_cuts(kinds, target_params)
    coarse, fine = sorted(kinds, key=lambda k: kinds[k].granularity, reverse=True)
    ranked: dict[str, list[list[float]]] = {}
    for kind, layers in by_layer.items():
        values = torch.tensor([s for v in layers.values() for s, _ in v], dtype=torch.float64)
        mean, std = values.mean(), values.std().clamp_min(1e-12)
        ranked[kind] = [sorted(float((s - mean) / std) for s, _ in layers[layer]) for layer in sorted(layers)]

    def cost(kind: str, n: int) -> float:  # parameter-weighted standardised scores of n removed units per layer
        return kinds[kind].step / len(ranked[kind]) * sum(sum(row[:n]) for row in ranked[kind])

    best: tuple[float, dict[str, int]] | None = None
    for a in kinds[coarse].options:
        left = target_params - a * kinds[coarse].step
        if left < 0:
            break
        f = kinds[fine].nearest(left)
        if abs(left - f * kinds[fine].step) > kinds[fine].granularity:
            continue
        total = cost(coarse, a) + cost(fine, f)
        if best is None or total < best[0]:
            best = (total, {coarse: a, fine: f})
    return best[1] if best else alignment.uniform_cuts(kinds, target_params)


def _prune_width(layer: nn.Module, family: Family, kind: str, drop: set[int]) -> None:
    n = layer_shape(layer, family).units(kind)
    if len(drop) >= n:
        raise PruneError(f"cannot remove every {kind} unit of a layer; remove the block instead")
    families.keep_units(layer, family, kind, [j for j in range(n) if j not in drop])


def _remove_blocks(model: nn.Module, family: Family, drop: set[int]) -> None:
    layers = families.decoder_layers(model, family)
    if len(drop) >= len(layers):
        raise PruneError("cannot remove every decoder block")
    kept = [layer for i, layer in enumerate(layers) if i not in drop]
    families.set_module(model, family.layers, nn.ModuleList(kept))
    for new_idx, layer in enumerate(kept):
        for module in (layer, families.get_module(layer, family.attention)):
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
    config = model.config
    for name in family.layer_fields + ("layer_widths",):
        values = getattr(config, name, None)
        if isinstance(values, list) and len(values) == len(layers):
            setattr(config, name, [v for i, v in enumerate(values) if i not in drop])
    config.num_hidden_layers = len(kept)


def sync_config(model: nn.Module) -> None:
    """Make the config describe the module shapes (uniform fields, or `layer_widths` if they differ)."""
    family = family_of(model)
    shapes = [layer_shape(layer, family) for layer in families.decoder_layers(model, family)]
    config = model.config
    config.num_hidden_layers = len(shapes)
    config.head_dim = shapes[0].head_dim  # explicit: stock configs would derive hidden/heads
    widths = families.layer_widths(shapes)
    if all(w == widths[0] for w in widths):
        for name, value in widths[0].items():
            setattr(config, name, value)
        if hasattr(config, "layer_widths"):
            config.layer_widths = None
    else:
        config.layer_widths = widths


@torch.no_grad()
def apply(model: nn.Module, units: Sequence[Unit]) -> PruneReport:
    """Remove `units` (indices refer to the model as it is now) and return the parameter accounting."""
    family = check_supported(model)
    before = param_count(model)
    layers = families.decoder_layers(model, family)
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
    for kind, drops in (("attn", attn), ("mlp", mlp)):
        for i, drop in drops.items():
            if i not in blocks:
                _prune_width(layers[i], family, kind, drop)
    if blocks:
        _remove_blocks(model, family, blocks)
    sync_config(model)
    return PruneReport(params_before=before, params_after=param_count(model), removed=list(units))
