"""Distribution metrics against the dense model and their bootstrap intervals, on the real tiny reference."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from pip_core import bootstrap, io, prune, units
from pip_core.divergence import DocStats, divergence, doc_stats, read_texts
from pip_core.errors import PipCoreError
from pip_core.importance import CalibrationData
from tests.helpers import pair_gradients, unit_view_differences


@pytest.fixture(scope="module")
def dense(tiny_reference_dir):
    model, tokenizer = io.load(tiny_reference_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def heldout(tiny_reference_dir) -> list[str]:
    return read_texts(tiny_reference_dir / "tasks" / "persuasion.jsonl")[:12]


def _without_block(model, layer: int):
    pruned = copy.deepcopy(model)
    prune.apply(pruned, [u for u in units.discover(pruned, "block") if u.layer == layer])
    return pruned


def _width_pruned(model):
    """One attention group of layer 2 and half the MLP channels of layers 1-3 (KL 0.005 on the suite's tiny model:
    a tenth of that left too little difference for the comparison to prove anything)."""
    pruned = copy.deepcopy(model)
    found = [u for u in units.discover(pruned, "width") if u.layer in (1, 2, 3)]
    chosen = [u for u in found if u.kind == "attn" and u.layer == 2][:1]
    for layer in (1, 2, 3):
        mlp = [u for u in found if u.kind == "mlp" and u.layer == layer]
        chosen += mlp[: len(mlp) // 2]
    prune.apply(pruned, chosen)
    return pruned


@torch.no_grad()
def _unchunked(dense_model, pruned_model, tokenizer, texts, max_length=256) -> dict[str, float]:
    """Reference: full [tokens x vocab] logits from the models' own forward, all documents pooled."""
    kl = agree = nll_d = nll_p = n = 0.0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
        logp_d = torch.log_softmax(dense_model(input_ids=ids).logits[0, :-1].double(), -1)
        logp_p = torch.log_softmax(pruned_model(input_ids=ids).logits[0, :-1].double(), -1)
        t = ids[0, 1:].unsqueeze(-1)
        kl += float(torch.nn.functional.kl_div(logp_p, logp_d, log_target=True, reduction="sum"))
        agree += float((logp_d.argmax(-1) == logp_p.argmax(-1)).sum())
        nll_d -= float(logp_d.gather(-1, t).sum())
        nll_p -= float(logp_p.gather(-1, t).sum())
        n += t.numel()
    return {"kl": kl / n, "top1_agreement": agree / n, "ppl_ratio": math.exp((nll_p - nll_d) / n)}


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_metrics_equal_unchunked_reference(dense, heldout, chunk):
    model, tokenizer = dense
    pruned = _width_pruned(model)
    got = divergence(model, pruned, tokenizer, heldout, chunk_tokens=chunk)
    want = _unchunked(model, pruned, tokenizer, heldout)
    assert want["kl"] > 1e-3, "the pruned model must differ, or the comparison proves nothing"
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


def test_kl_of_dense_against_itself_is_zero_and_grows_when_a_block_is_removed(dense, heldout):
    model, tokenizer = dense
    same = divergence(model, copy.deepcopy(model), tokenizer, heldout)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6)
    assert same["top1_agreement"] == 1.0
    assert same["ppl_ratio"] == pytest.approx(1.0, abs=1e-9)
    one = divergence(model, _without_block(model, 2), tokenizer, heldout)
    two = divergence(model, _without_block(_without_block(model, 3), 2), tokenizer, heldout)
    assert 0.0 < one["kl"] < two["kl"]
    assert one["top1_agreement"] < 1.0 and one["ppl_ratio"] > 1.0


def test_bootstrap_interval_contains_point_and_paired_verdicts(dense, heldout):
    model, tokenizer = dense
    one = doc_stats(model, _without_block(model, 2), tokenizer, heldout)
    two = doc_stats(model, _without_block(_without_block(model, 3), 2), tokenizer, heldout)
    for metric in ("kl", "top1_agreement", "ppl_ratio"):
        ci = bootstrap.interval(one, metric, n_boot=500)
        assert ci.low <= ci.point <= ci.high and ci.low < ci.high, metric
    assert bootstrap.interval(one, "kl", n_boot=500) == bootstrap.interval(one, "kl", n_boot=500)  # seeded
    diff = bootstrap.paired_difference(one, two, "kl", n_boot=500)
    assert diff.point < 0 and bootstrap.verdict(diff) == "better"
    assert bootstrap.verdict(bootstrap.paired_difference(two, one, "kl", n_boot=500)) == "worse"
    assert bootstrap.verdict(bootstrap.paired_difference(one, one, "kl", n_boot=500)) == "indistinguishable"
    assert bootstrap.verdict(diff, lower_is_better=False) == "worse"
    pooled = bootstrap.paired_difference([one, one], [two, two], "kl", n_boot=500)
    assert pooled.point == pytest.approx(diff.point) and pooled.low <= pooled.point <= pooled.high
    other = doc_stats(model, _without_block(model, 2), tokenizer, heldout[:5])
    with pytest.raises(PipCoreError, match="same held-out documents"):
        bootstrap.paired_difference(one, other, "kl")


def test_doc_stats_round_trip_json(dense, heldout):
    model, tokenizer = dense
    stats = doc_stats(model, _without_block(model, 2), tokenizer, heldout[:3])
    again = DocStats.from_json(json.loads(json.dumps(stats.to_json())))
    assert again.metrics() == stats.metrics()


def test_bad_inputs_are_named(dense, tmp_path):
    model, tokenizer = dense
    with pytest.raises(PipCoreError, match="at least one held-out text"):
        divergence(model, model, tokenizer, [])
    with pytest.raises(PipCoreError, match="shorter than 2 tokens"):
        divergence(model, model, tokenizer, [""])
    with pytest.raises(PipCoreError, match="chunk_tokens"):
        divergence(model, model, tokenizer, ["some text here"], chunk_tokens=0)
    with pytest.raises(PipCoreError, match="does not exist"):
        read_texts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no"}\n')
    with pytest.raises(PipCoreError, match=r"bad.jsonl:2 has no string field 'text'"):
        read_texts(bad)
    plain = tmp_path / "plain.txt"
    plain.write_text("first document\nstill first\n\nsecond document\n")
    assert read_texts(plain) == ["first document\nstill first", "second document"]
    stats = DocStats(*[torch.ones(1, dtype=torch.float64) for _ in range(5)])
    with pytest.raises(PipCoreError, match="at least 2 documents"):
        bootstrap.interval(stats, "kl")
    with pytest.raises(PipCoreError, match="no bootstrap for metric"):
        bootstrap.interval(DocStats(*[torch.ones(3, dtype=torch.float64) for _ in range(5)]), "nope")


def test_eval_cli_reports_kl_to_reference_with_intervals(dense, tiny_reference_dir, tmp_path):
    import os

    from tests.helpers import cli

    model, tokenizer = dense
    io.save_pruned(_without_block(model, 2), tokenizer, tmp_path / "pruned")
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"text": t}) + "\n"
                               for t in read_texts(tiny_reference_dir / "tasks" / "persuasion.jsonl")[:6]))
    env = {**os.environ, "PIPPRUNE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    run = cli(env, "eval", "--model", str(tmp_path / "pruned"), "--reference", str(tiny_reference_dir),
              "--heldout", str(heldout))
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)["results"]["divergence"]
    assert got["documents"] == 6 and got["kl"] > 0 and got["kl_ci95_low"] <= got["kl"] <= got["kl_ci95_high"]
    assert 0 < got["top1_agreement"] < 1 and got["ppl_ratio"] > 1 and len(got["heldout_sha256"]) == 64
    missing = cli(env, "eval", "--model", str(tmp_path / "pruned"), "--reference", str(tmp_path / "nope"))
    assert missing.returncode != 0 and "reference model directory not found" in missing.stderr + missing.stdout


def test_pip_first_order_form_equals_naive_reference(dense):
    """pip_first_order = mean over pairs of sum over the unit of |w * (grad L(s) - grad L(s~))|."""
    from pip_core import importance

    model, tokenizer = dense
    model = copy.deepcopy(model)
    pairs = [("She was not in the room when he came in.", "She was not in the rome when he come in."),
             ("They walked to the village after dinner.", "They walked to the pillage after dinner.")]
    found = units.discover(model, "width")
    fast = importance.score(model, "pip_first_order", found, CalibrationData(tokenizer, pairs), progress=False)
    literal = importance.score(model, "pip_l2", found, CalibrationData(tokenizer, pairs), progress=False)
    per_pair = [pair_gradients(model, tokenizer, pair) for pair in pairs]
    naive = torch.tensor([[sum(float((d * w).double().abs().sum()) for d, w in unit_view_differences(model, unit, grads))
                           for unit in found] for grads in per_pair], dtype=torch.float64).sum(0)
    naive /= len(pairs)
    torch.testing.assert_close(fast, naive, rtol=1e-4, atol=1e-9)
    assert not torch.allclose(fast / fast.sum(), literal / literal.sum())
    single = importance.score(model, "pip_single_view", found, CalibrationData(tokenizer, pairs), progress=False)
    other_view = [(o, "Completely different words here.") for o, _ in pairs]
    torch.testing.assert_close(single, importance.score(model, "pip_single_view", found,
                                                        CalibrationData(tokenizer, other_view), progress=False),
                               rtol=1e-5, atol=1e-9)
    assert not torch.allclose(single, literal)
    with pytest.raises(PipCoreError, match="unknown PIP form"):
        importance.pert_import(model, tokenizer, pairs, found, form="l1")
