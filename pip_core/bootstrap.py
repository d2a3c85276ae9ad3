"""Paired bootstrap over held-out documents: intervals for a metric and verdicts for a difference.

Documents, not tokens, are resampled, because tokens of one document are not independent. Two
methods compared on the same documents share each resample (paired), so the interval of their
difference excludes the document-to-document variance both see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pip_core.divergence import DocStats
from pip_core.errors import PipCoreError


@dataclass(frozen=True)
class Interval:
    point: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"point": self.point, "low": self.low, "high": self.high}


def resample_weights(n_docs: int, n_boot: int, seed: int) -> torch.Tensor:
    """[n_boot x n_docs] multiplicities of a with-replacement resample of the documents."""
    if n_docs < 2:
        raise PipCoreError(f"a bootstrap over documents needs at least 2 documents, got {n_docs}")
    if n_boot < 10:
        raise PipCoreError(f"n_boot must be >= 10, got {n_boot}")
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, n_docs, (n_boot, n_docs), generator=gen)
    return torch.zeros(n_boot, n_docs, dtype=torch.float64).scatter_add_(
        1, picks, torch.ones(n_boot, n_docs, dtype=torch.float64))


def _percentile(values: torch.Tensor, level: float) -> tuple[float, float]:
    alpha = (1 - level) / 2
    q = torch.quantile(values, torch.tensor([alpha, 1 - alpha], dtype=values.dtype))
    return float(q[0]), float(q[1])


def _values(stats: DocStats, weights: torch.Tensor, metric: str) -> torch.Tensor:
    """`metric` for every resample at once (rows of `weights`)."""
    n = weights @ stats.tokens
    if metric == "kl":
        return (weights @ stats.kl) / n
    if metric == "top1_agreement":
        return (weights @ stats.agree) / n
    if metric == "ppl_ratio":
        return torch.exp((weights @ stats.nll_pruned - weights @ stats.nll_dense) / n)
    if metric == "ppl_pruned":
        return torch.exp((weights @ stats.nll_pruned) / n)
    raise PipCoreError(f"no bootstrap for metric {metric!r}; use kl, top1_agreement, ppl_ratio or ppl_pruned")


def interval(stats: DocStats | Sequence[DocStats], metric: str, n_boot: int = 2000, seed: int = 0,
             level: float = 0.95) -> Interval:
    """Percentile interval of `metric` (a key of DocStats.metrics) over document resamples.

    Given a sequence (one DocStats per seed, same documents), the metric is the mean over seeds and
    every seed shares each resample of the documents.
    """
    stats_list = [stats] if isinstance(stats, DocStats) else list(stats)
    if not stats_list:
        raise PipCoreError("an interval needs at least one measurement")
    if any(not torch.equal(s.tokens, stats_list[0].tokens) for s in stats_list):
        raise PipCoreError("pooling over seeds needs the same held-out documents for every seed (token counts differ)")
    weights = resample_weights(len(stats_list[0].tokens), n_boot, seed)
    values = sum(_values(s, weights, metric) for s in stats_list) / len(stats_list)
    low, high = _percentile(values, level)
    return Interval(sum(s.metrics()[metric] for s in stats_list) / len(stats_list), low, high)


def paired_difference(a: DocStats | Sequence[DocStats], b: DocStats | Sequence[DocStats], metric: str,
                      n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> Interval:
    """Interval of metric(a) - metric(b) when both were measured on the same documents.

    Given sequences (one DocStats per seed), the metric is the mean over seeds, and each resample of
    the documents is shared by every seed and both sides, so seed-to-seed variation enters the
    point estimate while the interval stays paired over documents.
    """
    a_list = [a] if isinstance(a, DocStats) else list(a)
    b_list = [b] if isinstance(b, DocStats) else list(b)
    if not a_list or not b_list:
        raise PipCoreError("paired comparison needs at least one measurement on each side")
    tokens = a_list[0].tokens
    if any(not torch.equal(s.tokens, tokens) for s in a_list + b_list):
        raise PipCoreError("paired comparison needs the same held-out documents for both (token counts differ)")
    weights = resample_weights(len(tokens), n_boot, seed)

    def mean(stats: list[DocStats], w: torch.Tensor | None) -> torch.Tensor | float:
        if w is None:
            return sum(s.metrics()[metric] for s in stats) / len(stats)
        return sum(_values(s, w, metric) for s in stats) / len(stats)

    diffs = mean(a_list, weights) - mean(b_list, weights)
    low, high = _percentile(diffs, level)
    return Interval(mean(a_list, None) - mean(b_list, None), low, high)


def verdict(diff: Interval, lower_is_better: bool = True) -> str:
    """'better', 'worse' or 'indistinguishable' for a (a - b) interval: does it exclude 0?"""
    if diff.high < 0:
        return "better" if lower_is_better else "worse"
    if diff.low > 0:
        return "worse" if lower_is_better else "better"
    return "indistinguishable"
