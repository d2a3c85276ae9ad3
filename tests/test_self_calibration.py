"""Calibration from the model itself (sampled texts, the words of its vocabulary), mixed calibration sources, and
the forward-only width baselines (Minitron's activation norm, structured Wanda) against naive references."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pip_core import importance, units
from pip_core.errors import CalibrationError, PipCoreError
from pip_core.importance import CalibrationData
from pip_core.self_calibration import (
    FIRST_KEEP_RATE,
    LOGIT_COPIES,
    Sample,
    SamplingOptions,
    decode,
    distinct_ratio,
    lowest_perplexity,
    nucleus_sample,
    sampled_texts,
    start_token,
    vocabulary_words,
)
from tests.test_pip_core import SENTENCES, _train, llama, tok  # noqa: F401 - tok is a fixture


@pytest.fixture(scope="module")
def model(tok):  # noqa: F811
    return _train(llama(tok, seed=5), tok)


def test_sampled_texts_are_seeded_and_leave_the_global_rng_alone(tok, model):  # noqa: F811
    state = torch.random.get_rng_state()
    options = SamplingOptions(n=5, new_tokens=24, seed=3, min_chars=1, progress=False)
    model.train()
    a = sampled_texts(model, tok, options)
    assert torch.equal(torch.random.get_rng_state(), state) and model.training is True
    model.eval()
    assert a == sampled_texts(model, tok, options)
    assert a != sampled_texts(model, tok, replace(options, seed=4))
    assert len(a) == 5 and all(isinstance(t, str) and t for t in a)
    assert len(sampled_texts(model, tok, replace(options, n=13))) == 13 and model.training is False


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The fewest most probable tokens holding `top_p`, by a sort of the whole row."""
    values, order = probs.sort(descending=True)
    return set(order[: int((values.cumsum(0) < top_p).sum()) + 1].tolist())


@pytest.mark.parametrize(("top_p", "top_k"), [(0.9, 400), (0.9, 8), (0.3, 8), (1.0, 8)])
def test_nucleus_sample_draws_each_nucleus_token_by_its_probability(top_p, top_k):
    logits = torch.randn(3, 400, generator=torch.Generator().manual_seed(0)) * torch.tensor([[0.2], [3.0], [8.0]])
    grid = 20_000
    u = (torch.arange(grid) + 0.5) / grid  # evenly spread quantiles: each token gets its share of them, +-1
    for row in range(3):
        picked = nucleus_sample(logits[row].expand(grid, -1), u, temperature=1.5, top_p=top_p, top_k=top_k)
        probs = (logits[row] / 1.5).softmax(-1)
        nucleus = sorted(_nucleus(probs, top_p))
        assert set(picked.tolist()) <= set(nucleus)
        counts = torch.bincount(picked, minlength=400)[nucleus].double()
        expected = probs[nucleus].double() / probs[nucleus].sum() * grid
        assert (counts - expected).abs().max() <= 1.5


def _eos_like_period(model, tok, scale: float = 1.05):  # noqa: F811
    """A copy of `model` that ends a text (EOS) as readily as it ends a sentence with '.' (its logit, scaled)."""
    eos_model = copy.deepcopy(model)
    weight = eos_model.get_output_embeddings().weight  # tied with the input embeddings
    with torch.no_grad():
        weight[tok.eos_token_id] = scale * weight[tok.convert_tokens_to_ids(".")]
    return eos_model


def test_a_greedy_row_ends_where_the_model_emits_eos_as_generate_does(tok, model):  # noqa: F811
    eos_model = _eos_like_period(model, tok)
    start = start_token(tok)
    with torch.inference_mode():
        options = SamplingOptions(n=1, new_tokens=40, top_p=1e-6, cpu_bf16=False, progress=False)
        [sample, *_] = decode(eos_model, start, [tok.eos_token_id], 3, options)
        ids = torch.tensor([[start]])
        greedy = eos_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                    do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    greedy = greedy[0, 1:].tolist()
    assert tok.eos_token_id in greedy  # the model does end its text: the test tests something
    assert sample.ended and list(sample.tokens) == greedy[: greedy.index(tok.eos_token_id)]


def test_every_batched_sample_is_a_valid_sample_with_its_own_perplexity(tok, model):  # noqa: F811
    eos_model = _eos_like_period(model, tok, scale=0.7)
    options = SamplingOptions(n=1, new_tokens=30, seed=1, top_p=0.8, temperature=1.2, cpu_bf16=False, progress=False)
    start, eos = start_token(tok), tok.eos_token_id
    with torch.inference_mode():
        samples = decode(eos_model, start, [eos], 24, options)
    lengths = [len(s.tokens) for s in samples]
    assert len(samples) == 24 and len(set(lengths)) > 3  # rows left the batch at several steps
    assert any(s.ended for s in samples) and not all(s.ended for s in samples)
    for s in samples:
        assert eos not in s.tokens and s.ended == (len(s.tokens) < options.new_tokens)
        ids = [start, *s.tokens, *([eos] if s.ended else [])]
        with torch.inference_mode():
            logits = eos_model(input_ids=torch.tensor([ids])).logits[0, :-1]  # one row, no cache: the reference
        for position, token in enumerate(ids[1:]):
            assert token in _nucleus((logits[position] / options.temperature).softmax(-1), options.top_p)
        nll = -logits.log_softmax(-1)[torch.arange(len(s.tokens)), torch.tensor(s.tokens, dtype=torch.long)].mean()
        assert s.nll == (pytest.approx(float(nll), rel=1e-4) if s.tokens else math.inf)


def test_the_memory_bound_sets_the_rows_of_a_loop(tok, model):  # noqa: F811
    options = SamplingOptions(n=1, new_tokens=24, memory_mib=1, cpu_bf16=False, progress=False)
    config = model.config
    # a static cache of the 24 positions fed
    cache_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * 24
    rows = 2**20 // (cache_bytes + LOGIT_COPIES * 4 * len(tok))
    with torch.inference_mode():
        assert len(decode(model, start_token(tok), [tok.eos_token_id], 1000, options)) == rows < 1000


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="the CPU has no native bf16")
def test_bf16_sampling_stays_close_to_the_model_and_fits_more_rows(tok, model):  # noqa: F811
    options = SamplingOptions(n=1, new_tokens=24, seed=2, memory_mib=1, progress=False)
    start = start_token(tok)
    with torch.inference_mode():
        low, full = (decode(model, start, [tok.eos_token_id], 1000, replace(options, cpu_bf16=on)) for on in (True, False))
        assert len(low) >= len(full)  # its cache holds bf16 values: the rows come from the bytes the cache takes
        for s in low[:8]:
            logits = model(input_ids=torch.tensor([[start, *s.tokens]])).logits[0, :-1]
            nll = -logits.log_softmax(-1)[torch.arange(len(s.tokens)), torch.tensor(s.tokens)].mean()
            assert s.nll == pytest.approx(float(nll), abs=0.05)  # the fp32 model's own perplexity, to bf16's rounding
    assert [s.tokens for s in low] != [s.tokens for s in full]


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="the CPU has no native bf16")
def test_bf16_weights_hold_within_and_the_same_fp32_tensors_come_back_after_an_error(model):
    from pip_core.precision import cpu_bf16_weights

    before = {name: (p.data_ptr(), p.dtype) for name, p in model.named_parameters()}
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    with pytest.raises(RuntimeError, match="within"), cpu_bf16_weights(model) as swapped:
        assert swapped and {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert head is embed  # a tied weight stays one parameter with one copy
        raise RuntimeError("within")
    assert {name: (p.data_ptr(), p.dtype) for name, p in model.named_parameters()} == before  # the very storage
    with cpu_bf16_weights(model, wanted=False) as swapped:
        assert not swapped and {p.dtype for p in model.parameters()} == {torch.float32}


def test_distinct_ratio_is_low_for_a_loop_and_one_for_text(tok):  # noqa: F811
    loop = tok.encode(" and second, and third, and second, and third" * 4)
    text = tok.encode(" ".join(SENTENCES))
    assert distinct_ratio(loop) < 0.3 < SamplingOptions(n=1).min_distinct < 0.9 < distinct_ratio(text)
    assert distinct_ratio([5, 6, 7] * 10) == pytest.approx(3 / 29)
    assert distinct_ratio([5, 6, 7] * 10, n=3) == pytest.approx(3 / 28)
    assert distinct_ratio([4]) == distinct_ratio([4, 4, 4, 4], n=5) == 1.0  # too short to repeat an n-gram


def test_lowest_perplexity_keeps_the_n_lowest_in_order():
    samples = [Sample((1,), False, nll) for nll in (2.0, 5.0, 1.0, math.inf, 2.0, 3.0)]
    assert lowest_perplexity(samples, 4) == [0, 2, 4, 5]
    assert lowest_perplexity(samples, 1) == [2]


def test_sampled_texts_drop_short_looping_and_high_perplexity_samples(tok, model, monkeypatch):  # noqa: F811
    from pip_core import self_calibration

    def sample(text: str, nll: float) -> Sample:
        return Sample(tuple(tok.encode(text)), True, nll)

    a, b, c, d = SENTENCES[0], SENTENCES[1], SENTENCES[2], SENTENCES[3]
    drawn = [sample(a, 1.0), sample(b * 4, 0.5), sample(b, 3.0), sample("A cat.", 0.1), sample(c, 2.0),
             sample(d, 1.5), sample(d, 0.1)]
    asked = []

    def fake_decode(model, start, stop, rows, options, loop=0):
        asked.append((rows, loop))
        return drawn[loop * 2: loop * 2 + 2]  # two a loop: the later loops ask for what is still missing

    monkeypatch.setattr(self_calibration, "decode", fake_decode)
    options = SamplingOptions(n=3, drop_tail=0.25, progress=False)  # 4 texts pass, the highest perplexity goes
    assert sampled_texts(model, tok, options) == [tok.decode(tok.encode(t)).strip() for t in (a, c, d)]
    assert [loop for _, loop in asked] == [0, 1, 2]
    assert asked[0][0] >= 4 / FIRST_KEEP_RATE and asked[1][0] >= 3 * 2  # 1 of 2 kept: twice what is missing
    with pytest.raises(CalibrationError, match="only 5 of the 7 texts needed"):
        sampled_texts(model, tok, SamplingOptions(n=5, drop_tail=0.2, progress=False))


def test_sampling_options_refuse_values_out_of_range():
    for bad in ({"n": 0}, {"n": 1, "top_p": 0.0}, {"n": 1, "drop_tail": 1.0}, {"n": 1, "temperature": 0.0}):
        with pytest.raises(CalibrationError):
            SamplingOptions(**bad)


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
