"""A byte-level BPE tokenizer trained on the corpus, saved as a transformers tokenizer."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def train_tokenizer(texts: Iterable[str], vocab_size: int, cache: Path) -> PreTrainedTokenizerFast:
    """Train (or reuse from `cache`) a byte-level BPE with <s> prepended to every text."""
    if (cache / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(cache))
    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(SPECIAL["bos_token"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=2048, **SPECIAL)
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fast.save_pretrained(str(tmp))
    shutil.rmtree(cache, ignore_errors=True)
    tmp.rename(cache)
    return fast
