"""Calibration: `resolve_calibration` turns the source the user named (a file, a reference directory, `self`, or
a weighted mix) into one file of texts (and its word list, when the method perturbs); `prepare_calibration` splits
that file into held-out, scoring and recovery texts on disk, with the scoring texts' perturbed views when the method
reads them (pip_core.vocabulary.PERTURBATION_METHODS). A method that perturbs nothing gets no pairs and no word list
built, and every scoring text is kept."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.context import TaskRunContext

from infra import atomic
from infra.calibration import CalibrationSource, calibration_hash, draw_sources, load_calibration
from infra.calibration_spec import SELF
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
    """The settings, seed, model, `perturb` and the recovery's count, the content of every file named in the mix
    and, when `self` is among the sources, the device and dtype the model samples on (its texts depend on them)."""
    settings = parameters["settings"]
    files = [CalibrationSource(source).digest() for source in settings.spec.files]
    sampled = SELF in dict(settings.spec.parts)
    sampler = _sampling_place(parameters["model"], parameters.get("runtime") or RuntimeSettings(),
                              settings.max_length) if sampled else None
    return key_from("settings", "seed", "model", "perturb", "recovery_texts", "files", "sampler")(
        context, {"perturb": True, "recovery_texts": 0, **parameters, "files": files, "sampler": sampler})


def _sampling_place(model: ModelRef, runtime: RuntimeSettings, max_length: int) -> list[str]:
    """[device, dtype, precision, sampler revision]: where and how the model samples (`runtime`'s "auto" resolved);
    the texts depend on each."""
    import torch

    from pip_core.precision import weights_precision_name
    from pip_core.self_calibration import SAMPLER_REVISION
    from tasks.models import placement_for

    placement = placement_for(model, runtime, max_length)
    device, dtype = torch.device(placement.device), getattr(torch, placement.dtype)
    return [str(placement.device), str(placement.dtype), weights_precision_name(device.type, dtype),
            f"sampler {SAMPLER_REVISION}"]


def _self_sampler(model: ModelRef, runtime: RuntimeSettings, settings: CalibrationSettings,
                  seed: int) -> Callable[[int], list[str]]:
    """n -> n texts sampled from `model` (seeded, `max_length` new tokens each)."""
    from infra.memory import DECODE_MMAP_THRESHOLD, roomy_allocator
    from pip_core.self_calibration import SamplingOptions, sampled_texts
    from tasks.models import load_model

    def sample(n: int) -> list[str]:
        net, tokenizer = load_model(model, runtime, seq_len=settings.max_length)
        with roomy_allocator(DECODE_MMAP_THRESHOLD):  # forward only (infra.memory)
            return sampled_texts(net, tokenizer, SamplingOptions(n=n, new_tokens=settings.max_length, seed=seed))
    return sample


def _self_word_list(model: ModelRef, runtime: RuntimeSettings,
                    settings: CalibrationSettings) -> Callable[[list[str]], WordList]:
    """texts -> the perturber's word list for them from the model's vocabulary (a model pass over candidates)."""
    from pip_core.self_calibration import model_word_list
    from tasks.models import load_model

    def words(texts: list[str]) -> WordList:
        return model_word_list(*load_model(model, runtime, seq_len=settings.max_length), texts)
    return words


@task(name="resolve-calibration", cache_key_fn=_mix_key, persist_result=True, result_serializer="json")
def resolve_calibration(settings: CalibrationSettings, seed: int, model: ModelRef,
                        runtime: RuntimeSettings = RuntimeSettings(), perturb: bool = True,
                        recovery_texts: int = 0) -> CalibrationSettings:
    """`settings` with `source` naming one file, `wordlist` its word list (None when not `perturb`) and
    `recovery_samples` set to `recovery_texts`, the recovery's count (0: recovery off), which
    `prepare_calibration` reads.

    A single file or reference directory is returned as it is. `self` and mixes are drawn here
    (n_samples + heldout_samples + recovery_texts texts in all, each source its weight's share; `self` texts are
    sampled from `model`, seeded) and written under the work directory, so the pairs, the recovery and the run's
    dataset all read the same texts. Their word list is built only when `perturb` and no `wordlist` is given:
    `self`'s runs the model over its vocabulary, and a method that perturbs nothing never reads it."""
    asked = settings.model_copy(update={"recovery_samples": recovery_texts})
    if settings.spec.single_file:
        return asked  # one file or reference directory, read as it is
    total = settings.n_samples + settings.heldout_samples + recovery_texts
    rows, words = draw_sources(settings.spec, total, seed, _self_sampler(model, runtime, settings, seed),
                               _self_word_list(model, runtime, settings) if perturb else None,
                               settings.wordlist if perturb else None)
    log.info("calibration %s: %d texts (%s)%s", settings.source, len(rows),
             ", ".join(f"{sum(r['source'] == s for r in rows)} from {s}" for s in dict.fromkeys(r["source"] for r in rows)),
             "" if perturb else "; no word list (the method perturbs nothing)")
    key = content_key(asked.model_dump(), seed, model.fingerprint, perturb, [r["text"] for r in rows])
    out = Settings().work_dir / "calibration" / "resolved" / key[:16]
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "calibration.jsonl", rows)
    if words is not None:
        atomic.write_text(out / "wordlist.txt", "\n".join(sorted(words.words)) + "\n")
    return asked.model_copy(update={"source": str(out / "calibration.jsonl"),
                                    "wordlist": str(out / "wordlist.txt") if words is not None else None})


def _content_key(context: TaskRunContext, parameters: dict) -> str:
    """The settings, seed and `perturb` plus the source's content (`CalibrationSource.digest`), so editing the
    calibration file or word list invalidates cached pairs even when their paths are unchanged."""
    settings = parameters["settings"]
    digest = CalibrationSource(settings.source, settings.wordlist).digest()
    return key_from("settings", "seed", "perturb", "source_digest")(
        context, {"perturb": True, **parameters, "source_digest": digest})


@task(name="prepare-calibration", cache_key_fn=_content_key, persist_result=True, result_serializer="json")
def prepare_calibration(settings: CalibrationSettings, seed: int, perturb: bool = True) -> CalibrationRef:
    """Split the source into held-out texts (quick perplexity), scoring texts and recovery texts, and build the
    scoring texts' perturbed pairs when `perturb`.

    Held-out and scoring texts are n_samples + heldout_samples of the source (seeded); the recovery's are the
    source's other texts, up to `settings.recovery_samples` (as `resolve_calibration` sets it). Without `perturb`
    no word list is read or built and every scoring text is kept; with it, the texts the perturber cannot edit
    are left out of the pairs (`n_skipped`). The result carries the resolved source, its content digest and
    `max_length`: what later tasks need of it.
    """
    n_samples, heldout_samples, recovery_samples = settings.n_samples, settings.heldout_samples, settings.recovery_samples
    source = CalibrationSource(settings.source, settings.wordlist)
    source_digest = source.digest()
    dataset = load_calibration(source.path, n_samples=n_samples + heldout_samples, seed=seed)
    texts = list(dataset["text"])
    if len(texts) < n_samples + heldout_samples:
        log.warning("calibration has %d texts, fewer than the %d requested", len(texts), n_samples + heldout_samples)
    held = texts[:heldout_samples] if len(texts) > heldout_samples else []
    scoring = texts[len(held):]
    recovery = _recovery_texts(source.path, texts, scoring, recovery_samples, seed) if recovery_samples else []
    perturbed = _perturbed(source, scoring, settings.perturb_rate, seed) if perturb else None
    rows = perturbed.rows if perturbed else [{"original": t, "perturbed": None, "edits": []} for t in scoring]
    views = f"r{settings.perturb_rate}" if perturb else "plain"
    out = (Settings().work_dir / "calibration" / source_digest[:16] /
           f"n{n_samples}-h{heldout_samples}-t{recovery_samples}-s{seed}-{views}")
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "pairs.jsonl", rows)
    _write_jsonl(out / "heldout.jsonl", [{"text": t} for t in held])
    if recovery:
        _write_jsonl(out / "recovery.jsonl", [{"text": t} for t in recovery])
    log.info("calibration: %d scoring texts (%s), %d held out, %d for recovery", len(rows),
             f"perturbed; {perturbed.skipped} not perturbable, left out" if perturbed else "not perturbed: all kept",
             len(held), len(recovery))
    return CalibrationRef(pairs_path=str(out / "pairs.jsonl"), heldout_path=str(out / "heldout.jsonl"),
                          data_hash=calibration_hash(dataset), wordlist_hash=perturbed.wordlist_hash if perturbed else "",
                          n_pairs=len(rows) if perturbed else 0, n_skipped=perturbed.skipped if perturbed else 0,
                          n_heldout=len(held), source_path=str(source.path), source_digest=source_digest,
                          max_length=settings.max_length, n_texts=len(rows),
                          recovery_path=str(out / "recovery.jsonl") if recovery else None, n_recovery=len(recovery))


@dataclass(frozen=True)
class _Pairs:
    rows: list[dict]
    skipped: int
    wordlist_hash: str


def _perturbed(source: CalibrationSource, texts: list[str], rate: float, seed: int) -> _Pairs:
    """The perturbable `texts` as pair rows (original, perturbed, edits), with the word list that decided the edits
    (the source's, else the texts' own words)."""
    words = WordList.from_file(source.wordlist) if source.wordlist else WordList.from_texts(texts)
    result = Perturber(words, rate=rate, seed=seed).perturb_many(texts)
    if not result.pairs:
        raise ValueError(f"no calibration text in {source.path} could be perturbed (word list of {len(words)} words)")
    rows = [{"original": p.original, "perturbed": p.perturbed,
             "edits": [[e.original_word, e.new_word, e.op] for e in p.edits]} for p in result.pairs]
    return _Pairs(rows, len(result.skipped), words.sha256)


def _recovery_texts(path: Path, used: list[str], scoring: list[str], count: int, seed: int) -> list[str]:
    """Up to `count` texts of `path` neither scored nor held out (`used`), drawn with `seed`. When none is left (a
    file no larger than what scoring took), the scoring texts, with a warning: recovery then trains on them."""
    taken = set(used)
    rest = [t for t in load_calibration(path)["text"] if t not in taken]
    if not rest:
        log.warning("calibration %s has no text left for recovery beyond the %d scored and held out; recovery "
                    "trains on the scoring texts", path, len(used))
        return scoring[:count]
    if len(rest) < count:
        log.warning("calibration %s has %d texts left for recovery, fewer than the %d asked", path, len(rest), count)
    return rest if len(rest) <= count else random.Random(seed).sample(rest, count)


def read_pairs(ref: CalibrationRef) -> list[tuple[str, str | None]]:
    """The scoring texts with their perturbed views (None when the method perturbs nothing)."""
    with open(ref.pairs_path) as fh:
        return [(row["original"], row["perturbed"]) for row in map(json.loads, fh)]


def read_texts(ref: CalibrationRef) -> list[str]:
    """Every scoring text: what a method that reads plain texts scores."""
    return [original for original, _ in read_pairs(ref)]


def read_heldout(ref: CalibrationRef) -> list[str]:
    with open(ref.heldout_path) as fh:
        return [json.loads(line)["text"] for line in fh]


def read_recovery(ref: CalibrationRef) -> list[str]:
    """The recovery's texts, drawn apart from the scoring and held-out ones ([] when none were asked for)."""
    if ref.recovery_path is None:
        return []
    with open(ref.recovery_path) as fh:
        return [json.loads(line)["text"] for line in fh]
