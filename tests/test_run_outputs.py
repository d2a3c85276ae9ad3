"""What a run hands on: the source's tokenizer byte for byte, dense log-probabilities from disk, the verdict."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from flows.records import quality_verdict
from infra.config import EvaluationSettings
from pip_core import io
from pip_core.divergence import CachedDense, divergence
from tasks.models import save_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)


def _tokenizer_bytes(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}


def test_saved_tokenizer_is_the_sources_whatever_ran_before(tiny_reference_dir, tmp_path):
    model, tok = io.load(tiny_reference_dir)
    tok(LONG, truncation=True, max_length=16)  # what calibration and evaluation do: it sets the backend's truncation
    assert tok.backend_tokenizer.truncation is not None
    io.save_pruned(model, tok, tmp_path / "out")
    assert _tokenizer_bytes(tmp_path / "out") == _tokenizer_bytes(tiny_reference_dir)
    assert "truncation" not in json.loads((tmp_path / "out" / "tokenizer.json").read_text()) or \
        json.loads((tmp_path / "out" / "tokenizer.json").read_text())["truncation"] is None
    from tokenizers import Tokenizer  # how Rust servers and converters read it

    assert len(Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).encode(LONG).ids) > 128


def test_a_reference_build_writes_no_truncation_into_its_tokenizer(tiny_reference_dir):
    data = json.loads((tiny_reference_dir / "tokenizer.json").read_text())
    assert data.get("truncation") is None and data.get("padding") is None


def test_two_runs_saving_the_same_step_at_once_both_succeed(tiny_reference_dir, tmp_path, monkeypatch):
    """Same weights from two runs whose tokenizers were used differently: one content-addressed name, no crash."""
    monkeypatch.setenv("PIPPRUNE_HOME", str(tmp_path / "home"))
    loaded = [io.load(tiny_reference_dir) for _ in range(2)]
    loaded[0][1](LONG, truncation=True, max_length=64)
    loaded[1][1](LONG, truncation=True, max_length=128)
    refs, errors = [], []

    def save(net, tok) -> None:
        try:
            refs.append(save_model(net, tok, "step-shared", sum(p.numel() for p in net.parameters())))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=save, args=pair) for pair in loaded]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len({r.fingerprint for r in refs}) == 1
    assert _tokenizer_bytes(tmp_path / "home" / "work" / "models" / "step-shared") == _tokenizer_bytes(tiny_reference_dir)


def test_cached_dense_log_probabilities_give_the_live_models_figures(tiny_reference_dir, tmp_path):
    dense, tok = io.load(tiny_reference_dir, dtype=torch.float32)
    pruned, _ = io.load(tiny_reference_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in pruned.model.layers[2].parameters():
            p.mul_(0.5)
    texts = ["Emma Woodhouse, handsome, clever, and rich, with a comfortable home.",
             "It was a bright cold day in April, and the clocks were striking thirteen."]
    cached = CachedDense.build(dense, tok, texts, 64, tmp_path / "cache")
    live, from_disk = divergence(dense, pruned, tok, texts, 64), divergence(cached, pruned, tok, texts, 64)
    assert from_disk == pytest.approx(live, rel=1e-9, abs=1e-12) and live["kl"] > 0
    # written and read in other slices: the same figures up to BLAS rounding of the smaller matrix products
    sliced = CachedDense.build(dense, tok, texts, 64, tmp_path / "sliced", chunk_tokens=5)
    assert divergence(sliced, pruned, tok, texts, 64, chunk_tokens=3) == pytest.approx(live, rel=1e-5)
    ids = tok(texts[0], return_tensors="pt", truncation=True, max_length=64)["input_ids"][0]
    whole = torch.from_numpy(np.load(tmp_path / "sliced" / "doc-00000.npy"))  # a plain .npy file
    assert whole.shape == (len(ids) - 1, dense.config.vocab_size)
    assert torch.equal(sliced.logprobs(0, ids), whole) and torch.equal(sliced.logprobs(0, ids, slice(2, 7)), whole[2:7])
    with pytest.raises(Exception, match="other tokens"):
        divergence(CachedDense.open(tmp_path / "cache"), pruned, tok, list(reversed(texts)), 64)
    # the quick eval reads the dense perplexity from the cache and the pruned one from the divergence pass
    from pip_core.perplexity import perplexity

    assert cached.mean_nll() == pytest.approx(perplexity(dense, tok, texts, max_length=64)["nll"], rel=1e-6)
    assert live["ppl_pruned"] == pytest.approx(perplexity(pruned, tok, texts, max_length=64)["perplexity"], rel=1e-6)


def test_quality_verdict_names_what_failed():
    gate = EvaluationSettings(max_kl=1.0, max_ppl_ratio=2.0)
    assert quality_verdict(gate, {"heldout_kl": 0.4, "heldout_ppl_ratio": 1.3})["verdict"] == "usable"
    bad = quality_verdict(gate, {"heldout_kl": 2.95, "heldout_ppl_ratio": 16.5})
    assert bad["verdict"] == "not usable" and len(bad["reasons"]) == 2 and "2.95" in bad["reasons"][0]
    assert quality_verdict(gate, {})["verdict"] == "not measured"
    off = EvaluationSettings(max_kl=None, max_ppl_ratio=None, min_distinct_ratio=None)
    assert quality_verdict(off, {"heldout_kl": 9.0})["verdict"] == "usable"
