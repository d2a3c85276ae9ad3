"""The training mix and the held-out text, cleaned, cached and content-hashed."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from infra.reference import sources

log = logging.getLogger(__name__)

CORPUS_VERSION = "1"


@dataclass(frozen=True)
class Corpus:
    """Training texts per source and the held-out novel, as cached files."""

    files: dict[str, Path]  # source -> text file (training)
    heldout: Path
    sha256: dict[str, str]

    def train_texts(self) -> dict[str, str]:
        return {name: path.read_text() for name, path in self.files.items()}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.sha256, sort_keys=True).encode()).hexdigest()


def _write(path: Path, text: str) -> str:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return hashlib.sha256(text.encode()).hexdigest()


def build_corpus(cache_dir: Path) -> Corpus:
    """Extract every source once into `cache_dir/corpus-v<N>`; later calls reuse the files."""
    out = cache_dir / f"corpus-v{CORPUS_VERSION}"
    index = out / "index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        return Corpus(files={k: out / f"{k}.txt" for k in meta["train"]}, heldout=out / "persuasion.txt",
                      sha256=meta["sha256"])
    out.mkdir(parents=True, exist_ok=True)
    sources.ensure_apt_packages()
    books = sources.austen_books(cache_dir)
    texts = {
        "austen": "\n\n".join(books[name] for name in sources.AUSTEN_TRAIN),
        "kjv": sources.kjv(),
        "pydocs": sources.python_docs(),
        "fortunes": sources.fortunes(),
    }
    heldout = books[sources.AUSTEN_HELDOUT]
    sha = {name: _write(out / f"{name}.txt", text) for name, text in texts.items()}
    sha["persuasion"] = _write(out / "persuasion.txt", heldout)
    for name, text in texts.items():
        log.info("corpus %s: %.2f MB", name, len(text) / 1e6)
    index.write_text(json.dumps({"train": sorted(texts), "sha256": sha}, indent=1))
    return Corpus(files={k: out / f"{k}.txt" for k in texts}, heldout=out / "persuasion.txt", sha256=sha)
