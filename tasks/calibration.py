"""Calibration: `resolve_calibration` turns the source the user named (a file, a reference directory, `self`, or
a weighted mix) into one file of texts and its word list; `prepare_calibration` turns that file into (original,
perturbed) pairs and held-out texts on disk."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from prefect import task
from prefect.context import TaskRunContext

from infra import atomic
from infra.calibration import SELF, CalibrationSource, calibration_hash, draw_sources, load_calibration, parse_sources
from infra.config import CalibrationSettings, RuntimeSettings
from infra.settings import Settings
from pip_core.perturb import Perturber
from pip_core.wordlist import WordList
from tasks._common import content_key, key_from
from tasks.refs import CalibrationRef, ModelRef

log = logging.getLogger(__name__)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """Atomic, via a temp file of this call alone: runs with other keys may write the same pairs at once."""
    atomic.write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _mix_key(context: TaskRunContext, parameters: dict) -> str:
    """The settings, seed and model plus the content of every file named in the mix."""
    settings = parameters["settings"]
    files = [CalibrationSource(source).digest() for source, _ in parse_sources(settings.source) if source != SELF]
    return key_from("settings", "seed", "model", "files")(context, {**parameters, "files": files})


@task(name="resolve-calibration", cache_key_fn=_mix_key, persist_result=True, result_serializer="json")
def resolve_calibration(settings: CalibrationSettings, seed: int, model: ModelRef,
                        runtime: RuntimeSettings = RuntimeSettings()) -> CalibrationSettings:
    """`settings` with `source` and `wordlist` naming one file each. A single file or reference directory is
    returned as it is; `self` and mixes are drawn here (n_samples + heldout_samples texts in all, each source its
    weight's share; `self` texts are sampled from `model`, seeded) and written, with their word list, under the
    work directory, so the pairs, the recovery and the run's dataset all read the same texts."""
    from pip_core.self_calibration import model_word_list, sampled_texts
    from tasks.models import load_model

    if settings.source != SELF and parse_sources(settings.source) == [(settings.source, 1.0)]:
        return settings  # one file or reference directory, read as it is

    def sample_self(n: int) -> list[str]:
        return sampled_texts(*load_model(model, runtime, seq_len=settings.max_length), n, settings.max_length, seed)

    def self_words(texts: list[str]) -> WordList:
        return model_word_list(*load_model(model, runtime, seq_len=settings.max_length), texts)

    rows, words = draw_sources(settings.source, settings.n_samples + settings.heldout_samples, seed, sample_self,
                               self_words, settings.wordlist)
    log.info("calibration %s: %d texts (%s)", settings.source, len(rows),
             ", ".join(f"{sum(r['source'] == s for r in rows)} from {s}" for s in dict.fromkeys(r["source"] for r in rows)))
    key = content_key(settings.model_dump(), seed, model.fingerprint, [r["text"] for r in rows])
    out = Settings().work_dir / "calibration" / "resolved" / key[:16]
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "calibration.jsonl", rows)
    atomic.write_text(out / "wordlist.txt", "\n".join(sorted(words.words)) + "\n")
    return settings.model_copy(update={"source": str(out / "calibration.jsonl"), "wordlist": str(out / "wordlist.txt")})


def _content_key(context: TaskRunContext, parameters: dict) -> str:
    """The settings and seed plus the source's content (`CalibrationSource.digest`), so editing the
    calibration file or word list invalidates cached pairs even when their paths are unchanged."""
    settings = parameters["settings"]
    digest = CalibrationSource(settings.source, settings.wordlist).digest()
    return key_from("settings", "seed", "source_digest")(context, {**parameters, "source_digest": digest})


@task(name="prepare-calibration", cache_key_fn=_content_key, persist_result=True, result_serializer="json")
def prepare_calibration(settings: CalibrationSettings, seed: int) -> CalibrationRef:
    """Sample calibration texts, hold some out for quick perplexity, and build perturbed pairs.

    The result carries the resolved source, its content digest and `max_length`: what later tasks need of it.
    """
    n_samples, heldout_samples, perturb_rate = settings.n_samples, settings.heldout_samples, settings.perturb_rate
    source = CalibrationSource(settings.source, settings.wordlist)
    source_digest = source.digest()
    dataset = load_calibration(source.path, n_samples=n_samples + heldout_samples, seed=seed)
    texts = list(dataset["text"])
    if len(texts) < n_samples + heldout_samples:
        log.warning("calibration has %d texts, fewer than the %d requested", len(texts), n_samples + heldout_samples)
    held = texts[:heldout_samples] if len(texts) > heldout_samples else []
    calib = texts[len(held):]
    words = WordList.from_file(source.wordlist) if source.wordlist else WordList.from_texts(texts)
    result = Perturber(words, rate=perturb_rate, seed=seed).perturb_many(calib)
    if not result.pairs:
        raise ValueError(f"no calibration text in {source.path} could be perturbed (word list of {len(words)} words)")
    out = Settings().work_dir / "calibration" / source_digest[:16] / f"n{n_samples}-h{heldout_samples}-s{seed}-r{perturb_rate}"
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "pairs.jsonl", [
        {"original": p.original, "perturbed": p.perturbed,
         "edits": [[e.original_word, e.new_word, e.op] for e in p.edits]} for p in result.pairs])
    _write_jsonl(out / "heldout.jsonl", [{"text": t} for t in held])
    log.info("calibration: %d pairs (%d texts not perturbable), %d held out", len(result.pairs),
             len(result.skipped), len(held))
    return CalibrationRef(pairs_path=str(out / "pairs.jsonl"), heldout_path=str(out / "heldout.jsonl"),
                          data_hash=calibration_hash(dataset), wordlist_hash=words.sha256,
                          n_pairs=len(result.pairs), n_skipped=len(result.skipped), n_heldout=len(held),
                          source_path=str(source.path), source_digest=source_digest, max_length=settings.max_length)


def read_pairs(ref: CalibrationRef) -> list[tuple[str, str]]:
    with open(ref.pairs_path) as fh:
        return [(row["original"], row["perturbed"]) for row in map(json.loads, fh)]


def read_heldout(ref: CalibrationRef) -> list[str]:
    with open(ref.heldout_path) as fh:
        return [json.loads(line)["text"] for line in fh]
