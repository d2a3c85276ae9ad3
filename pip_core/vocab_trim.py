"""Vocabulary trimming: keep the tokens a corpus uses, drop the embedding and LM-head rows of the rest.

A model served to one language's users carries tens of thousands of tokens of scripts they never type, and in a
small model with a large vocabulary those rows are most of the parameters (arXiv 2305.15020, "An Efficient
Multilingual Language Model Compression through Vocabulary Trimming": about half of a multilingual vocabulary
goes with no loss on the kept language, without retraining).

What is kept, for a byte-level BPE tokenizer (GPT-2, Llama 3, SmolLM, Qwen): every id the corpus encodes to,
every token a merge builds on the way to one of them (BPE applies merges in rank order, so a kept merge set that
holds every merge the corpus's encodings applied applies them again, in the same order: each kept text encodes to
the same tokens, renumbered), the special and added tokens, and the base alphabet (every byte), so any text still
encodes, in more pieces where its tokens were dropped. The tokenizer.json is rewritten (vocabulary, merges, added
tokens, the post-processor's ids) and the model's rows selected, ids renumbered in their old order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from pip_core.errors import PipCoreError


class VocabTrimError(PipCoreError):
    """A tokenizer or model this trimming cannot rewrite exactly; the message says which part."""


@dataclass(frozen=True)
class VocabTrim:
    """The kept token ids of the original vocabulary, ascending: new id i is old id `keep[i]`."""

    keep: tuple[int, ...]
    vocab_before: int

    def __post_init__(self) -> None:
        if list(self.keep) != sorted(set(self.keep)) or (self.keep and not 0 <= self.keep[0] <= self.keep[-1]
                                                         < self.vocab_before):
            raise VocabTrimError("kept ids must be distinct, ascending and inside the vocabulary")

    @cached_property
    def mapping(self) -> dict[int, int]:
        """old id -> new id, for the kept ids (built once: `remap` runs per text of a corpus of tens of thousands,
        and rebuilding it per call made trimming to the `public` corpus take 475 s)."""
        return {old: new for new, old in enumerate(self.keep)}

    @property
    def digest(self) -> str:
        """sha256 of the kept-id list (what lineage records)."""
        return hashlib.sha256(json.dumps(list(self.keep)).encode()).hexdigest()

    def remap(self, ids: Iterable[int]) -> list[int]:
        """Old ids as new ones (a dropped id is an error: it has no row left)."""
        mapping = self.mapping
        try:
            return [mapping[int(i)] for i in ids]
        except KeyError as exc:
            raise VocabTrimError(f"token id {exc.args[0]} was dropped by the trim") from None


def _merges(model: dict) -> list[tuple[str, str]]:
    """The BPE merges as pairs, whichever of tokenizer.json's two spellings ("a b" or ["a", "b"]) it uses."""
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model.get("merges", [])]


def _bpe_model(tokenizer_json: dict) -> dict:
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        raise VocabTrimError(f"vocabulary trimming rewrites BPE tokenizers; this one is {model.get('type')!r}")
    return model


def tokens_to_keep(tokenizer_json: dict, encoded: Iterable[Sequence[int]], also: Iterable[int] = ()) -> VocabTrim:
    """The trim that keeps every id of `encoded` (the corpus, encoded by this tokenizer), the tokens the merges
    build them from, the added and special tokens, the base alphabet (tokens no merge builds: every byte of a
    byte-level vocabulary, the byte-fallback tokens) and `also`."""
    model = _bpe_model(tokenizer_json)
    vocab: dict[str, int] = model["vocab"]
    size = max([*vocab.values(), *(t["id"] for t in tokenizer_json.get("added_tokens", []))]) + 1
    by_id = {i: tok for tok, i in vocab.items()}
    built_from: dict[str, list[tuple[str, str]]] = {}
    for a, b in _merges(model):
        built_from.setdefault(a + b, []).append((a, b))
    keep = {i for tok, i in vocab.items() if tok not in built_from}  # the alphabet: what no merge builds
    keep |= {t["id"] for t in tokenizer_json.get("added_tokens", [])}
    keep |= {int(i) for i in also}
    keep |= {int(i) for ids in encoded for i in ids}
    todo = [by_id[i] for i in keep if i in by_id]
    seen: set[str] = set()
    while todo:
        tok = todo.pop()
        if tok in seen:
            continue
        seen.add(tok)
        keep.add(vocab[tok])
        for a, b in built_from.get(tok, ()):
            todo += [a, b]
    return VocabTrim(tuple(sorted(keep)), size)


def trimmed_tokenizer_json(tokenizer_json: dict, trim: VocabTrim) -> dict:
    """`tokenizer_json` with only the kept tokens, renumbered: the vocabulary, the merges whose parts and result are
    all kept (in their order, so the kept ones apply as before), the added tokens and the post-processor's ids."""
    out = json.loads(json.dumps(tokenizer_json))
    model = _bpe_model(out)
    mapping = trim.mapping
    kept_tokens = {tok: mapping[i] for tok, i in model["vocab"].items() if i in mapping}
    spelled_as_list = bool(model.get("merges")) and isinstance(model["merges"][0], list)
    merges = [(a, b) for a, b in _merges(model) if a in kept_tokens and b in kept_tokens and a + b in kept_tokens]
    model["vocab"] = dict(sorted(kept_tokens.items(), key=lambda kv: kv[1]))
    model["merges"] = [list(m) for m in merges] if spelled_as_list else [f"{a} {b}" for a, b in merges]
    out["added_tokens"] = [{**t, "id": mapping[t["id"]]} for t in out.get("added_tokens", [])]
    _remap_post_processor(out.get("post_processor"), mapping)
    return out


def _remap_post_processor(processor: Any, mapping: dict[int, int]) -> None:
    """The special tokens' ids a TemplateProcessing (or a Sequence of processors) inserts, renumbered in place."""
    if not isinstance(processor, dict):
        return
    for inner in processor.get("processors", []) or []:
        _remap_post_processor(inner, mapping)
    for name, special in (processor.get("special_tokens") or {}).items():
        try:
            special["ids"] = [mapping[i] for i in special.get("ids", [])]
        except KeyError as exc:
            raise VocabTrimError(f"the post-processor's token {name!r} (id {exc.args[0]}) was dropped") from None
    for key in ("sep", "cls"):  # BertProcessing / RobertaProcessing: [token, id]
        if isinstance(processor.get(key), list) and len(processor[key]) == 2:
            processor[key] = [processor[key][0], mapping[processor[key][1]]]


def trimmed_tokenizer_config(config: dict, trim: VocabTrim) -> dict:
    """tokenizer_config.json with its `added_tokens_decoder` (keyed by id) renumbered."""
    out = dict(config)
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        mapping = trim.mapping
        out["added_tokens_decoder"] = {str(mapping[int(k)]): v for k, v in decoder.items() if int(k) in mapping}
    return out


@torch.no_grad()
def trim_model(model: nn.Module, trim: VocabTrim) -> None:
    """Keep only the kept rows of the input embedding and the LM head (one tensor when tied; the head's bias too),
    in place; `config.vocab_size` and the config's and generation config's special ids follow."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if embedding.weight.shape[0] != trim.vocab_before and embedding.weight.shape[0] < trim.keep[-1] + 1:
        raise VocabTrimError(f"the model has {embedding.weight.shape[0]} embedding rows; the trim keeps id "
                             f"{trim.keep[-1]}")
    index = torch.tensor(trim.keep, dtype=torch.long, device=embedding.weight.device)
    tied = head is not None and head.weight is embedding.weight
    embedding.weight = nn.Parameter(embedding.weight.index_select(0, index).contiguous())
    embedding.num_embeddings = len(trim.keep)
    if head is not None:
        if tied:
            head.weight = embedding.weight
        else:
            head.weight = nn.Parameter(head.weight.index_select(0, index.to(head.weight.device)).contiguous())
            if getattr(head, "bias", None) is not None:
                head.bias = nn.Parameter(head.bias.index_select(0, index.to(head.bias.device)).contiguous())
        head.out_features = len(trim.keep)
    config = model.config
    config.vocab_size = len(trim.keep)
    if getattr(config, "get_text_config", None) is not None and config.get_text_config() is not config:
        config.get_text_config().vocab_size = len(trim.keep)
    for holder in (config, getattr(model, "generation_config", None)):
        if holder is not None:
            _remap_special_ids(holder, trim)


def _remap_special_ids(holder: Any, trim: VocabTrim) -> None:
    mapping = trim.mapping
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = getattr(holder, name, None)
        if value is None:
            continue
        if isinstance(value, list):
            setattr(holder, name, [mapping[v] for v in value if v in mapping])
        elif value in mapping:
            setattr(holder, name, mapping[value])
        else:
            raise VocabTrimError(f"{name} {value} was dropped by the trim")
