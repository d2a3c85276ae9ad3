"""Only the work the method needs (issue 47): no perturbed pairs or word list for a method that never reads them,
every scoring text kept for it, recovery texts drawn apart, and the forward-only criteria in padded inference-mode
batches that score exactly as one text at a time."""

from __future__ import annotations

import copy
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from infra.config import CalibrationSettings, RuntimeSettings, ScoringSettings
from pip_core import importance, units
from pip_core.importance import CalibrationData
from pip_core.vocabulary import FORWARD_ONLY_METHODS, METHODS, PERTURBATION_METHODS
from tests.helpers import FAMILY_CONFIGS, bpe_tokenizer, tiny_family_model

SENTENCES = [
    "The host said he would come later to the party at the house.",
    "A cat sat on the mat near the door and watched the bird.",
    "Every guest brought bread and wine before the night was over.",
    "She wrote a long letter to her sister about the new neighbours.",
]
#: lengths far apart, so a padded batch pads most rows, and pads that entered a statistic would show
UNEVEN = ["A cat sat.", SENTENCES[0] + " " + SENTENCES[1] + " " + SENTENCES[2], SENTENCES[3], "The host said he"]
UNPERTURBABLE = "zzz qqq xyzzy plugh frotz"
VOCAB = "later alter the host ghost party said cat bat hat sat set mat map near door dear guest bread broad wine wind"


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(SENTENCES)


def _one_row_at_a_time(monkeypatch: pytest.MonkeyPatch, max_length: int = 128) -> None:
    monkeypatch.setattr(importance, "FORWARD_BATCH_TOKENS", max_length)  # rows = 1: no pad anywhere


# ---------------------------------------------------------------- scoring


def test_methods_are_named_once_by_what_they_read():
    assert PERTURBATION_METHODS == {"pip", "pip_l2", "pip_first_order", "pip_removal"}
    assert FORWARD_ONLY_METHODS == {"block_influence", "minitron", "wanda_sp"}
    assert (PERTURBATION_METHODS | FORWARD_ONLY_METHODS) <= set(METHODS)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_padded_batches_score_as_one_text_at_a_time(tok, family, monkeypatch):
    """Texts of very different lengths in one right-padded batch: a pad counted in any statistic (an activation
    norm, a channel's squares, a token's cosine, the token count) moves the scores off the unpadded ones."""
    model = tiny_family_model(family, len(tok), seed=3)
    data = CalibrationData(tok, texts=UNEVEN)
    cases = [(m, "width") for m in ("minitron", "wanda_sp")] + [("block_influence", "block")]
    batched = {m: importance.score(model, m, units.discover(model, k), data, progress=False) for m, k in cases}
    sums = importance.score_sums(model, "minitron", units.discover(model, "width"), data, progress=False)
    _one_row_at_a_time(monkeypatch)
    for method, kind in cases:
        single = importance.score(model, method, units.discover(model, kind), data, progress=False)
        torch.testing.assert_close(batched[method], single, rtol=1e-5, atol=1e-8)
    assert sums[1] == sum(len(tok(t)["input_ids"]) for t in UNEVEN)  # real tokens only


def test_a_padded_position_would_change_the_scores(tok, monkeypatch):
    """The test above can fail: with every position taken as real, pads enter the statistics and the scores move."""
    model = tiny_family_model("llama", len(tok), seed=3)
    found = units.discover(model, "width")
    honest = importance.score(model, "wanda_sp", found, CalibrationData(tok, texts=UNEVEN), progress=False)
    padded = importance._batch

    def pads_as_real(seqs, pad, device):
        ids, mask = padded(seqs, pad, device)
        return ids, torch.ones_like(mask)
    monkeypatch.setattr(importance, "_batch", pads_as_real)
    leaky = importance.score(model, "wanda_sp", found, CalibrationData(tok, texts=UNEVEN), progress=False)
    assert not torch.allclose(honest, leaky, rtol=1e-3)


def test_forward_only_scoring_runs_in_eval_and_inference_mode_without_checkpointing(tok):
    """Asked to checkpoint (the placement's advice for the gradient methods), a forward-only criterion still runs
    in eval mode under inference mode, and leaves nothing behind that a later backward (PIP on the same model)
    would trip over."""
    model = tiny_family_model("llama", len(tok), seed=3)
    seen = []
    handle = model.model.layers[0].register_forward_hook(lambda m, a, o: seen.append(
        (model.training, model.is_activation_checkpointing, torch.is_inference_mode_enabled())))
    for method, kind in (("wanda_sp", "width"), ("minitron", "width"), ("block_influence", "block")):
        importance.score(model, method, units.discover(model, kind), CalibrationData(tok, texts=SENTENCES),
                         progress=False, gradient_checkpointing=True)
    handle.remove()
    assert seen and set(seen) == {(False, False, True)}
    pairs = [(SENTENCES[0], SENTENCES[0].replace("host", "ghost"))]
    scores = importance.score(model, "pip", units.discover(model, "width"), CalibrationData(tok, pairs),
                              progress=False, gradient_checkpointing=True)
    assert torch.isfinite(scores).all() and scores.abs().sum() > 0


@pytest.mark.parametrize("method", ["pip_single_view", "pip_removal_single_view"])
def test_single_view_ablations_score_plain_texts(tok, method):
    """They never read the perturbed view: plain texts (no pairs) score as the pairs' originals did."""
    model = tiny_family_model("llama", len(tok), seed=3)
    kind = "block" if "removal" in method else "width"
    found = units.discover(model, kind)
    pairs = [(s, s.replace("the", "a")) for s in SENTENCES]
    from_pairs = importance.score(copy.deepcopy(model), method, found, CalibrationData(tok, pairs), progress=False)
    plain = importance.score(model, method, found, CalibrationData(tok, texts=SENTENCES), progress=False)
    torch.testing.assert_close(plain, from_pairs, rtol=1e-4, atol=1e-8)


def test_score_units_gives_forward_criteria_every_text_and_no_checkpointing(tmp_path, monkeypatch):
    """The scoring task: wanda_sp gets all the scoring texts (the unperturbable one too) and checkpointing off even
    where the placement advises it; a PIP form on calibration prepared without perturbed views is refused."""
    from pip_core.schedule import StepSpec
    from tasks import scoring
    from tasks.calibration import prepare_calibration
    from tasks.refs import ModelRef

    settings = _calibration_file(tmp_path, monkeypatch, n_texts=6)
    calib = prepare_calibration.fn(settings.model_copy(update={"n_samples": 6, "heldout_samples": 0,
                                                               "recovery_samples": 0}), 0, perturb=False)
    seen = {}
    monkeypatch.setattr(scoring, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(scoring, "placement_for", lambda *a, **k: SimpleNamespace(gradient_checkpointing=True))
    monkeypatch.setattr(scoring.schedule, "score_step",
                        lambda net, data, spec, options: seen.update(data=data, options=options) or ([], []))
    ref = ModelRef(local_dir=str(tmp_path), fingerprint="f" * 64, num_params=1)
    spec = StepSpec(step=1, target_ratio=0.1, params_to_remove=1, seed=0)
    scoring.score_units.fn(ref, calib, ScoringSettings(method="wanda_sp"), spec, RuntimeSettings())
    assert UNPERTURBABLE in seen["data"].text_list and len(seen["data"].text_list) == 6
    assert seen["options"].gradient_checkpointing is False
    with pytest.raises(ValueError, match="perturbed views"):
        scoring.score_units.fn(ref, calib, ScoringSettings(method="pip"), spec, RuntimeSettings())


# ---------------------------------------------------------------- calibration


def _calibration_file(tmp_path, monkeypatch, n_texts: int, unperturbable: bool = True) -> CalibrationSettings:
    """A calibration file of `n_texts` texts (the first one unperturbable) with its word list beside it."""
    monkeypatch.setenv("PIPPRUNE_HOME", str(tmp_path / "home"))
    texts = [f"{SENTENCES[i % 4]} Line {i}." for i in range(n_texts)]
    if unperturbable:
        texts[0] = UNPERTURBABLE
    source = tmp_path / "calib.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "wordlist.txt").write_text("\n".join(VOCAB.split()) + "\n")
    return CalibrationSettings(source=str(source), n_samples=4, heldout_samples=2, recovery_samples=0)


def test_without_perturbation_every_scoring_text_is_kept_and_no_word_list_is_read(tmp_path, monkeypatch):
    from pip_core import wordlist
    from tasks.calibration import prepare_calibration, read_pairs, read_texts

    settings = _calibration_file(tmp_path, monkeypatch, n_texts=6)
    settings = settings.model_copy(update={"n_samples": 6, "heldout_samples": 0})
    perturbed = prepare_calibration.fn(settings, 0, perturb=True)
    assert (perturbed.n_pairs, perturbed.n_skipped, perturbed.n_texts) == (5, 1, 5)
    assert UNPERTURBABLE not in read_texts(perturbed) and all(p is not None for _, p in read_pairs(perturbed))

    def no_word_list(*args, **kwargs):
        raise AssertionError("a word list was read or built for a method that perturbs nothing")
    monkeypatch.setattr(wordlist.WordList, "from_file", no_word_list)
    monkeypatch.setattr(wordlist.WordList, "from_texts", no_word_list)
    plain = prepare_calibration.fn(settings, 0, perturb=False)
    assert (plain.n_pairs, plain.n_skipped, plain.n_texts, plain.wordlist_hash) == (0, 0, 6, "")
    assert sorted(read_texts(plain)) == sorted(read_texts(perturbed) + [UNPERTURBABLE])
    assert all(p is None for _, p in read_pairs(plain))
    assert plain.data_hash == perturbed.data_hash  # the same texts drawn; what was scored of them differs
    assert plain.pairs_path != perturbed.pairs_path


def test_recovery_texts_are_drawn_apart_from_the_scored_and_held_out(tmp_path, monkeypatch, caplog):
    from tasks.calibration import prepare_calibration, read_heldout, read_recovery, read_texts

    settings = _calibration_file(tmp_path, monkeypatch, n_texts=12, unperturbable=False)
    none = prepare_calibration.fn(settings, 0, perturb=False)
    assert (none.recovery_path, none.n_recovery, read_recovery(none)) == (None, 0, [])
    some = prepare_calibration.fn(settings.model_copy(update={"recovery_samples": 4}), 0, perturb=False)
    used = set(read_texts(some)) | set(read_heldout(some))
    assert some.n_recovery == len(read_recovery(some)) == 4 and not used & set(read_recovery(some))
    assert (read_texts(some), read_heldout(some), some.data_hash) == (read_texts(none), read_heldout(none),
                                                                      none.data_hash)  # recovery moves no scoring
    rest = prepare_calibration.fn(settings.model_copy(update={"recovery_samples": 100}), 0, perturb=False)
    assert rest.n_recovery == 6  # the file's 12 less 4 scored and 2 held out
    small = settings.model_copy(update={"n_samples": 10})
    with caplog.at_level(logging.WARNING, logger="tasks.calibration"):
        fallback = prepare_calibration.fn(small.model_copy(update={"recovery_samples": 3}), 0, perturb=False)
    assert read_recovery(fallback) == read_texts(fallback)[:3] and "no text left for recovery" in caplog.text


def test_prepare_cache_key_names_perturb_and_the_recovery_count(tmp_path, monkeypatch):
    from tasks.calibration import _content_key

    settings = _calibration_file(tmp_path, monkeypatch, n_texts=6)
    context = SimpleNamespace(task=SimpleNamespace(name="prepare-calibration"))
    keys = {_content_key(context, {"settings": settings, "seed": 0, "perturb": True}),
            _content_key(context, {"settings": settings, "seed": 0, "perturb": False}),
            _content_key(context, {"settings": settings.model_copy(update={"recovery_samples": 3}), "seed": 0,
                                   "perturb": False})}
    assert len(keys) == 3
    assert _content_key(context, {"settings": settings, "seed": 0}) in keys  # perturb defaults to True


def _fake_self(monkeypatch, calls: dict) -> None:
    """`self` texts without a model: counted samples, and a word list that records that it was built."""
    from pip_core.wordlist import WordList
    from tasks import calibration

    def sampler(model, runtime, settings, seed):
        def sample(n: int) -> list[str]:
            calls["sampled"] = calls.get("sampled", 0) + n
            return [f"{SENTENCES[i % 4]} Sampled {seed}-{i}." for i in range(n)]
        return sample

    def words(model, runtime, settings):
        def build(texts: list[str]) -> WordList:
            calls["word lists"] = calls.get("word lists", 0) + 1
            return WordList.of(VOCAB.split())
        return build
    monkeypatch.setattr(calibration, "_self_sampler", sampler)
    monkeypatch.setattr(calibration, "_self_word_list", words)


def test_self_draws_scoring_heldout_and_recovery_texts_and_a_word_list_only_to_perturb(tmp_path, monkeypatch):
    from tasks.calibration import prepare_calibration, read_recovery, read_texts, resolve_calibration
    from tasks.refs import ModelRef

    monkeypatch.setenv("PIPPRUNE_HOME", str(tmp_path / "home"))
    calls: dict = {}
    _fake_self(monkeypatch, calls)
    model = ModelRef(local_dir=str(tmp_path), fingerprint="f" * 64, num_params=1)
    settings = CalibrationSettings(source="self", n_samples=5, heldout_samples=2)
    plain = resolve_calibration.fn(settings, 0, model, perturb=False, recovery_texts=3)
    assert calls == {"sampled": 10} and plain.wordlist is None and plain.recovery_samples == 3
    assert not list((tmp_path / "home").rglob("wordlist.txt"))
    calib = prepare_calibration.fn(plain, 0, perturb=False)
    assert (calib.n_texts, calib.n_heldout, calib.n_recovery) == (5, 2, 3)
    assert not set(read_texts(calib)) & set(read_recovery(calib))
    calls.clear()
    perturbed = resolve_calibration.fn(settings, 0, model, perturb=True, recovery_texts=0)
    assert calls == {"sampled": 7, "word lists": 1} and perturbed.wordlist and perturbed.recovery_samples == 0
    calls.clear()
    given = tmp_path / "mine.txt"
    given.write_text("cat\nbat\n")
    resolve_calibration.fn(settings.model_copy(update={"wordlist": str(given)}), 0, model, perturb=True)
    assert calls == {"sampled": 7}  # --wordlist replaces the model's own: no vocabulary pass


def test_a_file_source_is_returned_as_it_is_with_the_recovery_count(tmp_path, monkeypatch):
    from tasks.calibration import resolve_calibration
    from tasks.refs import ModelRef

    settings = _calibration_file(tmp_path, monkeypatch, n_texts=6)
    model = ModelRef(local_dir=str(tmp_path), fingerprint="f" * 64, num_params=1)
    resolved = resolve_calibration.fn(settings, 0, model, perturb=False, recovery_texts=7)
    assert resolved == settings.model_copy(update={"recovery_samples": 7})


def test_resolve_cache_key_names_the_sampling_device_dtype_perturb_and_counts(tmp_path, monkeypatch):
    from tasks import calibration
    from tasks.refs import ModelRef

    settings = _calibration_file(tmp_path, monkeypatch, n_texts=6)
    model = ModelRef(local_dir=str(tmp_path), fingerprint="f" * 64, num_params=1)
    context = SimpleNamespace(task=SimpleNamespace(name="resolve-calibration"))
    place = {"where": ["cpu", "float32"]}
    monkeypatch.setattr(calibration, "_sampling_place", lambda *a: place["where"])

    def key(spec: str = "self", **extra) -> str:
        return calibration._mix_key(context, {"settings": settings.model_copy(update={"source": spec}), "seed": 0,
                                              "model": model, "runtime": RuntimeSettings(), **extra})
    first = key()
    assert key(perturb=True, recovery_texts=0) == first  # the defaults
    assert len({first, key(perturb=False), key(recovery_texts=5)}) == 3
    place["where"] = ["cuda:0", "bfloat16"]
    assert key() != first  # sampled elsewhere: other texts
    monkeypatch.setattr(calibration, "_sampling_place", lambda *a: pytest.fail("a file is not sampled"))
    key(settings.source)
