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


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/maps")
def test_loaded_weights_live_outside_the_checkpoints_memory_map(tiny_reference_dir):
    """transformers leaves CPU weights as views of the mapped safetensors file (so pruned blocks would stay resident);
    pipprune's loader gives each its own memory, with the same values."""
    import torch
    from transformers import AutoModelForCausalLM

    from pip_core import io as core_io
    from pip_core.weights_memory import _file_mappings

    def mapped(model: torch.nn.Module) -> int:
        ranges = _file_mappings()
        return sum(any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in model.parameters())

    plain = AutoModelForCausalLM.from_pretrained(tiny_reference_dir, dtype=torch.float32).eval()
    assert mapped(plain) > 0  # what the loader has to undo
    net, _ = core_io.load(tiny_reference_dir, dtype=torch.float32)
    assert mapped(net) == 0
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        assert torch.equal(net(ids).logits, plain(ids).logits)


#: run in a fresh interpreter: a test process's heap, grown by other tests, would serve the blocks without faults
_ROOMY_PROBE = """
import json, resource
import torch
from infra.memory import fix_allocator, roomy_allocator

def faults(n=50, mib=1):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        torch.ones(mib * 2**18)  # written whole, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

fix_allocator()
low = faults()
with roomy_allocator():
    faults(1)  # the first block grows the heap once
    roomy = faults()
print(json.dumps({"low": low, "roomy": roomy, "after": faults(20, mib=8)}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_forward_only_stage_reuses_freed_blocks_and_the_low_threshold_comes_back():
    """Inside roomy_allocator a freed 1 MiB block is reused (few fresh page faults); after it the threshold is low
    again, so a block larger than any freed one is mapped, and faulted in, afresh each time."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _ROOMY_PROBE], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["low"] >= 50 * 200  # 256 pages a block, mapped anew each time
    assert seen["roomy"] < seen["low"] / 4
    assert seen["after"] >= 20 * 1800  # 2048 pages a block
