"""The set of real words that decides whether an edited word is valid (offline, content-hashed)."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pip_core.errors import CalibrationError

WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class WordList:
    """Lowercase alphabetic words; `sha256` identifies the list in caches and lineage."""

    words: frozenset[str]
    sha256: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.words:
            raise CalibrationError("the word list is empty: the perturber needs real words to decide validity")
        if not self.sha256:
            digest = hashlib.sha256("\n".join(sorted(self.words)).encode()).hexdigest()
            object.__setattr__(self, "sha256", digest)

    def __contains__(self, word: object) -> bool:
        return isinstance(word, str) and word.lower() in self.words

    def __len__(self) -> int:
        return len(self.words)

    @classmethod
    def of(cls, words: Iterable[str]) -> WordList:
        return cls(frozenset(w.lower() for w in words if w and w.isascii() and w.isalpha()))

    @classmethod
    def from_file(cls, path: str | Path) -> WordList:
        """One word per line (e.g. /usr/share/dict/words); non-alphabetic entries are skipped."""
        raw = Path(path).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        return cls.of(line.strip() for line in text.splitlines())

    @classmethod
    def from_texts(cls, texts: Iterable[str], min_count: int = 2, min_len: int = 2) -> WordList:
        """The vocabulary of a corpus: words seen at least `min_count` times."""
        counts = Counter(w.lower() for t in texts for w in WORD.findall(t) if len(w) >= min_len)
        return cls.of(w for w, c in counts.items() if c >= min_count)

    def union(self, other: WordList) -> WordList:
        return WordList(self.words | other.words)

    def write(self, path: str | Path) -> None:
        Path(path).write_text("\n".join(sorted(self.words)) + "\n")
