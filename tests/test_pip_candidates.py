"""The block-removal PIP form against a naive reference on a small hand-built Llama, and the divergence
benchmark's fresh-perturbation schedule and dense cache."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from pip_core import importance, units
from pip_core.errors import PipCoreError
from pip_core.importance import CalibrationData
from tests.test_pip_core import PAIRS, _train, llama, tok  # noqa: F401 - tok is a fixture

#: pairs whose edits keep and change the token count (both kinds of span for the alignment)
REPR_PAIRS = [*PAIRS, ("She wrote a long letter to her sister.", "She wrote a song letter to her sisters today.")]


@pytest.fixture(scope="module")
def model(tok):  # noqa: F811
    return _train(llama(tok, seed=3), tok)


def test_fresh_pairs_redraw_the_perturbation_only(tmp_path):
    from benchmarks.common import calibration_pairs
    from benchmarks.divergence import fresh_pairs

    (tmp_path / "calibration").mkdir()
    texts = [f"The host said he would come later to the party number {i} at the old house." for i in range(6)]
    (tmp_path / "calibration" / "calibration.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "calibration" / "wordlist.txt").write_text("\n".join(
        ["the", "host", "ghost", "post", "said", "sail", "would", "could", "come", "came", "later", "alter", "party",
         "parts", "house", "horse", "mouse", "old", "odd", "gold", "number", "he", "to", "at"]) + "\n")
    default, _ = calibration_pairs(tmp_path, 4, seed=1)
    step = fresh_pairs(tmp_path, 4, seed=1)
    assert step(1) == default
    assert [o for o, _ in step(2)] == [o for o, _ in default] and step(2) != default and step(2) == step(2)


def test_cached_dense_gives_the_same_divergence(tok, model):  # noqa: F811
    from benchmarks.divergence import CachedDense
    from pip_core import prune
    from pip_core.divergence import doc_stats

    pruned = copy.deepcopy(model)
    prune.apply(pruned, [u for u in units.discover(pruned, "block") if u.layer == 1])
    texts = ["A cat sat on the mat near the door.", "Every guest brought bread and wine before the night."]
    dense = CachedDense(model)
    plain = doc_stats(model, pruned, tok, texts).to_json()
    assert doc_stats(dense, pruned, tok, texts).to_json() == plain
    assert len(dense.cache.memo) == 2 and doc_stats(dense, pruned, tok, texts).to_json() == plain


def test_pip_removal_equals_naive_first_order_gap(tok, model):  # noqa: F811
    """pip_removal = mean over pairs of |<dL(s)/dh_out, h_out - h_in>(s) - (same)(s~)| per block; its single-view
    ablation the mean of the clean view's term's absolute value."""
    m = copy.deepcopy(model)
    found = units.discover(m, "block")
    fast = importance.score(m, "pip_removal", found, CalibrationData(tok, REPR_PAIRS), progress=False)
    single = importance.score(m, "pip_removal_single_view", found, CalibrationData(tok, REPR_PAIRS), progress=False)
    naive = torch.zeros(len(found) - 1, dtype=torch.float64)
    naive_single = torch.zeros(len(found) - 1, dtype=torch.float64)
    for pair in REPR_PAIRS:
        t = []
        for text in pair:
            ids = tok(text, return_tensors="pt")["input_ids"]
            out = m(input_ids=ids, output_hidden_states=True)
            hs = out.hidden_states
            for h in hs:
                h.retain_grad()
            torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:]).backward()
            t.append(torch.stack([(hs[i + 1].grad.double() * (hs[i + 1] - hs[i]).detach().double()).sum()
                                  for i in range(len(hs) - 2)]))
            m.zero_grad()
        naive += (t[0] - t[1]).abs()
        naive_single += t[0].abs()
    torch.testing.assert_close(fast[:-1], naive / len(REPR_PAIRS), rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(single[:-1], naive_single / len(REPR_PAIRS), rtol=1e-4, atol=1e-8)
    assert all(p.grad is None for p in m.parameters())
    with pytest.raises(PipCoreError, match="whole blocks"):
        importance.score(m, "pip_removal", units.discover(m, "mlp"), CalibrationData(tok, PAIRS), progress=False)
