"""Budgets: turn "at most 3e9 parameters", "fits in 24 GiB" or "remove 20%" into a pruning schedule.

Everything here is computed from the model's config.json and its family row (the model is built
on the meta device: no weights are read), so an infeasible target is refused in seconds, before a
download, a flow run or a registered version exists.

In uniform width mode and for blocks the number of units each step removes does not depend on
the scores (only which units do), so the planner simulates the flow's steps with the selector's
own rules (`pip_core.rules`, `schedule.plan`, `schedule.step_spec`, `alignment.uniform_cuts`) and the figure it
prints is the one the run ends at. Per-layer widths depend on the scores; there the planner gives
the target rounded to one unit.

`memory` counts the saved weights in the output dtype plus, when a serving context and batch are
given, the KV cache: 2 (K and V) x layers x KV heads x head_dim x context x batch x dtype bytes.
Sliding-window layers are counted at the full context (an upper bound).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pip_core import alignment, families, rules
from pip_core.errors import PipCoreError
from pip_core.memory_plan import _DTYPE_BYTES, meta_model
from pip_core.schedule import plan as linear_plan
from pip_core.schedule import step_spec
from pip_core.vocabulary import KINDS, MAX_RATIO

TARGET_KINDS = ("params", "memory", "ratio", "layers")
#: past this share of the decoder layers' parameters (or of a kind's units: MLP channels, KV groups, blocks) a
#: target guts the layers, and a run asks the user to confirm it (`BodyCut.deep`)
DEEP_CUT = 0.5
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_BYTE_SUFFIX = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
                "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class BudgetError(PipCoreError):
    """A target that cannot be met; `nearest` is the closest feasible target, spelled as the user would."""

    def __init__(self, message: str, nearest: str | None = None) -> None:
        super().__init__(message)
        self.nearest = nearest


@dataclass(frozen=True)
class Target:
    """What the user asked for: `params` (at most N parameters), `memory` (bytes), or `ratio` removed."""

    kind: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Target:
        """`params=3e9`, `params=350M`, `memory=24GiB`, `memory=500MB`, `ratio=0.2`, `layers=0.2` (a share of the
        decoder layers' parameters alone: the embeddings and the head, which pruning keeps, do not count)."""
        kind, sep, raw = str(text).strip().partition("=")
        kind, raw = kind.strip().lower(), raw.strip().replace("_", "").replace(",", "")
        if not sep or kind not in TARGET_KINDS:
            raise PipCoreError(f"target {text!r} is not KIND=VALUE with KIND one of {', '.join(TARGET_KINDS)} "
                               "(e.g. params=3e9, memory=24GiB, ratio=0.2)")
        suffixes = {"params": _COUNT_SUFFIX, "memory": _BYTE_SUFFIX, "ratio": {"": 1}, "layers": {"": 1}}[kind]
        match = re.fullmatch(_NUMBER + r"\s*([A-Za-z]*)", raw)
        if not match or match.group(2).lower() not in suffixes:
            units = ", ".join(s for s in suffixes if s) or "no unit"
            raise PipCoreError(f"target {text!r}: {raw!r} is not a number with an optional unit ({units})")
        value = float(match.group(1)) * suffixes[match.group(2).lower()]
        if kind in ("ratio", "layers") and not 0.0 < value <= MAX_RATIO:
            raise PipCoreError(f"target {text!r}: {kind} must be in (0, {MAX_RATIO}]")
        if value <= 0 or not math.isfinite(value):
            raise PipCoreError(f"target {text!r}: the value must be positive")
        return cls(kind, value)

    def __str__(self) -> str:
        if self.kind in ("ratio", "layers"):
            return f"{self.kind}={self.value:g}"
        if self.kind == "memory":
            return f"memory={format_bytes(self.value)}"
        return f"params={int(self.value)}"


def format_bytes(n: float, up: bool = False) -> str:
    """MiB or GiB to three decimals (`up`: rounded up, so a suggested budget still fits)."""
    unit, name = (2**30, "GiB") if n >= 2**30 else (2**20, "MiB")
    value = math.ceil(n / unit * 1000) / 1000 if up else round(n / unit, 3)
    return f"{value:g}{name}"


@dataclass(frozen=True)
class Architecture:
    """The figures the planner needs, from the config and the family row (meta build, no weights)."""

    model_type: str
    num_params: int
    layers: int
    kv_heads: int
    group_size: int
    head_dim: int
    intermediate: int
    attn_unit: int  # parameters one KV group (with its query heads) owns in one layer
    mlp_unit: int  # parameters one MLP channel owns in one layer
    layer_other: int  # parameters of a layer outside its units (norms)
    dtype: str

    @classmethod
    def from_config(cls, config: dict, dtype: str = "auto") -> Architecture:
        model = meta_model(config)
        family = families.family_for(config.get("model_type"))
        layers = families.decoder_layers(model, family)
        layer = layers[0]
        shape = families.layer_shape(layer, family)
        attn_unit = families.unit_params(layer, family, "attn")
        mlp_unit = families.unit_params(layer, family, "mlp")
        block = sum(p.numel() for p in layer.parameters())
        num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        if dtype == "auto":
            dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
        if dtype not in _DTYPE_BYTES:
            raise PipCoreError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_BYTES)}")
        return cls(model_type=family.model_type, num_params=num_params, layers=len(layers), kv_heads=shape.num_kv_heads,
                   group_size=shape.group_size, head_dim=shape.head_dim, intermediate=shape.intermediate,
                   attn_unit=attn_unit, mlp_unit=mlp_unit,
                   layer_other=block - attn_unit * shape.num_kv_heads - mlp_unit * shape.intermediate, dtype=dtype)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Shape:
    """Uniform widths of a (planned) model and its parameter count."""

    num_params: int
    layers: int
    kv_heads: int
    intermediate: int


@dataclass(frozen=True)
class StepPlan:
    step: int
    target_ratio: float
    params_to_remove: int
    num_params: int
    layers: int
    kv_heads: int
    intermediate: int
    memory_bytes: int


@dataclass(frozen=True)
class Serving:
    """The deployment the memory target counts the KV cache for (context 0: weights only)."""

    context: int = 0
    batch: int = 1


@dataclass(frozen=True)
class BodyCut:
    """What a plan takes from the decoder layers, the only part pruning removes: a ratio of the whole model is a
    larger share of the layers where the embeddings are a large part of it (a 262k vocabulary: 63% of a 270M model,
    so 20% of the model is 54% of its layers)."""

    layers_before: int
    layers_after: int
    params_before: int  # all decoder layers' parameters
    params_after: int
    kv_heads_before: int
    kv_heads_after: int
    mlp_before: int
    mlp_after: int
    #: widths differ per layer: the kinds' figures are the plan's average
    averaged: bool

    @property
    def removed(self) -> float:
        """The share of the decoder layers' parameters removed."""
        return 1 - self.params_after / self.params_before

    @property
    def deep(self) -> bool:
        """Whether the layers lose more than `DEEP_CUT` of their parameters, of their MLP channels, of their KV
        groups or of their number."""
        kept = (self.layers_after / self.layers_before, self.kv_heads_after / self.kv_heads_before,
                self.mlp_after / self.mlp_before)
        return self.removed > DEEP_CUT or min(kept) < 1 - DEEP_CUT

    def describe(self) -> str:
        about = "about " if self.averaged else ""
        kinds = (f"{self.layers_after} of {self.layers_before} layers" if self.layers_after != self.layers_before
                 else f"the MLP keeps {about}{self.mlp_after:,} of {self.mlp_before:,} channels, attention "
                      f"{about}{self.kv_heads_after} of {self.kv_heads_before} KV groups")
        return f"{self.removed:.0%} of the decoder layers' parameters ({kinds})"


@dataclass(frozen=True)
class VocabCut:
    """The vocabulary trimmed before any width or block is pruned (pip_core.vocab_trim): its tokens before and after,
    and the embedding and LM-head parameters that go with the dropped ones (both tensors when untied)."""

    tokens_before: int
    tokens_after: int
    params_removed: int

    def describe(self, params_before: int) -> str:
        return (f"vocabulary {self.tokens_before:,} -> {self.tokens_after:,} tokens: {self.params_removed:,} "
                f"parameters ({self.params_removed / params_before:.1%} of the model)")


@dataclass(frozen=True)
class BudgetPlan:
    """The target, what the run will reach, and the step-by-step schedule that reaches it."""

    target: str
    model_type: str
    unit: str
    width_mode: str
    iterations: int
    dtype: str
    align: int
    effective_align: int
    params_before: int
    params_after: int
    #: the removal ratio handed to the flow's linear schedule
    ratio: float
    granularity: int
    memory_before: int
    memory_after: int
    kv_cache_after: int
    exact: bool
    body: BodyCut
    steps: list[StepPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the vocabulary trimmed first (None: kept whole); its parameters count towards the target
    vocab: VocabCut | None = None

    @property
    def achieved_ratio(self) -> float:
        return (self.params_before - self.params_after) / self.params_before

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "achieved_ratio": self.achieved_ratio,
                "body": {**asdict(self.body), "removed": self.body.removed, "deep": self.body.deep}}

    def describe(self) -> str:
        """Where the target's parameters come from: the vocabulary (when it is trimmed first), then the layers."""
        first = f"the {self.vocab.describe(self.params_before)}, then " if self.vocab else ""
        return f"{self.target} takes {first}{self.body.describe()}"

    def largest_shallow_ratio(self) -> float:
        """The largest whole-model ratio that removes at most `DEEP_CUT` of the decoder layers' parameters (two
        decimals, rounded down): what to offer a user whose target is `body.deep`."""
        trimmed = self.vocab.params_removed if self.vocab else 0
        return math.floor((DEEP_CUT * self.body.params_before + trimmed) / self.params_before * 100) / 100



@dataclass(frozen=True)
class _Planner:
    arch: Architecture
    unit: str
    width_mode: str
    iterations: int
    align: int
    protect_first: int
    protect_last: int
    serving: Serving

    @property
    def uniform(self) -> bool:
        return self.unit != "block" and self.width_mode == "uniform"

    def memory(self, shape: Shape) -> int:
        b = self.arch.dtype_bytes
        kv = 2 * shape.layers * shape.kv_heads * self.arch.head_dim * self.serving.context * self.serving.batch * b
        return shape.num_params * b + kv

    def kv_cache(self, shape: Shape) -> int:
        return self.memory(shape) - shape.num_params * self.arch.dtype_bytes

    def dense(self) -> Shape:
        a = self.arch
        return Shape(a.num_params, a.layers, a.kv_heads, a.intermediate)

    def block_params(self, s: Shape) -> int:
        return self.arch.layer_other + self.arch.attn_unit * s.kv_heads + self.arch.mlp_unit * s.intermediate

    def _kinds(self, s: Shape) -> dict[str, alignment.KindCut]:
        unit = {"attn": self.arch.attn_unit, "mlp": self.arch.mlp_unit}
        widths = {"attn": s.kv_heads, "mlp": s.intermediate}
        steps = {k: s.layers * unit[k] for k in KINDS[self.unit]}
        return alignment.kind_cuts(steps, {k: widths[k] for k in steps}, self.align)

    def max_removable(self, s: Shape) -> int:
        """The most one step from `s` may remove (what the selector refuses beyond)."""
        if self.unit == "block":
            return rules.removable_blocks(s.layers, self.protect_first, self.protect_last) * self.block_params(s)
        if self.uniform:
            return sum(c.max_params for c in self._kinds(s).values())
        prunable_layers = s.layers - len(rules.protected_layers(s.layers, self.protect_first, self.protect_last))
        per_layer = {"attn": self.arch.attn_unit * rules.removable_per_layer(s.kv_heads),
                     "mlp": self.arch.mlp_unit * rules.removable_per_layer(s.intermediate)}
        return prunable_layers * sum(per_layer[k] for k in KINDS[self.unit])

    def granularity(self, s: Shape) -> int:
        if self.unit == "block":
            return self.block_params(s)
        if self.uniform:
            return max(c.granularity for c in self._kinds(s).values())
        return max({"attn": self.arch.attn_unit, "mlp": self.arch.mlp_unit}[k] for k in KINDS[self.unit])

    def step(self, s: Shape, to_remove: int) -> Shape:
        """The shape after one selector step asked to remove `to_remove` parameters (its own rules)."""
        if to_remove <= 0:
            return s
        if to_remove > self.max_removable(s):
            raise BudgetError(f"a step would remove {to_remove:,} parameters, more than the {self.max_removable(s):,} "
                              "it may without emptying a layer")
        if self.unit == "block":
            k = rules.blocks_for(to_remove, self.block_params(s))
            return Shape(s.num_params - k * self.block_params(s), s.layers - k, s.kv_heads, s.intermediate)
        if not self.uniform:
            return replace(s, num_params=s.num_params - to_remove)
        kinds = self._kinds(s)
        cuts = alignment.uniform_cuts(kinds, to_remove)
        removed = sum(cuts[k] * kinds[k].step for k in cuts)
        return Shape(s.num_params - removed, s.layers, s.kv_heads - cuts.get("attn", 0),
                     s.intermediate - cuts.get("mlp", 0))

    def simulate(self, to_remove: int) -> list[tuple[float, int, Shape]]:
        """(cumulative ratio, step budget, shape after) for each step of the flow's linear schedule."""
        total, shape, out = self.arch.num_params, self.dense(), []
        for i, cumulative in enumerate(linear_plan(to_remove / total, self.iterations), start=1):
            spec = step_spec(i, cumulative, total, shape.num_params, 0)
            shape = self.step(shape, spec.params_to_remove)
            out.append((cumulative, spec.params_to_remove, shape))
        return out

    def final(self, to_remove: int) -> Shape | None:
        try:
            return self.simulate(to_remove)[-1][2]
        except BudgetError:
            return None


def plan_budget(config: dict, target: Target | str, selection: rules.Selection = rules.Selection(), *,
                iterations: int = 1, dtype: str = "auto", serving: Serving | None = None,
                vocab_after: int | None = None) -> BudgetPlan:
    """The plan for `target` on the model `config` describes, or BudgetError naming the nearest feasible target.

    `vocab_after`: the vocabulary is trimmed to that many tokens first, and the rows it drops count towards the
    target; the units then pay only the rest (the plan's `ratio` and steps are of the trimmed model, which is what
    the flow's schedule prunes)."""
    target = Target.parse(target) if isinstance(target, str) else target
    unit, width_mode, align = selection.unit, selection.width_mode, selection.align
    protect_first, protect_last = selection.protect_first, selection.protect_last
    if unit not in KINDS:
        raise PipCoreError(f"unknown unit kind {unit!r}; use one of {sorted(KINDS)}")
    if iterations < 1:
        raise PipCoreError(f"iterations must be >= 1, got {iterations}")
    full = Architecture.from_config(config, dtype)
    vocab = None
    arch = full
    if vocab_after is not None:
        tokens_before = int(config["vocab_size"])
        if not 0 < vocab_after <= tokens_before:
            raise PipCoreError(f"a trimmed vocabulary of {vocab_after} tokens does not fit the model's {tokens_before}")
        arch = Architecture.from_config({**config, "vocab_size": vocab_after}, dtype)
        vocab = VocabCut(tokens_before, vocab_after, full.num_params - arch.num_params)
    trimmed = vocab.params_removed if vocab else 0
    aligned = unit != "block" and width_mode == "uniform" and "mlp" in KINDS[unit]
    effective = alignment.effective_align(align, arch.intermediate) if aligned else 1
    planner = _Planner(arch, unit, width_mode, iterations, effective, protect_first, protect_last, serving or Serving())
    total, dense = full.num_params, planner.dense()
    limit = min(planner.max_removable(dense), math.floor(MAX_RATIO * total) - trimmed)
    limit = _largest_feasible(planner, limit)
    notes = []
    if aligned:
        note = alignment.clamp_note(align, arch.intermediate)
        if note:
            notes.append(note)
    floor = planner.final(limit) if limit > 0 else dense
    what = f"{arch.model_type} ({total:,} parameters), unit {unit}" + (f", {width_mode} widths" if unit != "block" else "")
    if limit <= 0:
        raise BudgetError(f"nothing can be removed from {what}: {arch.layers} layers with protect_first="
                          f"{protect_first} and protect_last={protect_last} leave no unit to prune; lower "
                          "--protect-first/--protect-last or prune width units")
    body_total = dense.layers * planner.block_params(dense)
    full_memory = planner.memory(Shape(total, dense.layers, dense.kv_heads, dense.intermediate))
    if target.kind in ("ratio", "layers"):
        to_remove = round(target.value * (total if target.kind == "ratio" else body_total)) - (
            trimmed if target.kind == "ratio" else 0)
        if to_remove > limit:
            of = total if target.kind == "ratio" else body_total
            most = limit + (trimmed if target.kind == "ratio" else 0)
            raise BudgetError(f"target {target} is infeasible for {what}: at most {most:,} parameters can be removed "
                              f"({most / total:.4f}) while every layer keeps a unit of each kind and protected layers "
                              f"stay whole", nearest=f"{target.kind}={math.floor(most / of * 1e4) / 1e4:g}")
    elif target.kind == "params":
        if target.value >= total:
            raise BudgetError(f"target {target} is not below the {total:,} parameters {arch.model_type} already has; "
                              "nothing to prune", nearest=f"params={floor.num_params}")
        to_remove = total - int(target.value) - trimmed
        if to_remove > limit:
            raise BudgetError(f"target {target} is infeasible for {what}: the smallest model the run can reach has "
                              f"{floor.num_params:,} parameters", nearest=f"params={floor.num_params}")
        if unit == "block" and to_remove > 0:  # the nearest whole number of blocks (the selector rounds a block budget up)
            block = planner.block_params(dense)
            to_remove = min(max(1, round(to_remove / block)) * block, limit)
    else:
        if full_memory <= target.value:
            raise BudgetError(f"target {target}: the dense model already takes {format_bytes(full_memory)}; "
                              "nothing to prune", nearest=f"memory={format_bytes(full_memory)}")
        if planner.memory(floor) > target.value:
            smallest = planner.memory(floor)
            raise BudgetError(f"target {target} is infeasible for {what}: the smallest model the run can reach takes "
                              f"{format_bytes(smallest)}", nearest=f"memory={format_bytes(smallest, up=True)}")
        to_remove = 0 if planner.memory(dense) <= target.value else _smallest_fitting(planner, limit, target.value)
    if vocab and to_remove <= 0:
        raise BudgetError(f"target {target}: the {vocab.describe(total)} already meets it, so no unit would be pruned; "
                          "trim the vocabulary alone (pipprune trim-vocab) or ask for more",
                          nearest=f"ratio={math.ceil((trimmed + planner.granularity(dense)) / total * 1e4) / 1e4:g}")
    to_remove = max(to_remove, 1)
    steps = planner.simulate(to_remove)
    final = steps[-1][2]
    return BudgetPlan(
        target=str(target), model_type=arch.model_type, unit=unit, width_mode=width_mode, iterations=iterations,
        dtype=arch.dtype, align=align, effective_align=effective,
        params_before=total, params_after=final.num_params, ratio=to_remove / arch.num_params,
        granularity=planner.granularity(dense), memory_before=full_memory, memory_after=planner.memory(final),
        kv_cache_after=planner.kv_cache(final), exact=unit == "block" or planner.uniform,
        body=BodyCut(dense.layers, final.layers, body_total, body_total - (arch.num_params - final.num_params),
                     dense.kv_heads, final.kv_heads, dense.intermediate, final.intermediate,
                     averaged=not (unit == "block" or planner.uniform)),
        steps=[StepPlan(i, cumulative, budget, s.num_params, s.layers, s.kv_heads, s.intermediate, planner.memory(s))
               for i, (cumulative, budget, s) in enumerate(steps, start=1)],
        notes=notes, vocab=vocab)


def _largest_feasible(planner: _Planner, limit: int) -> int:
    """The largest removal whose whole schedule runs (a later step may hit a limit the first does not)."""
    if limit <= 0 or planner.final(limit) is not None:
        return max(limit, 0)
    lo, hi = 0, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if planner.final(mid) is not None else (lo, mid)
    return lo


def _smallest_fitting(planner: _Planner, limit: int, budget: float) -> int:
    """The smallest removal whose final model fits `budget` bytes (memory falls as the removal grows)."""
    lo, hi = 0, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        shape = planner.final(mid)
        lo, hi = (lo, mid) if shape is not None and planner.memory(shape) <= budget else (mid, hi)
    while hi < limit and planner.memory(planner.final(hi)) > budget:  # guard: memory is only nearly monotone
        hi = min(limit, hi + planner.granularity(planner.dense()) // 4 + 1)
    return hi
