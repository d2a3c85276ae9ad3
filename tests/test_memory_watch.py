"""The run's memory figures: the allocator fixed at the start, the peak against the baseline before any model."""

from __future__ import annotations

import platform

import pytest

from infra.memory import MemoryWatch, fix_allocator, peak_bytes, resident_bytes


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_allocator_is_fixed_on_glibc():
    assert fix_allocator() is True
    assert MemoryWatch.start().allocator_fixed is True


def test_figures_split_the_peak_into_baseline_and_the_runs_own():
    watch = MemoryWatch.start()
    assert 0 < watch.baseline_bytes <= resident_bytes() + 64 * 2**20
    weights = 100 * 2**20
    figures = watch.figures(weights)
    peak = figures["run.peak_rss_bytes"]
    assert peak >= watch.baseline_bytes and peak <= peak_bytes()
    assert figures["run.peak_rss_over_weights"] == pytest.approx(peak / weights)
    assert figures["run.run_memory_over_weights"] == pytest.approx((peak - watch.baseline_bytes) / weights)
    assert figures["run.baseline_rss_bytes"] == watch.baseline_bytes and figures["run.weights_bytes"] == weights
