"""Perturbed views for PIP: a few words get one character edit that yields another real word.

"later" -> "alter" (adjacent swap), "host" -> "ghost" (insertion), "cat" -> "bat" (replacement):
the meaning changes while the grammar and length stay almost the same. Deterministic and
offline: the random choices are seeded by (seed, sample id, text), so a text's perturbation does
not depend on call order, and validity is decided by a word list, not a model.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pip_core.errors import CalibrationError
from pip_core.wordlist import WordList

TOKEN = re.compile(r"[A-Za-z]+")
LETTERS = string.ascii_lowercase
OPS = ("swap", "replace", "insert")


class NotPerturbableError(CalibrationError):
    """No word of the text has a single-edit neighbour in the word list."""


@dataclass(frozen=True)
class Edit:
    """One word changed: its index among the text's words, the word before and after, the edit (swap/replace/insert)."""

    position: int
    original_word: str
    new_word: str
    op: str


@dataclass(frozen=True)
class PerturbedPair:
    """A calibration text, its perturbed view and the edits between them."""

    original: str
    perturbed: str
    edits: tuple[Edit, ...]


@dataclass
class PerturbationResult:
    pairs: list[PerturbedPair]
    skipped: list[int]
    stats: dict[str, int] = field(default_factory=dict)


class PerturberLike(Protocol):
    def perturb(self, text: str, sample_id: int | str = 0) -> PerturbedPair: ...

    def perturb_many(self, texts: Sequence[str]) -> PerturbationResult: ...


def single_edits(word: str) -> list[tuple[str, str]]:
    """Every (op, candidate) one character edit away from lowercase `word`."""
    out: list[tuple[str, str]] = []
    for i in range(len(word) - 1):
        if word[i] != word[i + 1]:
            out.append(("swap", word[:i] + word[i + 1] + word[i] + word[i + 2:]))
    for i in range(len(word)):
        for c in LETTERS:
            if c != word[i]:
                out.append(("replace", word[:i] + c + word[i + 1:]))
    for i in range(len(word) + 1):
        for c in LETTERS:
            out.append(("insert", word[:i] + c + word[i:]))
    return out


def match_case(template: str, word: str) -> str:
    """Carry the capitalisation pattern of `template` (lower, Title, UPPER) over to `word`."""
    if template.isupper() and len(template) > 1:
        return word.upper()
    if template[0].isupper():
        return word[0].upper() + word[1:]
    return word


class Perturber:
    """Seeded, word-list-validated single-edit perturber."""

    def __init__(self, words: WordList, rate: float = 0.15, seed: int = 0, min_word_len: int = 3,
                 max_edits: int | None = None) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"perturbation rate must be in (0, 1], got {rate}")
        self.words, self.rate, self.seed = words, rate, seed
        self.min_word_len, self.max_edits = min_word_len, max_edits
        self._neighbours: dict[str, list[tuple[str, str]]] = {}

    def neighbours(self, word: str) -> list[tuple[str, str]]:
        """Valid (op, new word) edits of lowercase `word`, deduplicated, in a fixed order."""
        if word not in self._neighbours:
            seen: dict[str, str] = {}
            for op, cand in single_edits(word):
                if cand != word and cand in self.words.words and cand not in seen:
                    seen[cand] = op
            self._neighbours[word] = [(op, w) for w, op in sorted(seen.items())]
        return self._neighbours[word]

    def _rng(self, text: str, sample_id: int | str) -> random.Random:
        digest = hashlib.sha256(f"{self.seed}\0{sample_id}\0{text}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "big"))

    def perturb(self, text: str, sample_id: int | str = 0) -> PerturbedPair:
        """Edit about `rate` of the editable words (at least one); raise if none is editable."""
        spots = [(m.start(), m.group()) for m in TOKEN.finditer(text)
                 if len(m.group()) >= self.min_word_len and self.neighbours(m.group().lower())]
        if not spots:
            raise NotPerturbableError(f"no word in the text has a one-edit real-word neighbour: {text[:60]!r}")
        rng = self._rng(text, sample_id)
        n_words = max(1, len(TOKEN.findall(text)))
        k = max(1, min(len(spots), round(self.rate * n_words)))
        if self.max_edits is not None:
            k = min(k, self.max_edits)
        chosen = sorted(rng.sample(spots, k))
        edits: list[Edit] = []
        pieces: list[str] = []
        cursor = 0
        for start, word in chosen:
            op, new = rng.choice(self.neighbours(word.lower()))
            new = match_case(word, new)
            edits.append(Edit(position=start, original_word=word, new_word=new, op=op))
            pieces.append(text[cursor:start])
            pieces.append(new)
            cursor = start + len(word)
        pieces.append(text[cursor:])
        return PerturbedPair(original=text, perturbed="".join(pieces), edits=tuple(edits))

    def perturb_many(self, texts: Sequence[str]) -> PerturbationResult:
        """Perturb each text (its index is its sample id); texts with no editable word are reported."""
        pairs, skipped = [], []
        for i, text in enumerate(texts):
            try:
                pairs.append(self.perturb(text, sample_id=i))
            except NotPerturbableError:
                skipped.append(i)
        edits = [e for p in pairs for e in p.edits]
        stats = {"texts": len(texts), "pairs": len(pairs), "skipped": len(skipped), "edits": len(edits)}
        stats.update({f"op_{op}": sum(e.op == op for e in edits) for op in OPS})
        return PerturbationResult(pairs=pairs, skipped=skipped, stats=stats)


class LMPerturber(Perturber):
    """Option: a local causal LM picks, among the valid single-edit real words, the one it finds
    most (or least) plausible in context. Same validity guarantees as `Perturber`; slower.

    The paper used an auxiliary LLM to rewrite; this keeps the edit real-word and single-character
    while letting a model judge fluency, and stays deterministic for a fixed model.
    """

    def __init__(self, words: WordList, model, tokenizer, prefer: str = "likely", **kwargs) -> None:  # noqa: ANN001
        super().__init__(words, **kwargs)
        if prefer not in ("likely", "unlikely"):
            raise ValueError("prefer must be 'likely' or 'unlikely'")
        self.model, self.tokenizer, self.prefer = model, tokenizer, prefer

    def _score(self, prefix: str, word: str) -> float:
        import torch

        ids = self.tokenizer(prefix + word, return_tensors="pt")["input_ids"]
        n_prefix = self.tokenizer(prefix, return_tensors="pt")["input_ids"].shape[1] if prefix else 0
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.model.device)).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None].to(logits.device))[:, 0]
        return float(logp[max(0, n_prefix - 1):].sum())

    def perturb(self, text: str, sample_id: int | str = 0) -> PerturbedPair:
        base = super().perturb(text, sample_id)
        edits, pieces, cursor = [], [], 0
        for e in base.edits:
            options = self.neighbours(e.original_word.lower())
            scored = sorted(options, key=lambda o: self._score(text[:e.position], match_case(e.original_word, o[1])))
            op, new = scored[-1] if self.prefer == "likely" else scored[0]
            new = match_case(e.original_word, new)
            edits.append(Edit(e.position, e.original_word, new, op))
            pieces += [text[cursor:e.position], new]
            cursor = e.position + len(e.original_word)
        pieces.append(text[cursor:])
        return PerturbedPair(original=text, perturbed="".join(pieces), edits=tuple(edits))
