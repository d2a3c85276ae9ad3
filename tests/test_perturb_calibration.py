"""Perturber validity and determinism; calibration loading and its errors."""

import json

import pytest

from infra.calibration import CalibrationDataError, calibration_hash, load_calibration, windows
from pip_core.errors import CalibrationError
from pip_core.perturb import NotPerturbableError, Perturber, match_case, single_edits
from pip_core.wordlist import WordList

TEXT = ("Later that evening the host of the party said that the cat had sat on the mat near the door, "
        "and every guest would come back for the bread and the wine before the night was over.")
VOCAB = WordList.of("later alter the host ghost party said that cat bat hat sat set mat map near door dear "
                    "every guest would come back pack bread broad wine wind before night knight was over oven "
                    "and had for".split())


def test_known_real_word_edits():
    p = Perturber(VOCAB)
    assert ("swap", "alter") in p.neighbours("later")
    assert ("insert", "ghost") in p.neighbours("host")
    assert ("replace", "bat") in p.neighbours("cat")
    assert ("swap", "later") in p.neighbours("alter")
    assert all(op in {"swap", "replace", "insert"} for op, _ in single_edits("host"))


def test_perturbed_differs_and_every_new_word_is_real():
    p = Perturber(VOCAB, rate=0.2, seed=3)
    for sample in range(20):
        pair = p.perturb(TEXT, sample_id=sample)
        assert pair.perturbed != pair.original
        assert pair.edits
        for edit in pair.edits:
            assert edit.new_word.lower() in VOCAB.words
            assert edit.new_word.lower() != edit.original_word.lower()
            assert pair.original[edit.position:edit.position + len(edit.original_word)] == edit.original_word
        assert len(pair.perturbed.split()) == len(pair.original.split())


def test_deterministic_per_seed_and_order_independent():
    a = Perturber(VOCAB, rate=0.2, seed=1)
    b = Perturber(VOCAB, rate=0.2, seed=1)
    assert a.perturb(TEXT, 5) == b.perturb(TEXT, 5)
    b.perturb("the cat sat on the mat", 0)  # other calls do not shift the stream
    assert a.perturb(TEXT, 5) == b.perturb(TEXT, 5)
    outputs = {Perturber(VOCAB, rate=0.2, seed=s).perturb(TEXT).perturbed for s in range(6)}
    assert len(outputs) > 1


def test_capitalisation_preserved():
    assert match_case("Later", "alter") == "Alter"
    assert match_case("HOST", "ghost") == "GHOST"
    pair = Perturber(WordList.of(["later", "alter", "comes"]), rate=1.0).perturb("Later comes.")
    assert pair.perturbed == "Alter comes."


def test_unperturbable_text_is_reported_not_passed_through():
    p = Perturber(VOCAB)
    with pytest.raises(NotPerturbableError):
        p.perturb("zzz qqq xyzzy")
    result = p.perturb_many([TEXT, "zzz qqq xyzzy", TEXT])
    assert result.skipped == [1]
    assert len(result.pairs) == 2 and result.stats["skipped"] == 1


def test_wordlist_from_texts_and_errors(tmp_path):
    words = WordList.from_texts([TEXT, TEXT], min_count=2)
    assert "host" in words and "Host" in words
    path = tmp_path / "w.txt"
    words.write(path)
    assert WordList.from_file(path) == words and WordList.from_file(path).sha256 == words.sha256
    with pytest.raises(CalibrationError, match="empty"):
        WordList.of([])


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_calibration_samples_deterministically(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"text": f"{TEXT} number {i}"} for i in range(30)])
    a = load_calibration(path, n_samples=8, seed=1)
    b = load_calibration(path, n_samples=8, seed=1)
    assert list(a["text"]) == list(b["text"]) and len(a) == 8
    assert calibration_hash(a) == calibration_hash(b)
    assert calibration_hash(a) != calibration_hash(load_calibration(path, n_samples=8, seed=2))


@pytest.mark.parametrize("content,message", [
    (b"", "empty"),
    (b"\x00\x01\x02binary", "binary"),
    (b'{"txt": "a long enough line of text here"}\n', "no 'text' column"),
    (b'{"text": "short"}\n', "str_length"),
    (b'not json\n', "not valid JSON"),
])
def test_calibration_errors_name_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(CalibrationDataError, match=message):
        load_calibration(path)


def test_heldout_text_is_refused(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"text": TEXT}])
    with pytest.raises(CalibrationDataError, match="held-out"):
        load_calibration(path, heldout_texts=[TEXT[:50]])


def test_windows_cut_whole_words():
    out = windows([" ".join(f"w{i}" for i in range(100))], words_per_window=10, n=None)
    assert len(out) == 10 and all(len(w.split()) == 10 for w in out)
    assert windows([" ".join(f"w{i}" for i in range(100))], 10, n=3, seed=0) == \
        windows([" ".join(f"w{i}" for i in range(100))], 10, n=3, seed=0)


def test_prepare_calibration_cache_key_follows_the_file_content_not_its_path(tmp_path, monkeypatch):
    """The flow hands prepare_calibration only the settings; its cache key hashes the source itself, so an
    edited calibration file (same path) or word list gets new pairs, and an unchanged one is served from cache."""
    from types import SimpleNamespace

    from infra.config import CalibrationSettings
    from tasks.calibration import _content_key

    monkeypatch.setenv("PIPPRUNE_HOME", str(tmp_path / "home"))
    source = tmp_path / "calib.jsonl"
    source.write_text(json.dumps({"text": "The host said he would come later to the party."}) + "\n")
    settings = CalibrationSettings(source=str(source))
    context = SimpleNamespace(task=SimpleNamespace(name="prepare-calibration"))

    def key() -> str:
        return _content_key(context, {"settings": settings, "seed": 0})

    first = key()
    assert key() == first
    source.write_text(json.dumps({"text": "A cat sat on the mat near the door and watched."}) + "\n")
    assert key() != first
    (tmp_path / "wordlist.txt").write_text("cat\nmat\n")  # a word list beside the file is part of the source
    edited = key()
    (tmp_path / "wordlist.txt").write_text("cat\nhat\n")
    assert key() != edited
    assert _content_key(context, {"settings": settings, "seed": 1}) != key()
