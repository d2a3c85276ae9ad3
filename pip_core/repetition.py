"""How much a model repeats itself: the share of distinct n-grams among its greedy continuations' tokens.

Perplexity and KL read text the model is given; a model whose own output loops ("and second, and third, and
fourth, ...") can keep both within bounds. Its continuations show it, compared with the dense model's own
continuations of the same prompts: real text repeats too (function words, a name), and a small model's greedy
text loops by itself. Single tokens by default, from SmolLM2-135M's figures (8 prompts, 64 tokens; the dense model
loops on about a third of prompts itself): an enumeration loop repeated on every prompt is at 0.68 of the dense
model's share of distinct tokens, another wording of the same prompts at 0.82; its bigrams are as distinct as the
dense model's (0.85-1.0: ", and" repeats, but the dense model's own loops repeat whole sentences) and its trigrams
more (every one holds a new ordinal). A plain loop ("of the most of the most") is at 0.25 on any n.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

NGRAM = 1


def ngram_name(n: int = NGRAM) -> str:
    """How the summary and the verdict name the unit counted."""
    return {1: "tokens", 2: "bigrams", 3: "trigrams"}.get(n, f"{n}-grams")


def ngram_counts(tokens: Sequence[Hashable], n: int = NGRAM) -> tuple[int, int]:
    """(distinct n-grams, all n-grams) of one sequence; (0, 0) when it is shorter than `n`."""
    if n < 1:
        raise ValueError(f"n-grams need n >= 1, got {n}")
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)), len(grams)


def distinct_share(sequences: Sequence[Sequence[Hashable]], n: int = NGRAM) -> float | None:
    """Distinct over all n-grams, counted within each sequence and summed over them (a long loop weighs as many
    n-grams as it has); None when no sequence has an n-gram."""
    counts = [ngram_counts(seq, n) for seq in sequences]
    total = sum(all_ for _, all_ in counts)
    return sum(distinct for distinct, _ in counts) / total if total else None
