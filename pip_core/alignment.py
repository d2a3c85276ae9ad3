"""Hardware-aligned uniform widths: how many units of each kind a uniform cut may remove.

GPU matmul kernels run at full speed only when a dimension is a multiple of the tile size; a
pruned MLP of 11007 channels can be slower than the dense 11008. So in uniform width mode every
layer keeps a multiple of `align` MLP channels. Attention units are whole KV groups with the
query heads that share them, so the kept head count stays a multiple of the group size (what the
stock class and serving engines require) whatever `align` is.

The selector (`prune.select_uniform`) and the budget planner (`pip_core.budget`) both call
`uniform_cuts`, so what `pipprune plan` prints is what a run removes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: an aligned MLP keeps at least this many aligned widths to choose from; a narrower model halves `align`
MIN_ALIGNED_WIDTHS = 4


def effective_align(align: int, intermediate: int) -> int:
    """`align`, halved until `intermediate` holds MIN_ALIGNED_WIDTHS multiples of it (a tiny model
    under the default 64 would otherwise have one or two widths to choose from)."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    eff = align
    while eff > 1 and intermediate // eff < MIN_ALIGNED_WIDTHS:
        eff //= 2
    return eff


def clamp_note(align: int, intermediate: int) -> str | None:
    """The log line saying that `align` was clamped for this width, or None when it was not."""
    eff = effective_align(align, intermediate)
    if eff == align:
        return None
    return (f"align {align} clamped to {eff}: intermediate_size {intermediate} holds fewer than "
            f"{MIN_ALIGNED_WIDTHS} multiples of {align}")


def allowed_cuts(kind: str, width: int, align: int) -> list[int]:
    """Ascending unit counts one uniform cut may remove from a layer of `width` units of `kind`.

    Attention: any number of whole KV groups, one kept. MLP: what leaves a multiple of `align`
    (at least one aligned block kept); 0 keeps the current width. `align` is used as given: callers
    clamp it once, against the source width (`effective_align`), so every step keeps the same grid.
    """
    if kind != "mlp" or align <= 1:
        return list(range(width))
    kept = range((width // align) * align, 0, -align)
    return sorted({0, *(width - k for k in kept)})


@dataclass(frozen=True)
class KindCut:
    """One kind in a uniform cut: parameters one unit removed from every layer costs, and the options."""

    step: int
    width: int
    options: tuple[int, ...]

    @property
    def granularity(self) -> int:
        """Parameters between two neighbouring options (the coarsest gap)."""
        gaps = [b - a for a, b in zip(self.options, self.options[1:], strict=False)] or [1]
        return self.step * max(gaps)

    @property
    def max_params(self) -> int:
        return self.step * self.options[-1]

    def nearest(self, params: float) -> int:
        return min(self.options, key=lambda c: (abs(c * self.step - params), c))


def kind_cuts(steps: Mapping[str, int], widths: Mapping[str, int], align: int) -> dict[str, KindCut]:
    return {k: KindCut(steps[k], widths[k], tuple(allowed_cuts(k, widths[k], align))) for k in steps}


def uniform_cuts(kinds: Mapping[str, KindCut], target_params: int) -> dict[str, int]:
    """Units of each kind to cut from every layer for `target_params`: each kind gets its share in
    proportion to its parameters, rounded to its nearest option; the finest kind (smallest
    granularity) goes last and absorbs the rounding of the others."""
    full = sum(c.step * c.width for c in kinds.values())
    order = sorted(kinds, key=lambda k: kinds[k].granularity, reverse=True)
    cuts: dict[str, int] = {}
    remaining = target_params
    for n, kind in enumerate(order):
        c = kinds[kind]
        share = remaining if n == len(order) - 1 else target_params * c.step * c.width / full
        cuts[kind] = c.nearest(share)
        remaining -= cuts[kind] * c.step
    return cuts
