"""A model directory's vocabulary trimmed to a corpus (pip_core.vocab_trim), written as a directory of its own.

The corpus is a file the user names (`.txt`: one text per paragraph; `.jsonl`: a `text` field per line) or
`public`: the English text the install already fetches (five Jane Austen novels, the King James Bible, the Python
documentation's prose, the fortune database), less what evaluation holds out (Persuasion, WordNet). The output is
an ordinary Hugging Face directory (stock class, AutoTokenizer) that `compress --model DIR` takes as any other;
beside it `vocab_trim.json`
records the source, the corpus, the kept count and the kept-id list's sha256. It is written to a private sibling,
checked (every corpus text encodes to the same tokens, renumbered) and only then renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infra.layout import model_dir_layout
from infra.reference import sources

if TYPE_CHECKING:
    import numpy as np

    from pip_core.vocab_trim import VocabTrim

log = logging.getLogger(__name__)

#: the record beside a trimmed directory's weights
TRIM_RECORD = "vocab_trim.json"
PUBLIC = "public"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json")


class VocabSourceError(ValueError):
    """A corpus or model that cannot be trimmed as asked; the message says which and why."""


@dataclass(frozen=True)
class TrimRecord:
    source: str
    corpus: str
    corpus_sha256: str
    corpus_texts: int
    vocab_before: int
    vocab_after: int
    params_before: int
    params_after: int
    kept_sha256: str

    @property
    def removed_ratio(self) -> float:
        return 1 - self.params_after / self.params_before


def corpus_texts(corpus: str, cache: Path) -> tuple[str, list[str]]:
    """(what the corpus is, its texts): `public` or a .txt/.jsonl file."""
    if corpus == PUBLIC:
        return _public_corpus(cache)
    path = Path(corpus).expanduser()
    if not path.is_file():
        raise VocabSourceError(f"vocabulary corpus not found: {corpus} (a .txt or .jsonl file, or '{PUBLIC}')")
    raw = path.read_text(encoding="utf-8", errors="strict")
    if path.suffix == ".jsonl":
        try:
            texts = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise VocabSourceError(f"{path}: every line must be a JSON object with a 'text' field ({exc})") from None
    else:
        texts = [p.strip() for p in raw.split("\n\n") if p.strip()]
    if not texts:
        raise VocabSourceError(f"{path}: the vocabulary corpus is empty")
    return str(path.resolve()), texts


def _public_corpus(cache: Path) -> tuple[str, list[str]]:
    """The English the install fetches, less what evaluation holds out (Persuasion, WordNet): Austen's five other
    novels, the King James Bible (public domain), the Python documentation's prose (PSF), the fortune database
    (BSD) and SCOWL's American English word list (size 80). The books alone kept 37,021 of SmolLM2's 49,152 tokens
    and cost +0.6% perplexity on Persuasion but +38% on WordNet's definitions, whose modern and technical words
    ("organisms", "tissue") they never use; the word list brings those back (benchmarks/results/vocab_trim.md)."""
    try:
        books = sources.austen_books(cache)
        parts = {"austen": [p for name in sources.AUSTEN_TRAIN for p in books[name].split("\n\n")],
                 "kjv": sources.kjv().splitlines(),  # a verse a line
                 "pydocs": sources.python_docs().split("\n\n"), "fortunes": sources.fortunes().split("\n\n"),
                 "words": word_texts(sources.english_words())}
    except (sources.MissingDataPackage, subprocess.CalledProcessError, FileNotFoundError, OSError) as exc:
        raise VocabSourceError(f"the '{PUBLIC}' corpus needs the data packages the install fetches "
                               f"({', '.join(sources.APT_PACKAGES)} and {sources.AUSTEN_DEB}): {exc}; run make "
                               "install (or scripts/install_data_packages.sh as root), or name a corpus file") from None
    texts = [t.strip() for part in parts.values() for t in part if t.strip()]
    names = "; ".join(sources.SOURCES[k].name for k in parts)
    return f"{names} (the install's text; Persuasion and WordNet held out)", texts


def word_texts(words: list[str], per_text: int = 500) -> list[str]:
    """A word list as text that uses each word the four ways running text does: after a space and at a line's
    start, as written and capitalised ("word Word" / "Word word" lines, `per_text` words a text)."""
    lines = []
    for word in words:
        capital = word[:1].upper() + word[1:]
        lines.append(f"{word} {capital}\n{capital} {word}")
    return ["\n".join(lines[i:i + per_text]) for i in range(0, len(lines), per_text)]


def corpus_digest(texts: list[str]) -> str:
    """sha256 of a corpus as read (what the trim record, the cache name and lineage carry)."""
    return hashlib.sha256("\n\n".join(texts).encode()).hexdigest()


def read_trim_record(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / TRIM_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class KeptVocabulary:
    """What a corpus keeps of a tokenizer's vocabulary: the trim, and the corpus as read and encoded (the round
    trip compares the trimmed tokenizer's encodings with these)."""

    corpus: str
    corpus_sha256: str
    texts: list[str]
    encoded: list[np.ndarray]
    trim: VocabTrim


def encode_corpus(tokenizer, texts: list[str], chunk_chars: int = 500_000) -> list[np.ndarray]:  # noqa: ANN001
    """Each text's token ids (no special tokens added; `tokenizer` a fast one) as an int32 array, encoded about
    `chunk_chars` characters at a time: the `public` corpus's encodings at once (offsets, token strings and all)
    took 1.4 GB, its ids take 32 MB."""
    import numpy as np

    backend = tokenizer.backend_tokenizer
    out: list[np.ndarray] = []
    start = 0
    while start < len(texts):
        end, size = start, 0
        while end < len(texts) and (end == start or size + len(texts[end]) <= chunk_chars):
            size += len(texts[end])
            end += 1
        out += [np.asarray(e.ids, dtype=np.int32)
                for e in backend.encode_batch(texts[start:end], add_special_tokens=False)]
        start = end
    return out


def kept_vocabulary(tokenizer, corpus: str, cache: Path) -> KeptVocabulary:  # noqa: ANN001 - a fast tokenizer
    """The tokens `corpus` keeps of `tokenizer` (no weights read: what `plan` and the preflight count)."""
    import numpy as np

    from pip_core.vocab_trim import tokens_to_keep

    if not getattr(tokenizer, "is_fast", False):
        raise VocabSourceError("vocabulary trimming rewrites a fast tokenizer (tokenizer.json); this model has none")
    name, texts = corpus_texts(corpus, cache)
    encoded = encode_corpus(tokenizer, texts)
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    used = np.unique(np.concatenate(encoded)).tolist() if encoded else []
    trim = tokens_to_keep(data, [used], also=tokenizer.all_special_ids)
    return KeptVocabulary(name, corpus_digest(texts), texts, encoded, trim)


def trim_to_dir(model_dir: Path, corpus: str, out: Path, cache: Path) -> TrimRecord:
    """Write `model_dir` with its vocabulary trimmed to `corpus` at `out` (refused if `out` exists)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pip_core.units import param_count
    from pip_core.vocab_trim import trim_model, trimmed_tokenizer_config, trimmed_tokenizer_json

    if out.exists():
        raise VocabSourceError(f"{out} exists; name a new directory (pipprune never overwrites one)")
    if not (model_dir / "tokenizer.json").is_file():
        raise VocabSourceError(f"{model_dir} has no tokenizer.json: vocabulary trimming rewrites a fast tokenizer")
    kept = kept_vocabulary(AutoTokenizer.from_pretrained(model_dir), corpus, cache)
    trim, texts = kept.trim, kept.texts
    data = json.loads((model_dir / "tokenizer.json").read_text())
    log.info("vocabulary: %d of %d tokens kept for %d texts of %s", len(trim.keep), trim.vocab_before, len(texts),
             kept.corpus)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    with torch.no_grad():
        before = param_count(model)
        trim_model(model, trim)
        after = param_count(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        for file in _TOKENIZER_FILES:
            if (model_dir / file).is_file():
                shutil.copy(model_dir / file, tmp / file)
        layout = model_dir_layout(model_dir)
        for folder in (layout.calibration.parent, layout.tasks):  # a reference build's texts and tasks go with it
            if folder.is_dir():
                shutil.copytree(folder, tmp / folder.name)
        (tmp / "tokenizer.json").write_text(json.dumps(trimmed_tokenizer_json(data, trim), ensure_ascii=False))
        if (model_dir / "tokenizer_config.json").is_file():
            config = json.loads((model_dir / "tokenizer_config.json").read_text())
            (tmp / "tokenizer_config.json").write_text(json.dumps(trimmed_tokenizer_config(config, trim), indent=1))
        _check_round_trip(tmp, texts, kept.encoded, trim)
        record = TrimRecord(source=str(model_dir), corpus=kept.corpus, corpus_sha256=kept.corpus_sha256,
                            corpus_texts=len(texts), vocab_before=trim.vocab_before, vocab_after=len(trim.keep),
                            params_before=before, params_after=after, kept_sha256=trim.digest)
        (tmp / TRIM_RECORD).write_text(json.dumps({**asdict(record), "kept_ids": list(trim.keep)}))
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return record


def cached_copy_dir(fingerprint: str, corpus_sha256: str, cache: Path) -> Path:
    """Where the trimmed copy of the model with `fingerprint` to the corpus with `corpus_sha256` lies in the cache
    (what a registered version's lineage tags name, so a later export finds its dense model)."""
    return cache / "vocab" / hashlib.sha256(f"{fingerprint}|{corpus_sha256}".encode()).hexdigest()[:20]


@dataclass(frozen=True)
class RecordedCopy:
    """A registered version's trimmed dense model as found in this machine's cache: where it should lie, whether
    it is there, and why the copy there is not the one the version records (None: it is)."""

    path: Path
    present: bool
    mismatch: str | None

    @property
    def usable(self) -> bool:
        return self.present and self.mismatch is None


def recorded_copy(tags: dict[str, str], cache: Path) -> RecordedCopy:
    """The trimmed copy a version's lineage tags name (the source's fingerprint and the corpus's sha256 give its
    place), checked against the kept ids' sha256 and the dense fingerprint they record."""
    from infra import tags as tag_names
    from pip_core.io import model_fingerprint

    path = cached_copy_dir(tags.get(tag_names.SOURCE_FINGERPRINT, ""), tags.get(tag_names.VOCAB_CORPUS_SHA256, ""),
                           cache)
    record = read_trim_record(path)
    if record is None or not (path / "config.json").is_file():
        return RecordedCopy(path, False, None)
    kept, dense = tags.get(tag_names.VOCAB_KEPT_SHA256, ""), tags.get(tag_names.VOCAB_DENSE_FINGERPRINT, "")
    if record.get("kept_sha256") != kept:
        why = f"kept ids sha256 {str(record.get('kept_sha256'))[:16]} != recorded {kept[:16]}"
    elif model_fingerprint(path) != dense:
        why = f"fingerprint differs from the recorded {dense[:12]}"
    else:
        why = None
    return RecordedCopy(path, True, why)


def trimmed_copy(model_dir: Path, fingerprint: str, corpus: str, cache: Path) -> tuple[Path, dict]:
    """`model_dir` trimmed to `corpus`, written once into the cache under a name made of the source's content and
    the corpus's (a rerun, or a resumed run, reads the same directory), and its record (without the kept ids)."""
    _, texts = corpus_texts(corpus, cache)
    out = cached_copy_dir(fingerprint, corpus_digest(texts), cache)
    if read_trim_record(out) is None:
        try:
            trim_to_dir(model_dir, corpus, out, cache)
        except VocabSourceError:
            if read_trim_record(out) is None:  # not another run writing the same directory first
                raise
    record = read_trim_record(out)
    return out, {k: v for k, v in record.items() if k != "kept_ids"}


def _check_round_trip(model_dir: Path, texts: list[str], encoded: list[np.ndarray], trim: VocabTrim) -> None:
    """Every corpus text encodes with the written tokenizer to its original tokens, renumbered."""
    import numpy as np
    from transformers import AutoTokenizer

    renumber = np.full(trim.vocab_before, -1, dtype=np.int64)
    renumber[list(trim.keep)] = np.arange(len(trim.keep))
    again = encode_corpus(AutoTokenizer.from_pretrained(model_dir), texts)
    for i, (new, old) in enumerate(zip(again, encoded, strict=True)):
        if not np.array_equal(new, renumber[old]):
            raise VocabSourceError(f"the trimmed tokenizer encodes corpus text {i} differently ({texts[i][:60]!r}); "
                                   "nothing was written")
