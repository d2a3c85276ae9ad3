"""Calibration text: loaded into a `datasets.Dataset`, validated by a pandera schema, content-hashed.

Pruning is sensitive to its calibration set, so the set is pinned: its sha256 keys caches and is
recorded in lineage, and malformed input is refused with the schema's own failure cases.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pandas as pd
import pandera.pandas as pa
from datasets import Dataset

from infra.calibration_spec import SELF, CalibrationSpec
from infra.hashing import sha256_file
from pip_core.errors import CalibrationError
from pip_core.wordlist import WordList


class CalibrationDataError(CalibrationError):
    """The calibration file is empty, binary, malformed or violates the schema."""


def calibration_schema(min_chars: int = 20, max_chars: int = 20_000,
                       heldout: Sequence[str] = ()) -> pa.DataFrameSchema:
    """Rows of text: non-empty, within length bounds, and sharing no text with held-out data."""
    banned = [h for h in heldout if h]

    def no_heldout(text: pd.Series) -> pd.Series:
        return text.map(lambda t: not any(h in t or t in h for h in banned))

    return pa.DataFrameSchema(
        {
            "text": pa.Column(str, checks=[
                pa.Check(lambda s: s.str.strip().str.len() > 0, error="empty text"),
                pa.Check.str_length(min_chars, max_chars),
                pa.Check(no_heldout, error="contains held-out text"),
            ]),
            "source": pa.Column(str, required=False, nullable=True),
        },
        strict=False, coerce=False, checks=[pa.Check(lambda df: len(df) > 0, error="no rows")],
    )


def _read_rows(path: Path) -> list[dict]:
    raw = path.read_bytes()
    if not raw.strip():
        raise CalibrationDataError(f"calibration file {path} is empty")
    if b"\0" in raw[:4096]:
        raise CalibrationDataError(f"calibration file {path} looks binary (NUL bytes); expected JSONL or text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CalibrationDataError(f"calibration file {path} is not UTF-8 text: {exc}") from exc
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationDataError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise CalibrationDataError(f"{path}:{n}: each line must be a JSON object with a 'text' field")
            rows.append(row)
        return rows
    return [{"text": t} for t in windows([text], words_per_window=96, n=None, seed=0)]


def load_calibration(path: str | Path, n_samples: int | None = None, seed: int = 0, min_chars: int = 20,
                     max_chars: int = 20_000, heldout_texts: Sequence[str] = ()) -> Dataset:
    """Read JSONL (objects with `text`) or plain text, validate, and sample `n_samples` deterministically."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationDataError(f"calibration file not found: {path}")
    frame = pd.DataFrame(_read_rows(path))
    if "text" not in frame.columns:
        raise CalibrationDataError(f"calibration file {path} has no 'text' column (columns: {list(frame.columns)})")
    try:
        frame = calibration_schema(min_chars, max_chars, heldout_texts).validate(frame, lazy=True)
    except pa.errors.SchemaErrors as exc:
        cases = exc.failure_cases[["column", "check", "index"]].head(5).to_dict("records")
        raise CalibrationDataError(f"calibration file {path} fails its schema: {cases}") from exc
    columns = [c for c in ("text", "source") if c in frame.columns]
    dataset = Dataset.from_pandas(frame[columns].reset_index(drop=True), preserve_index=False)
    if n_samples is not None and n_samples < len(dataset):
        order = random.Random(seed).sample(range(len(dataset)), n_samples)
        dataset = dataset.select(order)
    return dataset


def calibration_hash(dataset: Dataset | Iterable[str]) -> str:
    """sha256 of the texts in order (what the pruning actually saw)."""
    texts = dataset["text"] if isinstance(dataset, Dataset) else dataset
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8") + b"\0")
    return h.hexdigest()


def windows(texts: Iterable[str], words_per_window: int, n: int | None, seed: int = 0) -> list[str]:
    """Cut texts into windows of whole words; `n` picks that many deterministically (None = all)."""
    out: list[str] = []
    for text in texts:
        words = text.split()
        out.extend(" ".join(words[i:i + words_per_window]) for i in range(0, len(words), words_per_window)
                   if len(words[i:i + words_per_window]) >= max(2, words_per_window // 2))
    if n is not None and n < len(out):
        picked = sorted(random.Random(seed).sample(range(len(out)), n))
        out = [out[i] for i in picked]
    return out


def draw_sources(spec: CalibrationSpec, total: int, seed: int, sample_self: Callable[[int], list[str]],
                 self_words: Callable[[list[str]], WordList] | None = None,
                 wordlist: str | None = None) -> tuple[list[dict], WordList | None]:
    """`total` calibration rows drawn from the sources of `spec` by weight, each row's `source`
    named, and the word list that decides the perturber's edits: `wordlist` when given, else the union of each
    source's own (`_own_words`; `self`'s runs the model, so it is built only here). With neither `wordlist` nor
    `self_words` no word list is wanted (a method that perturbs nothing): None in its place."""
    rows = _draw_rows(spec, total, seed, sample_self)
    if wordlist:
        return rows, WordList.from_file(wordlist)
    if self_words is None:
        return rows, None
    by_source = {source: [r["text"] for r in rows if r["source"] == source] for source in dict.fromkeys(
        r["source"] for r in rows)}
    lists = [_own_words(source, texts, self_words) for source, texts in by_source.items()]
    return rows, functools.reduce(WordList.union, lists)


def _draw_rows(spec: CalibrationSpec, total: int, seed: int, sample_self: Callable[[int], list[str]]) -> list[dict]:
    """Each source's weight's share of `total` texts (the last source the remainder), in the order of `spec`."""
    sources = spec.parts
    counts = [round(weight * total) for _, weight in sources]
    counts[-1] = max(1, total - sum(counts[:-1]))
    rows: list[dict] = []
    for (source, _), count in zip(sources, counts, strict=True):
        texts = sample_self(count) if source == SELF else list(
            load_calibration(CalibrationSource(source).path, n_samples=count, seed=seed)["text"])
        rows += [{"text": t, "source": source} for t in texts]
    return rows


def _own_words(source: str, texts: list[str], self_words: Callable[[list[str]], WordList]) -> WordList:
    """A source's own word list: `self_words` of the model's texts; a file's wordlist.txt beside it, else the words
    of its drawn texts."""
    if source == SELF:
        return self_words(texts)
    found = CalibrationSource(source)
    return WordList.from_file(found.wordlist) if found.wordlist else WordList.from_texts(texts)


class CalibrationSource:
    """Where calibration text and its word list live: a file, or a reference model directory."""

    def __init__(self, spec: str, wordlist: str | None = None) -> None:
        path = Path(spec).expanduser().resolve()
        if path.is_dir():
            candidate = path / "calibration" / "calibration.jsonl"
            if not candidate.is_file():
                raise FileNotFoundError(f"{path} is a directory without calibration/calibration.jsonl")
            path = candidate
        if not path.is_file():
            raise FileNotFoundError(f"calibration file not found: {spec}")
        self.path = path
        beside = path.parent / "wordlist.txt"
        self.wordlist = Path(wordlist).expanduser().resolve() if wordlist else (beside if beside.is_file() else None)
        if self.wordlist is not None and not self.wordlist.is_file():
            raise FileNotFoundError(f"word list not found: {wordlist}")

    def digest(self) -> str:
        """Content of the calibration file and word list, for cache keys."""
        parts = [sha256_file(self.path), sha256_file(self.wordlist) if self.wordlist else ""]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()
