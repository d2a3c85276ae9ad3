"""Vocabulary trimming (pip_core.vocab_trim): the kept corpus encodes to the same tokens, renumbered; every other
text still encodes and decodes; the trimmed model's logits are the kept columns of the original's; the output
loads with the stock classes."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from pip_core.vocab_trim import (
    VocabTrim,
    VocabTrimError,
    tokens_to_keep,
    trim_model,
    trimmed_tokenizer_config,
    trimmed_tokenizer_json,
)
from tests.helpers import tiny_family_model

KEPT = ["The host said he would come later to the party at the house.",
        "A cat sat on the mat near the door and watched the bird fly over the garden wall.",
        "Later that evening the ghost of the old house altered the plan, and nobody noticed."]
OTHER = ["Zyxqv 1234 kwprt, 9876 qqzx vvw!", "Sphinx of black quartz, judge my vow: 0xDEADBEEF 42."]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of 600 tokens trained on the kept corpus and another one, so each has tokens of its own."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator((KEPT + OTHER) * 30, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def trimmed(tokenizer, tmp_path_factory):
    """(trim, original model, trimmed model, trimmed tokenizer as AutoTokenizer reads it back, its directory)."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    trim = tokens_to_keep(data, [tokenizer.encode(t) for t in KEPT])
    out = tmp_path_factory.mktemp("trimmed")
    model = tiny_family_model("llama", len(tokenizer), tie_word_embeddings=True)
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    small = tiny_family_model("llama", len(tokenizer), tie_word_embeddings=True)
    small.load_state_dict(model.state_dict())
    small.config.bos_token_id, small.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    trim_model(small, trim)
    small.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "tokenizer.json").write_text(json.dumps(trimmed_tokenizer_json(data, trim)))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(trimmed_tokenizer_config(config, trim)))
    return trim, model, AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out), out


def test_the_trim_keeps_what_the_corpus_needs_and_drops_the_rest(tokenizer, trimmed):
    trim, *_ = trimmed
    assert len(trim.keep) < len(tokenizer) - 50  # the other corpus's own tokens went
    assert {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id} <= set(trim.keep)
    alphabet = {tokenizer.convert_tokens_to_ids(c) for c in pre_tokenizers.ByteLevel.alphabet()}
    assert alphabet <= set(trim.keep)  # every byte: any text still encodes
    assert trim.digest == VocabTrim(trim.keep, trim.vocab_before).digest and len(trim.digest) == 64


def test_a_word_list_keeps_its_words_wherever_running_text_puts_them(tokenizer):
    """The `public` corpus's word list: each word after a space and at a line's start, as written and
    capitalised, so a sentence of those words in any of those places needs no dropped token."""
    from infra.vocab_source import word_texts

    words = ["later", "the", "host", "garden"]
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    sentences = ("Later the host\nThe garden Later", "the Later Garden\nlater Host")
    spaced_only = tokens_to_keep(data, [tokenizer.encode(" " + word) for word in words])
    assert not all(set(tokenizer.encode(s)) <= set(spaced_only.keep) for s in sentences)  # "Later", "The": own tokens
    trim = tokens_to_keep(data, [tokenizer.encode(t) for t in word_texts(words, per_text=2)])
    for sentence in sentences:
        assert set(tokenizer.encode(sentence)) <= set(trim.keep), sentence
    assert len(trim.keep) < len(tokenizer) - 100  # the rest of the vocabulary went


def test_every_kept_text_encodes_to_the_same_tokens_renumbered(tokenizer, trimmed):
    trim, _, _, small_tok, _ = trimmed
    for text in KEPT:
        assert small_tok.encode(text) == trim.remap(tokenizer.encode(text))
        assert small_tok.decode(small_tok.encode(text)) == text
    for text in OTHER:  # in more pieces, but whole
        assert small_tok.decode(small_tok.encode(text)) == text
        assert len(small_tok.encode(text)) >= len(tokenizer.encode(text))


def test_the_trimmed_model_gives_the_kept_columns_of_the_original_logits(tokenizer, trimmed):
    trim, model, small, _, _ = trimmed
    assert small.config.vocab_size == len(trim.keep)
    assert small.get_output_embeddings().weight is small.get_input_embeddings().weight  # still tied
    assert small.config.eos_token_id == trim.mapping[tokenizer.eos_token_id]
    ids = tokenizer(KEPT[1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        full = model(input_ids=ids).logits[..., list(trim.keep)]
        cut = small(input_ids=torch.tensor([trim.remap(ids[0].tolist())])).logits
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())


def test_an_untied_head_and_its_rows_follow_and_dropped_ids_are_named(tokenizer):
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    trim = tokens_to_keep(data, [tokenizer.encode(KEPT[0])])
    model = tiny_family_model("llama", len(tokenizer), tie_word_embeddings=False)
    head = model.get_output_embeddings().weight.detach().clone()
    trim_model(model, trim)
    torch.testing.assert_close(model.get_output_embeddings().weight, head[list(trim.keep)])
    dropped = next(i for i in range(len(tokenizer)) if i not in trim.mapping)
    with pytest.raises(VocabTrimError, match=f"token id {dropped} was dropped"):
        trim.remap([dropped])


def test_a_tokenizer_that_is_not_bpe_is_refused_by_name():
    with pytest.raises(VocabTrimError, match="'Unigram'"):
        tokens_to_keep({"model": {"type": "Unigram", "vocab": []}, "added_tokens": []}, [])


def test_trim_vocab_writes_a_model_that_loads_encodes_its_corpus_as_before_and_reads_back_as_gguf(
        tiny_reference_dir, tmp_path):
    """The command on the tiny reference: fewer rows, the corpus encoded as before (renumbered), the stock classes
    load it, its GGUF (transformers' reader, as llama.cpp's conversion reads it) gives the same tokens and
    logits; a second run into the same directory is refused, the first output left whole."""
    import os

    from infra.gguf_write import write_gguf
    from infra.vocab_source import read_trim_record
    from tests.helpers import cli
    from tests.test_gguf_export import _compare

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(KEPT))
    out = tmp_path / "trimmed"
    env = {**os.environ, "PIPPRUNE_HOME": str(tmp_path / "home")}
    result = cli(env, "trim-vocab", "--model", str(tiny_reference_dir), "--corpus", str(corpus), "--out", str(out),
                 "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    record = read_trim_record(out)
    assert report["vocab_after"] == record["vocab_after"] == len(record["kept_ids"]) < report["vocab_before"]
    trim = VocabTrim(tuple(record["kept_ids"]), record["vocab_before"])
    before, after = AutoTokenizer.from_pretrained(tiny_reference_dir), AutoTokenizer.from_pretrained(out)
    for text in KEPT:
        assert after.encode(text) == trim.remap(before.encode(text))
    original = AutoModelForCausalLM.from_pretrained(tiny_reference_dir, dtype=torch.float32)
    small = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = before(KEPT[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(small(torch.tensor([trim.remap(ids[0].tolist())])).logits,
                                   original(ids).logits[..., list(trim.keep)], rtol=1e-4, atol=1e-4)
    info = write_gguf(out, out / "trimmed-f32.gguf", "f32")
    assert info.n_vocab == record["vocab_after"]
    diff, top1 = _compare(out, info.path.name, "f32", text=KEPT[2])
    assert diff <= 1e-3 and top1 == 1.0
    again = cli(env, "trim-vocab", "--model", str(tiny_reference_dir), "--corpus", str(corpus), "--out", str(out),
                timeout=300)
    assert again.returncode == 2 and "exists" in again.stderr + again.stdout
    assert read_trim_record(out) == record


def test_the_round_trip_check_compares_every_text_and_names_the_first_that_differs(tokenizer, trimmed):
    from infra.vocab_source import VocabSourceError, _check_round_trip, encode_corpus

    trim, _, _, _, out = trimmed
    encoded = encode_corpus(tokenizer, KEPT, chunk_chars=40)  # several chunks
    assert [e.tolist() for e in encoded] == tokenizer(KEPT, add_special_tokens=False)["input_ids"]
    _check_round_trip(out, KEPT, encoded, trim)
    encoded[2] = encoded[2][::-1].copy()  # what a tokenizer that merges differently would give
    with pytest.raises(VocabSourceError, match=r"corpus text 2 differently \('Later that"):
        _check_round_trip(out, KEPT, encoded, trim)
