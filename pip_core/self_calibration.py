"""Calibration data from the model itself: texts sampled from it, and the real words of its own vocabulary.

A model with no calibration text beside it (a GGUF file, a hub id) still has a distribution of its own, and
calibration text close to what the model was trained on matters more for pruning than the criterion
("Beware of Calibration Data for Pruning LLMs", arXiv 2410.17711: self-generated text works well). Both
functions are seeded and deterministic on a given device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from pip_core.errors import CalibrationError
from pip_core.perturb import single_edits
from pip_core.wordlist import WORD, WordList

#: markers a byte-level BPE (GPT-2, Llama 3, SmolLM) or SentencePiece vocabulary puts before a word-initial token
WORD_START = ("Ġ", "▁")


def start_token(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token a text is sampled from: the document separator the model was trained with (BOS, else EOS)."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise CalibrationError("the tokenizer has neither a BOS nor an EOS token to sample texts from")
    return int(token)


@torch.no_grad()
def sampled_texts(model: nn.Module, tokenizer: PreTrainedTokenizerBase, n: int, new_tokens: int, seed: int,
                  batch_size: int = 16, temperature: float = 1.0, top_p: float = 0.95, min_chars: int = 20,
                  progress: bool = True) -> list[str]:
    """`n` texts sampled from the model (nucleus sampling from the start token), each batch seeded by `seed` and
    its index; texts shorter than `min_chars` are drawn again. The global RNG is left as it was."""
    if n < 1:
        raise CalibrationError(f"asked for {n} sampled calibration texts; at least 1 is needed")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts: list[str] = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bar = tqdm(total=n, desc="sampling calibration texts from the model", disable=not progress)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for batch in range(4 * (n // batch_size + 1)):  # bounded: a model that only stops early fails below
                torch.manual_seed(seed * 100_003 + batch)
                ids = torch.full((batch_size, 1), start_token(tokenizer), dtype=torch.long, device=device)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                                     pad_token_id=pad)
                found = [t.strip() for t in tokenizer.batch_decode(out[:, 1:], skip_special_tokens=True)]
                found = [t for t in found if len(t) >= min_chars][:n - len(texts)]
                texts += found
                bar.update(len(found))
                if len(texts) >= n:
                    return texts
    finally:
        bar.close()
        model.train(was_training)
    raise CalibrationError(f"the model gave only {len(texts)} of {n} texts of at least {min_chars} characters")


@torch.no_grad()
def vocabulary_words(model: nn.Module, tokenizer: PreTrainedTokenizerBase, among: Iterable[str] | None = None,
                     min_len: int = 3, min_boundary: float = 0.5, batch_size: int = 512) -> WordList:
    """The real words of the model's vocabulary: word-initial tokens of lowercase letters that the model itself
    ends as a word, i.e. after which it puts at least `min_boundary` of its probability on a token that starts a
    new word or is punctuation. That drops the fragments a BPE vocabulary is full of ("chocol", "investig").
    `among`: test only these words (the perturber's candidate edits), one forward per `batch_size` of them."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    boundary = torch.tensor([bool(t) and (t.startswith(WORD_START) or not t[0].isalnum()) for t in
                             (v or "" for v in vocab)])
    wanted = None if among is None else {w.lower() for w in among}
    candidates = [(i, t[1:]) for i, t in enumerate(vocab)
                  if t and t.startswith(WORD_START) and len(t) > min_len and t[1:].isascii() and t[1:].isalpha()
                  and t[1:].islower() and (wanted is None or t[1:] in wanted)]
    if not candidates:
        raise CalibrationError("the tokenizer's vocabulary has no word-initial tokens of letters")
    device = next(model.parameters()).device
    start = start_token(tokenizer)
    words = []
    for i in range(0, len(candidates), batch_size):
        chunk = candidates[i:i + batch_size]
        ids = torch.tensor([[start, token] for token, _ in chunk], device=device)
        logits = model(input_ids=ids, logits_to_keep=1).logits[:, -1, : len(boundary)].float()
        mass = logits.softmax(-1)[:, boundary.to(device)].sum(-1)
        words += [word for (_, word), p in zip(chunk, mass.tolist(), strict=True) if p >= min_boundary]
    return WordList.of(words)


def model_word_list(model: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> WordList:
    """The word list for perturbing `texts`: the words they use twice or more, and every one-edit neighbour of their
    words that the model's vocabulary holds as a real word (`vocabulary_words`)."""
    texts = list(texts)
    own = WordList.from_texts(texts)
    spelled = {w.lower() for t in texts for w in WORD.findall(t) if len(w) >= 3}
    neighbours = {cand for w in spelled for _, cand in single_edits(w)}
    return own.union(vocabulary_words(model, tokenizer, among=neighbours))
