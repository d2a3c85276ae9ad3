"""How far a pruned model's next-token distribution moved from the dense model's, on held-out text.

Mean per-token KL(dense || pruned), top-1 agreement and the perplexity ratio move with every
change of the model, unlike accuracy on tasks a small model answers at chance. Both models run
once per document; the vocabulary projection is applied `chunk_tokens` positions at a time, so
at most [chunk_tokens x vocab] logits of each model exist at once (never [tokens x vocab]). By
default a slice holds SLICE_BYTES of float32 logits: the KL of one slice makes about five tensors
of its size, and on SmolLM2-135M whole 128-token slices made the quick eval the run's peak.
Per-document sums are kept so intervals can be bootstrapped over documents (pip_core.bootstrap).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pip_core.errors import PipCoreError

#: per-document sums kept for every document (all per predicted token)
FIELDS = ("kl", "agree", "nll_dense", "nll_pruned", "tokens")
#: float32 logits of one slice at most (4 MiB: 21 positions of a 49k vocabulary, 8 of a 128k one)
SLICE_BYTES = 4 * 2**20
MIN_SLICE_TOKENS = 8


def slice_tokens(vocab: int) -> int:
    """Positions per slice for a vocabulary of `vocab`: one slice of float32 logits within SLICE_BYTES."""
    return max(MIN_SLICE_TOKENS, SLICE_BYTES // (4 * max(vocab, 1)))


@dataclass(frozen=True)
class DocStats:
    """Per-document sums over predicted tokens; the metrics are ratios of their totals."""

    kl: torch.Tensor
    agree: torch.Tensor
    nll_dense: torch.Tensor
    nll_pruned: torch.Tensor
    tokens: torch.Tensor

    def metrics(self, weights: torch.Tensor | None = None) -> dict[str, float]:
        """Token-weighted metrics over all documents (or a bootstrap resample given as per-doc counts)."""
        w = torch.ones_like(self.tokens) if weights is None else weights.to(self.tokens.dtype)
        n = float((self.tokens * w).sum())
        nll_d, nll_p = float((self.nll_dense * w).sum()) / n, float((self.nll_pruned * w).sum()) / n
        return {"kl": float((self.kl * w).sum()) / n, "top1_agreement": float((self.agree * w).sum()) / n,
                "ppl_ratio": math.exp(nll_p - nll_d), "ppl_dense": math.exp(nll_d), "ppl_pruned": math.exp(nll_p),
                "tokens": n, "documents": float(len(self.tokens))}

    def to_json(self) -> dict[str, list[float]]:
        return {f: getattr(self, f).tolist() for f in FIELDS}

    @classmethod
    def from_json(cls, data: dict[str, list[float]]) -> DocStats:
        return cls(**{f: torch.tensor(data[f], dtype=torch.float64) for f in FIELDS})


def _hidden_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module, float | None]:
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or head is None:
        raise PipCoreError(f"{type(model).__name__} exposes no decoder/output embeddings; cannot chunk its logits")
    return base, head, getattr(model.config, "final_logit_softcapping", None)


def _logits(head: nn.Module, hidden: torch.Tensor, cap: float | None) -> torch.Tensor:
    logits = head(hidden).float()
    return torch.tanh(logits / cap) * cap if cap else logits


def encode(tokenizer, texts: Sequence[str], max_length: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Token ids per text (truncated); texts under 2 tokens predict nothing and are refused."""
    if not texts:
        raise PipCoreError("divergence needs at least one held-out text")
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise PipCoreError(f"held-out text {i} is {type(text).__name__}, not str")
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"][0]
        if ids.numel() < 2:
            raise PipCoreError(f"held-out text {i} is shorter than 2 tokens: {text[:40]!r}")
        out.append(ids)
    return out


class CachedDense:
    """The dense model's next-token log-probabilities on held-out documents, written once to disk.

    A run compares every pruned step with the dense model; holding a second copy of the model in
    memory for that doubles the run's peak. The log-probabilities (float32, exactly what the live
    model gives) are read back one document at a time instead, and the token ids they were made
    for are kept beside them, so a different tokenization is refused rather than compared.
    """

    def __init__(self, folder: Path) -> None:
        meta = json.loads((Path(folder) / "meta.json").read_text())
        self.folder, self.vocab_size, self.ids = Path(folder), int(meta["vocab_size"]), meta["ids"]

    @classmethod
    def open(cls, folder: Path) -> CachedDense | None:
        return cls(folder) if (Path(folder) / "meta.json").is_file() else None

    @classmethod
    @torch.no_grad()
    def build(cls, dense: nn.Module, tokenizer, texts: Sequence[str], max_length: int,  # noqa: ANN001
              folder: Path, chunk_tokens: int | None = None) -> CachedDense:
        """Write the cache into `folder` (via a private sibling renamed into place: never half-written).

        Each document's file is a .npy array written one slice at a time, so no [tokens x vocab]
        tensor is ever held (plain writes, not a memory map: a full disk says "No space left").
        """
        import shutil
        import tempfile

        import numpy as np

        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
        base, head, cap = _hidden_and_head(dense)
        chunk_tokens = chunk_tokens or slice_tokens(dense.config.vocab_size)
        mode = dense.training
        dense.eval()
        try:
            seqs = encode(tokenizer, texts, max_length)
            for i, ids in enumerate(seqs):
                hidden = base(input_ids=ids.unsqueeze(0).to(next(dense.parameters()).device)).last_hidden_state[0, :-1]
                with (tmp / f"doc-{i:05d}.npy").open("wb") as fh:
                    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False,
                              "shape": (hidden.shape[0], head.weight.shape[0])}
                    np.lib.format.write_array_header_1_0(fh, header)
                    for s in range(0, hidden.shape[0], chunk_tokens):
                        logp = torch.log_softmax(_logits(head, hidden[s:s + chunk_tokens], cap), -1)
                        fh.write(logp.cpu().numpy().astype(np.float32, copy=False).tobytes())
            (tmp / "meta.json").write_text(json.dumps({"vocab_size": dense.config.vocab_size,
                                                       "ids": [s.tolist() for s in seqs]}))
            try:
                tmp.rename(folder)
            except OSError:  # another run wrote the same cache first
                pass
        finally:
            dense.train(mode)
            shutil.rmtree(tmp, ignore_errors=True)
        return cls(folder)

    def mean_nll(self) -> float:
        """The dense model's mean negative log-likelihood per predicted token of the cached documents, read from
        the log-probabilities of the tokens that follow (its held-out perplexity with no forward pass)."""
        total, tokens = 0.0, 0
        for i, ids in enumerate(self.ids):
            target = torch.as_tensor(ids[1:])
            logp = self.logprobs(i, torch.as_tensor(ids))
            total -= float(logp.gather(1, target[:, None]).double().sum())
            tokens += target.numel()
        return total / tokens

    def logprobs(self, i: int, ids: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """[tokens - 1, vocab] log-probabilities of document `i` (or its `rows`), made for exactly these token ids.

        Only the rows asked for are read from the file (a seek past the others), never the whole document.
        """
        import numpy as np

        if ids.tolist() != self.ids[i]:
            raise PipCoreError(f"dense log-probability cache {self.folder} was made for other tokens of document {i}")
        with (self.folder / f"doc-{i:05d}.npy").open("rb") as fh:
            major, _ = np.lib.format.read_magic(fh)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(fh)
            if fortran or dtype != np.float32 or len(shape) != 2:
                raise PipCoreError(f"dense log-probability cache {self.folder} doc {i}: unexpected array {shape} {dtype}")
            start, stop, _ = (rows or slice(None)).indices(shape[0])
            fh.seek(start * shape[1] * 4, 1)
            data = fh.read(max(stop - start, 0) * shape[1] * 4)
        return torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(-1, shape[1]).copy())


@torch.no_grad()
def doc_stats(dense: nn.Module | CachedDense, pruned: nn.Module, tokenizer, texts: Sequence[str],  # noqa: ANN001
              max_length: int = 256, chunk_tokens: int | None = None) -> DocStats:
    """Per-document KL(dense || pruned), top-1 agreements and both NLLs, summed over predicted tokens.

    `dense` is the dense model itself or its log-probabilities cached on disk (`CachedDense`);
    `chunk_tokens` defaults to `slice_tokens` of the vocabulary.
    """
    chunk_tokens = slice_tokens(pruned.config.vocab_size) if chunk_tokens is None else chunk_tokens
    if chunk_tokens < 1:
        raise PipCoreError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    cached = dense if isinstance(dense, CachedDense) else None
    dense_vocab = cached.vocab_size if cached else dense.config.vocab_size
    if dense_vocab != pruned.config.vocab_size:
        raise PipCoreError(f"vocabularies differ: dense {dense_vocab}, pruned {pruned.config.vocab_size}")
    seqs = encode(tokenizer, texts, max_length)
    models = (pruned,) if cached else (dense, pruned)
    parts = [(m, *_hidden_and_head(m)) for m in models]
    modes = [m.training for m in models]
    rows: list[list[float]] = []
    try:
        for m in models:
            m.eval()
        for i, ids in enumerate(seqs):
            hidden = []
            for model, base, _, _ in parts:
                x = ids.unsqueeze(0).to(next(model.parameters()).device)
                hidden.append(base(input_ids=x).last_hidden_state[0, :-1])
            target = ids[1:]
            sums = torch.zeros(4, dtype=torch.float64)
            for start in range(0, target.numel(), chunk_tokens):
                sl = slice(start, start + chunk_tokens)
                *_, (_, _, head_p, cap_p) = parts
                logp_p = torch.log_softmax(_logits(head_p, hidden[-1][sl], cap_p), -1)
                logp_d = (cached.logprobs(i, ids, sl).to(logp_p.device) if cached else
                          torch.log_softmax(_logits(parts[0][2], hidden[0][sl], parts[0][3]), -1))
                logp_p = logp_p.to(logp_d.device)
                t = target[sl].to(logp_d.device).unsqueeze(-1)
                sums += torch.stack([
                    (logp_d.exp() * (logp_d - logp_p)).sum(-1).sum().double(),
                    (logp_d.argmax(-1) == logp_p.argmax(-1)).sum().double(),
                    -logp_d.gather(-1, t).sum().double(),
                    -logp_p.gather(-1, t).sum().double(),
                ]).cpu()
            rows.append([*sums.tolist(), float(target.numel())])
    finally:
        for m, mode in zip(models, modes, strict=True):
            m.train(mode)
    cols = torch.tensor(rows, dtype=torch.float64).T
    return DocStats(*cols)


def divergence(dense: nn.Module | CachedDense, pruned: nn.Module, tokenizer, texts: Sequence[str],  # noqa: ANN001
               max_length: int = 256, chunk_tokens: int | None = None) -> dict[str, float]:
    """Mean per-token KL(dense || pruned), top-1 agreement and perplexity ratio (pruned / dense)."""
    return doc_stats(dense, pruned, tokenizer, texts, max_length, chunk_tokens).metrics()


def read_texts(path: Path) -> list[str]:
    """Held-out documents: JSONL with a "text" field per line, or plain text split on blank lines."""
    path = Path(path)
    if not path.is_file():
        raise PipCoreError(f"held-out text file {path} does not exist")
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PipCoreError(f"{path}:{n} is not JSON: {exc}") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise PipCoreError(f"{path}:{n} has no string field 'text'")
            texts.append(row["text"])
    else:
        texts = [t.strip() for t in raw.split("\n\n") if t.strip()]
    if not texts:
        raise PipCoreError(f"held-out text file {path} holds no documents")
    return texts
