"""Calibration from the model itself (sampled texts, the words of its vocabulary), mixed calibration sources, and
the forward-only width baselines (Minitron's activation norm, structured Wanda) against naive references."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from infra.calibration import CalibrationDataError, parse_sources
from pip_core import importance, units
from pip_core.errors import PipCoreError
from pip_core.importance import CalibrationData
from pip_core.self_calibration import sampled_texts, vocabulary_words
from tests.test_pip_core import SENTENCES, _train, llama, tok  # noqa: F401 - tok is a fixture


@pytest.fixture(scope="module")
def model(tok):  # noqa: F811
    return _train(llama(tok, seed=5), tok)


def test_sources_parse_into_weights_that_sum_to_one():
    assert parse_sources("self") == [("self", 1.0)]
    assert parse_sources("calib.jsonl") == [("calib.jsonl", 1.0)]
    assert parse_sources("self:1,calib.jsonl:3") == [("self", 0.25), ("calib.jsonl", 0.75)]
    assert parse_sources("/data/v1:2024/calib.jsonl") == [("/data/v1:2024/calib.jsonl", 1.0)]  # ':' in a path
    for bad in ("self:0", "calib.jsonl:-1", "self,", "self:nan"):
        with pytest.raises(CalibrationDataError, match="SOURCE:WEIGHT"):
            parse_sources(bad)


def test_sampled_texts_are_seeded_and_leave_the_global_rng_alone(tok, model):  # noqa: F811
    state = torch.random.get_rng_state()
    a = sampled_texts(model, tok, 5, 24, seed=3, batch_size=4, min_chars=1, progress=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert a == sampled_texts(model, tok, 5, 24, seed=3, batch_size=4, min_chars=1, progress=False)
    assert a != sampled_texts(model, tok, 5, 24, seed=4, batch_size=4, min_chars=1, progress=False)
    assert len(a) == 5 and all(isinstance(t, str) and t for t in a)
    assert model.training is False


class _Continuations(torch.nn.Module):
    """A model that after token `t` puts all its probability on `next_of[t]` (the boundary rule's own test)."""

    def __init__(self, vocab_size: int, next_of: dict[int, int]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.vocab_size, self.next_of = vocab_size, next_of

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> SimpleNamespace:
        logits = torch.full((input_ids.shape[0], 1, self.vocab_size), -1e9)
        for row, token in enumerate(input_ids[:, -1].tolist()):
            logits[row, 0, self.next_of.get(token, 0)] = 0.0
        return SimpleNamespace(logits=logits)


def test_vocabulary_words_keep_tokens_the_model_ends_as_words(tok):  # noqa: F811
    vocab = tok.get_vocab()
    word_start = {t[1:]: i for t, i in vocab.items() if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower()
                  and len(t) > 3}
    continuation = next(i for t, i in vocab.items() if t.isalpha() and t.islower())  # no marker: inside a word
    boundary = vocab["Ġ" + next(iter(word_start))]
    fragments = set(sorted(word_start)[::2])  # every other word-initial token: the model continues it
    fake = _Continuations(len(tok), {i: continuation if w in fragments else boundary for w, i in word_start.items()})
    found = vocabulary_words(fake, tok, batch_size=3)
    assert found.words == set(word_start) - fragments and fragments
    among = sorted(set(word_start) - fragments)[:2]
    assert vocabulary_words(fake, tok, among=[*among, "notaword"]).words == set(among)


def _consumer_inputs(model, tokenizer, texts):
    """Per layer, the inputs of o_proj and down_proj over every token of `texts` (one text at a time)."""
    seen: dict[tuple[str, int], list[torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for kind, module in (("attn", layer.self_attn.o_proj), ("mlp", layer.mlp.down_proj)):
            handles.append(module.register_forward_pre_hook(
                lambda m, a, key=(kind, i): seen.setdefault(key, []).append(a[0][0].double())))
    with torch.no_grad():
        for text in texts:
            model(**tokenizer(text, return_tensors="pt"))
    for h in handles:
        h.remove()
    return {k: torch.cat(v) for k, v in seen.items()}


def test_minitron_and_wanda_sp_equal_naive_references(tok, model):  # noqa: F811
    m = copy.deepcopy(model)
    found = units.discover(m, "width")
    data = CalibrationData(tok, texts=SENTENCES[:4])
    minitron = importance.score(m, "minitron", found, data, progress=False)
    wanda = importance.score(m, "wanda_sp", found, data, progress=False)
    x = _consumer_inputs(m, tok, SENTENCES[:4])
    tokens = x[("attn", 0)].shape[0]
    head_dim, group = m.config.head_dim, m.config.num_attention_heads // m.config.num_key_value_heads
    for row, u in enumerate(found):
        acts = x[(u.kind, u.layer)]
        layer = m.model.layers[u.layer]
        if u.kind == "attn":
            cols = slice(u.index * group * head_dim, (u.index + 1) * group * head_dim)
            weight = layer.self_attn.o_proj.weight
        else:
            cols = slice(u.index, u.index + 1)
            weight = layer.mlp.down_proj.weight
        naive_minitron = acts[:, cols].norm(dim=1).sum() / tokens
        naive_wanda = (acts[:, cols].norm(dim=0) * weight[:, cols].double().abs().sum(0)).sum()
        torch.testing.assert_close(minitron[row], naive_minitron, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(wanda[row], naive_wanda, rtol=1e-6, atol=1e-9)
    with pytest.raises(PipCoreError, match="attention groups and MLP channels"):
        importance.score(m, "minitron", units.discover(m, "block"), data, progress=False)


def test_minitron_shards_add_up_to_the_whole_set(tok, model):  # noqa: F811
    found = units.discover(model, "width")
    whole = importance.score(model, "minitron", found, CalibrationData(tok, texts=SENTENCES[:4]), progress=False)
    parts = [importance.score_sums(model, "minitron", found, CalibrationData(tok, texts=SENTENCES[i:i + 2]),
                                   progress=False) for i in (0, 2)]
    torch.testing.assert_close(importance.reduce_sums(parts), whole)


def test_a_model_without_calibration_data_defaults_to_self_and_distillation(tok, model, tmp_path):  # noqa: F811
    from pipprune.commands.compress import _compress_config

    model.save_pretrained(tmp_path / "pretrained")
    tok.save_pretrained(tmp_path / "pretrained")
    cfg = _compress_config(str(tmp_path / "pretrained"), None, None, None, None, {"ratio": 0.2})
    assert cfg.calibration.source == "self" and cfg.scoring.method == "wanda_sp"
    assert (cfg.recovery.kind, cfg.recovery.steps) == ("kd", 40)
    off = _compress_config(str(tmp_path / "pretrained"), None, None, None, None, {"recovery": {"steps": 0},
                                                                                   "method": "pip"})
    assert off.calibration.source == "self" and not off.recovery.enabled and off.scoring.method == "pip"
    blocks = _compress_config(str(tmp_path / "pretrained"), None, None, None, None, {"unit": "block"})
    assert blocks.scoring.method == "pip" and blocks.recovery.enabled  # wanda_sp scores width units only
    mine = _compress_config(str(tmp_path / "pretrained"), None, "texts.txt", None, None, {})
    assert mine.calibration.source == "texts.txt" and not mine.recovery.enabled and mine.scoring.method == "pip"


@pytest.mark.stack
@pytest.mark.slow
def test_a_mixed_calibration_is_drawn_by_weight_kept_with_the_run_and_hashed_in_lineage(stack_env, tiny_reference_dir,
                                                                                        monkeypatch, tmp_path):
    import json

    from mlflow import MlflowClient

    from infra.calibration import calibration_hash, load_calibration
    from tests.test_compress_flow import _apply, _config, _run_flow

    _apply(stack_env, monkeypatch)
    spec = f"self:0.5,{tiny_reference_dir}:0.5"
    config = _config(tiny_reference_dir, calibration=spec, ratio=0.1, iterations=1, n_samples=6, heldout_samples=4,
                     eval_tasks=(), registered_model_name="tiny-selfcal")
    summary = _run_flow(stack_env, config)
    client = MlflowClient(stack_env["MLFLOW_TRACKING_URI"])
    kept = Path(client.download_artifacts(summary.mlflow_run_id, "calibration/calibration.jsonl", str(tmp_path)))
    rows = [json.loads(line) for line in kept.read_text().splitlines()]
    assert [r["source"] for r in rows].count("self") == 5 and [r["source"] for r in rows].count(str(tiny_reference_dir)) == 5
    assert client.download_artifacts(summary.mlflow_run_id, "calibration/wordlist.txt", str(tmp_path))
    version = client.get_model_version("tiny-selfcal", summary.model_version)
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.params["calibration.source"] == spec
    drawn = calibration_hash(load_calibration(kept, n_samples=10, seed=config.seed))  # what the pairs were made of
    assert version.tags["pipprune.calibration_hash"] == run.data.tags["pipprune.calibration_hash"] == drawn
