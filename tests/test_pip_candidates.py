"""The candidate PIP forms (relative gradient difference, representation-level difference) against naive
references on a small hand-built Llama, and the divergence benchmark's fresh-perturbation schedule and
dense cache."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from pip_core import importance, units
from pip_core.errors import PipCoreError
from pip_core.importance import CalibrationData
from tests.helpers import pair_gradients, unit_view_differences
from tests.test_pip_core import PAIRS, _train, llama, tok  # noqa: F401 - tok is a fixture

#: pairs whose edits keep and change the token count (both kinds of span for the alignment)
REPR_PAIRS = [*PAIRS, ("She wrote a long letter to her sister.", "She wrote a song letter to her sisters today.")]


@pytest.fixture(scope="module")
def model(tok):  # noqa: F811
    return _train(llama(tok, seed=3), tok)


def test_aligned_positions_pair_shared_tokens_and_same_length_edits():
    a = [1, 2, 3, 4, 5, 6]
    b = [1, 2, 9, 4, 7, 8, 6]  # 3 -> 9 keeps the count; 5 -> 7 8 changes it
    pa, pb = importance.aligned_positions(a, b)
    assert (pa, pb) == ([0, 1, 2, 3, 5], [0, 1, 2, 3, 6])
    assert importance.aligned_positions(a, a) == (list(range(6)), list(range(6)))


def test_pip_relative_equals_naive_ratio_per_pair(tok, model):  # noqa: F811
    """pip_relative = mean over pairs of ||grad L(s) - grad L(s~)||_u / ||grad L(s)||_u."""
    m = copy.deepcopy(model)
    found = units.discover(m, "width") + units.discover(m, "block")
    fast = torch.cat([importance.score(m, "pip_relative", found[:-4], CalibrationData(tok, PAIRS), progress=False),
                      importance.score(m, "pip_relative", found[-4:], CalibrationData(tok, PAIRS), progress=False)])
    naive = torch.zeros(len(found), dtype=torch.float64)
    for pair in PAIRS:
        grads = pair_gradients(m, tok, pair)
        for k, unit in enumerate(found):
            diff = sum(float(d.double().pow(2).sum()) for d, _ in unit_view_differences(m, unit, grads))
            clean = sum(float(g.double().pow(2).sum()) for g, _ in unit_view_differences(m, unit, [grads[0], {
                n: torch.zeros_like(t) for n, t in grads[0].items()}]))
            naive[k] += math.sqrt(diff) / math.sqrt(clean)
    naive /= len(PAIRS)
    torch.testing.assert_close(fast, naive, rtol=1e-4, atol=1e-7)
    literal = importance.score(m, "pip_l2", found[-4:], CalibrationData(tok, PAIRS), progress=False)
    assert not torch.allclose(fast[-4:] / fast[-4:].sum(), literal / literal.sum())


def _view_states(m, tok, text: str) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: F811
    """(input, output) hidden states of every decoder layer for `text` alone, from output_hidden_states."""
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hs = m(input_ids=ids, output_hidden_states=True).hidden_states
    # the last entry is after the final norm, so the last layer is checked separately (identity test)
    return [(hs[i][0].double(), hs[i + 1][0].double()) for i in range(len(hs) - 2)]


def test_pip_repr_forms_equal_naive_hidden_state_reference(tok, model):  # noqa: F811
    m = copy.deepcopy(model)
    found = units.discover(m, "block")
    fast = {f: importance.score(m, f"pip_{f}", found, CalibrationData(tok, REPR_PAIRS), progress=False)
            for f in ("repr", "repr_cos")}
    naive = {f: torch.zeros(len(found) - 1, dtype=torch.float64) for f in fast}
    for a, b in REPR_PAIRS:
        ids_a, ids_b = (tok(t)["input_ids"] for t in (a, b))
        pa, pb = importance.aligned_positions(ids_a, ids_b)
        for i, ((in_a, out_a), (in_b, out_b)) in enumerate(zip(_view_states(m, tok, a), _view_states(m, tok, b),
                                                                strict=True)):
            d_in, d_out = in_a[pa] - in_b[pb], out_a[pa] - out_b[pb]
            naive["repr"][i] += float((d_out - d_in).norm(dim=-1).sum() / d_in.norm(dim=-1).sum())
            cos = [float(torch.dot(x, y) / (x.norm() * y.norm())) for x, y in zip(d_in, d_out, strict=True)
                   if float(x.norm()) > 0]
            naive["repr_cos"][i] += sum(1 - c for c in cos) / len(cos) if cos else 0.0  # no edit kept its count
    for f in fast:
        torch.testing.assert_close(fast[f][:-1], naive[f] / len(REPR_PAIRS), rtol=1e-5, atol=1e-8)


def test_pip_repr_of_an_identity_block_is_zero(tok, model):  # noqa: F811
    """A block whose residual branches write nothing passes the views' difference through unchanged."""
    m = copy.deepcopy(model)
    layer = units.decoder_layers(m)[2]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    found = units.discover(m, "block")
    for form in ("pip_repr", "pip_repr_cos"):
        s = importance.score(m, form, found, CalibrationData(tok, REPR_PAIRS), progress=False)
        assert float(s[2]) == pytest.approx(0.0, abs=1e-7) and bool((s[[0, 1, 3]] > 1e-4).all())


def test_pip_repr_is_block_only(tok, model):  # noqa: F811
    from infra.config import ScoringSettings

    with pytest.raises(PipCoreError, match="whole blocks"):
        importance.score(model, "pip_repr", units.discover(model, "mlp"), CalibrationData(tok, PAIRS), progress=False)
    with pytest.raises(ValueError, match="scores whole blocks"):
        ScoringSettings(method="pip_repr", unit="width")
    with pytest.raises(PipCoreError, match="unknown representation form"):
        importance.repr_import(model, tok, PAIRS, units.discover(model, "block"), form="repr_l1")


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
