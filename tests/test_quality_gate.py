"""What the verdict reads: per-token figures on the general set (pip_core.token_figures), the repetition of the
greedy continuations (pip_core.repetition), and the gate over both (flows.records.quality_verdict)."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch

from flows.records import CompressSummary, model_figures, quality_verdict, verdict_tags
from infra.config import EvaluationSettings
from infra.tags import QUALITY_FIGURE, QUALITY_GENERAL_SET_SHA256, QUALITY_MIN_DISTINCT_RATIO, QUALITY_VERDICT
from pip_core.errors import PipCoreError
from pip_core.repetition import distinct_share, ngram_counts
from pip_core.token_figures import TokenFigures, batches, token_figures
from tasks.samples import Samples
from tests.helpers import tiny_family_model

# --- per-token figures ------------------------------------------------------------------------------------------


def _windows(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _naive(model, windows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window alone, with the model's whole logits: the reference."""
    nll, argmax = [], []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            nll.append(-logp.gather(-1, ids[0, 1:, None])[:, 0])
            argmax.append(logp.argmax(-1))
    return torch.cat(nll), torch.cat(argmax)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: the logits are soft-capped
def test_token_figures_equal_each_window_alone_with_whole_logits(family):
    model = tiny_family_model(family, vocab_size=97)
    windows = _windows(97, [9, 17, 5, 30, 2, 12])
    nll, argmax = _naive(model, windows)
    for batch_tokens, chunk in ((4096, None), (40, 3), (1, 1)):  # one batch, padded batches in slices, one at a time
        got = token_figures(model, windows, batch_tokens=batch_tokens, chunk_tokens=chunk)
        assert got.tokens == sum(len(w) - 1 for w in windows)
        assert torch.allclose(got.nll, nll, atol=1e-5) and torch.equal(got.argmax, argmax)
    assert got.metrics()["perplexity"] == pytest.approx(math.exp(float(nll.double().mean())), rel=1e-5)


def test_batches_stay_within_their_padded_token_budget():
    windows = [[0] * n for n in (10, 10, 30, 5, 5, 5, 5, 40)]
    groups = batches(windows, batch_tokens=40)
    assert [i for g in groups for i in g] == list(range(len(windows)))  # in order, each once
    assert all(max(len(windows[i]) for i in g) * len(g) <= 40 for g in groups)
    assert groups == [[0, 1], [2], [3, 4, 5, 6], [7]]


def test_a_model_against_the_dense_one(tmp_path):
    dense, pruned = tiny_family_model("llama", 97, seed=0), tiny_family_model("llama", 97, seed=1)
    windows = _windows(97, [20, 20, 20])
    d, p = token_figures(dense, windows), token_figures(pruned, windows)
    d.save(tmp_path / "dense.pt")
    d = TokenFigures.load(tmp_path / "dense.pt")  # what a later stage reads back
    own = d.against(d)
    assert (own["ppl_ratio"], own["top1_agreement"]) == (1.0, 1.0)
    got = p.against(d)
    assert got["ppl_ratio"] == pytest.approx(math.exp(float(p.nll.double().mean() - d.nll.double().mean())))
    assert got["top1_agreement"] == pytest.approx(float((p.argmax == d.argmax).double().mean())) and \
        got["top1_agreement"] < 1
    with pytest.raises(PipCoreError, match="not the same token set"):
        token_figures(pruned, windows[:2]).against(d)


# --- repetition -------------------------------------------------------------------------------------------------

#: SmolLM2-135M-Instruct's greedy continuations (64 tokens) of the default prompts (EvaluationSettings.prompts)
DENSE = [
    'Paris.\n\nThe answer is: 2018-01-22 12:12:53.',
    ', you need to prepare a pot of tea.\n\nThe first step is to prepare a pot of tea. This is a simple '
    'and easy process that involves boiling water, adding a small amount of tea, and then waiting for '
    'it to cool down. This is a fundamental skill that is often overlooked, but it is',
    'said, "I\'m not sure what to do, but I\'m going to make a new one."\n\nThe old man smiled, "I\'m '
    'not sure what to do either, but I\'m going to make a new one."\n\nThe old man looked at the new '
    'man and said, "I\'m',
    'there was a wise old wizard named Elwes. Elwes was known for his magical abilities and his love '
    'for the land. He lived in a tower surrounded by a beautiful garden filled with all sorts of '
    'magical creatures.\n\nOne day, a brave adventurer, named Eira, stumbled upon the tower',
    "that it's a collaborative process that involves everyone. It's a community that's dedicated to "
    "understanding the world around us and using that understanding to make a positive impact.\n\nI'm "
    "proud of the people I've helped, and I'm grateful for the incredible work they've done. I'm proud "
    'of the people who',
    'probably the one that has the most people visiting the beach.',
    'just add flour, water, and yeast to create a dough that can be shaped into various forms. The '
    'dough is then shaped into the desired shape, such as a loaf, a croissant, or a muffin.\n\nThe key '
    'to a successful bread-making process lies in the right ratio of ingredients.',
    'is often divided into four eras: the Early Roman Empire, the Roman Empire under Emperor Augustus, '
    'the Roman Empire under Emperor Trajan, and the Roman Empire under Emperor Trajan II.\n\nThe Early '
    'Roman Empire began with the reign of Emperor Trajan, who ruled from 98 CE to 117',
]
#: the loop issue 47 reported (an enumeration: every trigram holds a new ordinal), and a plain loop
ENUMERATION = (" of the two sides, and the first, and second, and third, and fourth, and fifth, and sixth, and seventh, "
               "and eighth, and ninth, and tenth, and eleventh, and twelfth, and thirteenth, and fourteenth")
PLAIN_LOOP = " the most interesting and most excellent and the most of the most of the most of the most of the most"


def _tokens(text: str) -> list[str]:
    """Words and punctuation: close to how a BPE tokenizer cuts English."""
    return re.findall(r"\w+|[^\w\s]", text)


def test_ngram_counts_of_a_looping_and_a_normal_sequence():
    assert ngram_counts("a b a b a b a".split(), 2) == (2, 6)
    assert ngram_counts("the cat sat on a mat".split(), 2) == (5, 5)
    assert ngram_counts("a b a b a b a".split(), 1) == (2, 7)
    assert ngram_counts(["x"], 2) == (0, 0)
    with pytest.raises(ValueError):
        ngram_counts(["x"], 0)
    assert distinct_share([[], ["x"]], 2) is None
    assert distinct_share(["a b a b".split(), "c d e".split()], 2) == pytest.approx((2 + 2) / (3 + 2))


def test_the_enumeration_loop_hides_from_trigrams_not_from_tokens():
    enumeration, dense = [_tokens(ENUMERATION)], [_tokens(t) for t in DENSE]
    assert distinct_share(enumeration, 3) == 1.0  # every trigram holds another ordinal
    # its bigrams are nearly as distinct as the dense model's, whose own loops repeat whole sentences
    assert distinct_share(enumeration, 2) > 0.85 * distinct_share(dense, 2)
    assert distinct_share(enumeration, 1) < 0.72 * distinct_share(dense, 1)


def test_the_default_bound_fails_looping_continuations_and_passes_the_dense_model():
    settings = EvaluationSettings()
    bound, dense = settings.min_distinct_ratio, distinct_share([_tokens(t) for t in DENSE])
    assert len(DENSE) == len(settings.prompts) and settings.new_tokens == 64
    for loop in (ENUMERATION, PLAIN_LOOP):
        assert distinct_share([_tokens(loop)] * len(DENSE)) / dense < bound, loop
    assert dense / dense >= bound


# --- the verdict ------------------------------------------------------------------------------------------------

GOOD = {"heldout_kl": 0.3, "heldout_ppl_ratio": 1.2, "general_ppl_ratio": 1.4, "samples_distinct_ratio": 0.97}


def test_the_verdict_reads_the_general_set_and_the_repetition():
    gate = EvaluationSettings()
    ok = quality_verdict(gate, GOOD)
    assert ok["verdict"] == "usable" and ok["reasons"] == [] and ok["not_measured"] == []
    assert ok["figures"] == {"heldout_kl": 0.3, "general_ppl_ratio": 1.4, "samples_distinct_ratio": 0.97}
    loops = quality_verdict(gate, {**GOOD, "samples_distinct_ratio": 0.6})
    assert loops["verdict"] == "not usable" and len(loops["reasons"]) == 1 and "distinct" in loops["reasons"][0]
    general = quality_verdict(gate, {**GOOD, "general_ppl_ratio": 2.5})  # the self held-out ratio (1.2) is not read
    assert general["verdict"] == "not usable" and "2.5" in general["reasons"][0]
    assert quality_verdict(EvaluationSettings(max_ppl_ratio=3.0), {**GOOD, "general_ppl_ratio": 2.5})["verdict"] == \
        "usable"
    assert quality_verdict(EvaluationSettings(min_distinct_ratio=None),
                           {**GOOD, "samples_distinct_ratio": 0.1})["verdict"] == "usable"


def test_a_figure_not_measured_is_named_and_the_rest_still_judge():
    gate = EvaluationSettings()
    no_samples = quality_verdict(gate, {k: v for k, v in GOOD.items() if k != "samples_distinct_ratio"})
    assert no_samples["verdict"] == "usable" and any("distinct" in r for r in no_samples["not_measured"])
    # a GGUF export measures one held-out file: its perplexity ratio is the one read
    export = quality_verdict(gate, {"heldout_kl": 0.1, "heldout_ppl_ratio": 2.4})
    assert export["verdict"] == "not usable" and "2.4" in export["reasons"][0]
    assert quality_verdict(gate, {"general_ppl_ratio": math.nan})["verdict"] == "not measured"


def test_verdict_tags_name_the_figures_the_bound_and_the_general_set():
    verdict = quality_verdict(EvaluationSettings(), GOOD)
    tags = verdict_tags(verdict, {"sha256": "ab" * 32, "tokens": 30117})
    assert tags[QUALITY_VERDICT] == "usable" and tags[QUALITY_MIN_DISTINCT_RATIO] == "0.75"
    assert tags[QUALITY_FIGURE.format(metric="general_ppl_ratio")] == "1.4"
    assert tags[QUALITY_GENERAL_SET_SHA256] == "ab" * 32
    assert QUALITY_GENERAL_SET_SHA256 not in verdict_tags(verdict)  # a GGUF export has no general set


def test_model_figures_put_the_repetition_beside_the_general_set():
    class General:
        metrics = {"general_perplexity": 20.0, "general_ppl_ratio": 1.3}

    dense, compressed = Samples(texts=["a"], distinct=0.8), Samples(texts=["b"], distinct=0.6)
    assert model_figures(General, dense) == {**General.metrics, "samples_distinct": 0.8, "samples_distinct_ratio": 1.0}
    assert model_figures(General, compressed, dense)["samples_distinct_ratio"] == pytest.approx(0.75)
    assert model_figures(None, Samples()) == {}


def test_the_summary_names_the_general_set_and_both_models_repetition():
    from pipprune.commands.summary import print_summary

    verdict = quality_verdict(EvaluationSettings(), {**GOOD, "samples_distinct_ratio": 0.6})
    summary = CompressSummary(
        run_key="k", mlflow_run_id="r", registered_model="m", model_version="1", s3_uri="s3://b/k", out_dir=None,
        params_before=100, params_after=80, achieved_ratio=0.2, iterations_resumed=0,
        metrics_before={"general_perplexity": 20.0, "samples_distinct": 0.8},
        metrics_after={"general_perplexity": 26.0, "general_ppl_ratio": 1.3, "samples_distinct": 0.48,
                       "samples_distinct_ratio": 0.6},
        quality=verdict, general_set={"source": "Jane Austen, Persuasion", "sha256": "cd" * 32, "tokens": 30117,
                                      "windows": 256, "max_length": 256})

    class Settings:
        mlflow_tracking_uri = "http://mlflow"

    out = io.StringIO()
    print_summary(summary, Settings, out, None)
    text = " ".join(out.getvalue().split())
    assert "general held-out set (general_* rows): Jane Austen, Persuasion; 30,117 tokens" in text
    assert "sha256 cdcdcdcdcdcdcdcd" in text
    assert "dense 0.800, compressed 0.480 (x0.60)" in text
    assert "NOT USABLE" in text and "distinct-token ratio >= 0.75" in text
    assert "or recovery (--recovery-steps N --recovery kd)" in text  # this run did not recover
    out = io.StringIO()
    print_summary(summary.model_copy(update={"metrics_before_recovery": {"heldout_perplexity": 40.0}}), Settings, out,
                  None)
    text = " ".join(out.getvalue().split())
    assert "more recovery steps than this run's (--recovery-steps N)" in text and "--recovery kd)" not in text
