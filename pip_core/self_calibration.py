"""Calibration data from the model itself: texts sampled from it, and the real words of its own vocabulary.

A model with no calibration text beside it (a GGUF file, a hub id) still has a distribution of its own, and
calibration text close to what the model was trained on matters more for pruning than the criterion
("Beware of Calibration Data for Pruning LLMs", arXiv 2410.17711: self-generated text works well, once the
highest-perplexity fifth of the samples is dropped). Both are seeded and deterministic on a given device.

Sampling is one hand-written decode loop over the model's KV cache for all texts at once (as many rows as the
memory bound allows): a hundred rows and more per forward keep the CPU's matrix units busy where HF `generate` with
a batch of 16 left them waiting on memory. The KV cache is static (written in place; a dynamic one copies every
layer's cache at every step), a row that emits EOS leaves it once an eighth of its rows have, the weights are bf16
copies where the CPU computes bf16 natively (autocast would cast them, and the cache, at every step), and the
nucleus is cut from a top-k instead of a sort of the whole vocabulary. The model's own log-probability of each
sampled token comes from the same probabilities, for the perplexity filter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import Cache, DynamicCache, PreTrainedTokenizerBase, StaticCache

from pip_core.errors import CalibrationError
from pip_core.perturb import single_edits
from pip_core.precision import cpu_bf16_weights
from pip_core.serving import _cache_name
from pip_core.wordlist import WORD, WordList

#: markers a byte-level BPE (GPT-2, Llama 3, SmolLM) or SentencePiece vocabulary puts before a word-initial token
WORD_START = ("Ġ", "▁")
#: the nucleus is cut from the most probable tokens, this many, then (for the rows whose nucleus is wider) 8x as
#: many, and so on; only a row whose nucleus is wider than the last sorts its whole vocabulary. Sampled SmolLM2-135M
#: texts: about half the rows' nuclei are wider than 512 tokens, 1% wider than 4,096 (a top-k of 4,096 over one
#: row costs a quarter of a full sort, and a sort of 221 rows' 49k probabilities took 117 ms of a 550 ms step)
NUCLEUS_TOP_K = 512
NUCLEUS_WIDENING, NUCLEUS_WIDENINGS = 8, 2
#: fp32 copies of a row's logits alive at once in a decode step (logits, probabilities, their log-sum-exp, top-k)
LOGIT_COPIES = 4
#: the share of sampled texts the first loop expects to keep (length and repetition filters), and the least
#: share a later loop assumes; each loop asks for `MARGIN` times the rows that share says are missing
FIRST_KEEP_RATE, MIN_KEEP_RATE, MARGIN = 0.9, 0.1, 1.1
#: bumped whenever the same options and model draw other texts (a cache of sampled texts names it)
SAMPLER_REVISION = 2
#: decode loops before giving up on a model that keeps ending its texts too early or looping
MAX_LOOPS = 8
#: ended rows stay in the static cache (decoded, their tokens ignored) until they are this share of its rows
COMPACT_SHARE = 8


@dataclass(frozen=True)
class SamplingOptions:
    """How `sampled_texts` samples: how many texts, how, and which it drops (passed whole)."""

    #: texts returned, exactly
    n: int
    #: the most tokens sampled for a text; the model ends many earlier (EOS), and their text ends there
    new_tokens: int = 128
    #: seeds every decode loop: the same options give the same texts on the same device and dtype
    seed: int = 0
    #: softmax temperature of the sampling (1: the model's own distribution)
    temperature: float = 1.0
    #: nucleus sampling: each token is drawn from the fewest most probable tokens holding this probability
    top_p: float = 0.95
    #: a text shorter than this (stripped) is dropped
    min_chars: int = 20
    #: the least share of distinct token bigrams a text must have: a text that loops repeats them ("A-R-A-R-...":
    #: 0.09, "1, 2, 3, ...": 0.35, "and second, and third, and fourth, ...": 0.5) and is dropped; 200 SmolLM2-135M
    #: samples of 128 tokens that do not loop had 0.60 to 1 (median 0.94). Bigrams, not 3-grams: a counting loop
    #: has distinct 3-grams ("and fourth,", "and fifth,") as often as text does
    min_distinct: float = 0.55
    #: the share of the remaining texts dropped for the highest perplexity (the model's own, on the tokens it
    #: sampled); arXiv 2410.17711 drops 20%
    drop_tail: float = 0.2
    #: the most memory one decode loop's state (KV cache, logits) may take, in MiB: it sets the loop's batch from
    #: the model's cache bytes per token, so it is deterministic for a model and options; another bound gives other
    #: texts for the same seed (other batches, other rounding)
    #: (512 MiB: SmolLM2-135M's 144 texts in two loops of 138 rows, 53 s on 2 cores, where one loop of 221 rows
    #: took 55 s and 0.28 GiB more)
    memory_mib: int = 512
    #: sample on bf16 copies of the weights (`pip_core.precision.cpu_bf16_weights`) where the model is fp32 on a CPU
    #: with native bf16 (avx512_bf16, AMX): SmolLM2-135M's 221 rows in 55 s against 83 s under autocast, which
    #: casted every weight and the whole KV cache at every step. The texts then depend on it, and on the CPU
    #: having bf16: False samples in the model's own precision everywhere
    cpu_bf16: bool = True
    #: a progress bar over each loop's decode steps
    progress: bool = True

    def __post_init__(self) -> None:
        if self.n < 1 or self.new_tokens < 1:
            raise CalibrationError(f"asked for {self.n} sampled calibration texts of {self.new_tokens} tokens; "
                                   "at least 1 of 1 is needed")
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and 0 <= self.drop_tail < 1 and self.memory_mib > 0):
            raise CalibrationError(f"sampling options out of range: temperature {self.temperature} (> 0), top_p "
                                   f"{self.top_p} (0, 1], drop_tail {self.drop_tail} [0, 1), memory_mib "
                                   f"{self.memory_mib} (> 0)")

    @property
    def pool(self) -> int:
        """Texts that pass the length and repetition filters needed before the perplexity tail is dropped."""
        return math.ceil(self.n / (1 - self.drop_tail))


@dataclass(frozen=True)
class Sample:
    """One sampled text: its token ids (start token and EOS left out), whether the model ended it (EOS) and the
    model's own mean negative log-probability of its tokens (log perplexity; inf for an empty text)."""

    tokens: tuple[int, ...]
    ended: bool
    nll: float


def start_token(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token a text is sampled from: the document separator the model was trained with (BOS, else EOS)."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise CalibrationError("the tokenizer has neither a BOS nor an EOS token to sample texts from")
    return int(token)


def stop_tokens(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The tokens that end a text: the tokenizer's EOS and the model's generation config's (an int or a list)."""
    config = getattr(model, "generation_config", None)
    found = [tokenizer.eos_token_id, getattr(config, "eos_token_id", None)]
    flat = [t for f in found for t in (f if isinstance(f, (list, tuple)) else [f]) if t is not None]
    return tuple(sorted(set(int(t) for t in flat)))


def nucleus_sample(logits: torch.Tensor, u: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                   top_k: int = NUCLEUS_TOP_K, with_logp: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per row of `logits`, the token at quantile `u` (uniform in [0, 1)) of its nucleus: the fewest most probable
    tokens that hold `top_p` of the probability at `temperature`. The nucleus is cut from the `top_k` most probable
    tokens where they hold it, from `NUCLEUS_WIDENING` times as many for the rows where they do not, and so on; only
    the rows wider than the last widening sort their whole vocabulary. The pick is the same whichever cut finds it.
    `with_logp`: also the model's own log-probability of each pick (at temperature 1)."""
    probs = (logits if temperature == 1 else logits / temperature).softmax(-1)
    picked = _nucleus_pick(probs, u, top_p, top_k)
    if not with_logp:
        return picked
    if temperature == 1:  # the probabilities at hand are the model's own: no second pass over the vocabulary
        return picked, probs.gather(-1, picked[:, None])[:, 0].log()
    return picked, logits.gather(-1, picked[:, None])[:, 0] - logits.logsumexp(-1)


def _nucleus_pick(probs: torch.Tensor, u: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    if top_p >= 1:
        return _at_quantile(probs, None, u, 1.0)
    picked = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    rows = torch.arange(probs.shape[0], device=probs.device)
    for widening in range(NUCLEUS_WIDENINGS + 1):
        k = top_k * NUCLEUS_WIDENING ** widening
        if k >= probs.shape[-1]:
            break
        top, order = (probs if widening == 0 else probs[rows]).topk(k, -1)  # every row: no copy of them
        held = top.sum(-1) >= top_p
        picked[rows[held]] = _at_quantile(top[held], order[held], u[rows[held]], top_p)
        rows = rows[~held]
        if not rows.numel():
            return picked
    full, full_order = probs[rows].sort(-1, descending=True)
    picked[rows] = _at_quantile(full, full_order, u[rows], top_p)
    return picked


def _at_quantile(probs: torch.Tensor, order: torch.Tensor | None, u: torch.Tensor, top_p: float) -> torch.Tensor:
    """The token at quantile `u` of the shortest prefix of `probs` (sorted descending unless `top_p` is 1) holding
    `top_p`; `order` maps positions to token ids (None: positions are the ids)."""
    mass = probs.cumsum(-1)
    size = ((mass < top_p).sum(-1, keepdim=True) + 1).clamp(max=probs.shape[-1])
    pos = torch.searchsorted(mass, u[:, None].to(mass.dtype) * mass.gather(-1, size - 1))
    pos = torch.minimum(pos, size - 1)
    return (pos if order is None else order.gather(-1, pos))[:, 0]


def decode(model: nn.Module, start: int, stop: Sequence[int], rows: int, options: SamplingOptions,
           loop: int = 0) -> list[Sample]:
    """Up to `rows` samples from one decode loop over the model's KV cache (fewer where `options.memory_mib` holds
    fewer), seeded by `options.seed` and `loop`. A row leaves the batch when it emits a `stop` token; each row draws
    its own uniform per step, so its text does not depend on when the others end (up to the rounding of the
    batch). Call under inference mode with the model in eval mode."""
    with cpu_bf16_weights(model, options.cpu_bf16):
        return _decode(model, start, stop, rows, options, loop)


def _decode(model: nn.Module, start: int, stop: Sequence[int], rows: int, options: SamplingOptions,
            loop: int) -> list[Sample]:
    device = next(model.parameters()).device
    probe = DynamicCache(config=model.config)  # one row's cache: its bytes per token, whatever the family and dtype
    vocab = _next_logits(model, torch.tensor([start], device=device), probe).shape[-1]
    rows = min(rows, _rows_within(probe, vocab, options))
    del probe
    # a static cache: written in place, where a dynamic one concatenates (copies) every layer's cache every step
    cache = StaticCache(config=model.config, max_cache_len=options.new_tokens)
    logits = _next_logits(model, torch.full((rows,), start, device=device), cache)
    generator = torch.Generator(device=device).manual_seed(options.seed * 100_003 + loop)
    stop = torch.tensor(list(stop), dtype=torch.long, device=device)
    tokens = torch.zeros(rows, options.new_tokens, dtype=torch.long, device=device)
    length = torch.full((rows,), options.new_tokens, device=device)
    nll = torch.zeros(rows, dtype=torch.float64, device=device)
    batch = torch.arange(rows, device=device)  # the sample each row of the cache decodes
    live = torch.ones(rows, dtype=torch.bool, device=device)  # the cache's rows whose sample has not ended
    bar = tqdm(total=options.new_tokens, desc=f"sampling {rows} calibration texts", unit="token",
               disable=not options.progress)
    for step in range(options.new_tokens):
        u = torch.rand(rows, generator=generator, device=device)[batch[live]]
        picked, logp = nucleus_sample(logits[live], u, options.temperature, options.top_p, with_logp=True)
        ended = torch.isin(picked, stop)
        mine = batch[live]
        tokens[mine, step] = picked
        nll[mine] -= torch.where(ended, 0.0, logp).double()
        length[mine[ended]] = step
        bar.update()
        live[live.clone()] = ~ended
        if not live.any() or step + 1 == options.new_tokens:
            break
        if (~live).sum() * COMPACT_SHARE >= live.numel():  # drop the ended rows from the cache, a share at a time
            _keep_rows(cache, live.nonzero()[:, 0])
            batch, live = batch[live], live[live]
        feed = torch.zeros(live.numel(), dtype=torch.long, device=device)
        feed[live] = picked[~ended]
        logits = _next_logits(model, feed, cache)
    bar.close()
    lengths = length.tolist()
    return [Sample(tuple(row[:k]), k < options.new_tokens, total / k if k else math.inf)
            for row, k, total in zip(tokens.tolist(), lengths, nll.tolist(), strict=True)]


def _keep_rows(cache: StaticCache, keep: torch.Tensor) -> None:
    """Only the rows `keep` in every layer of a static cache (one copy of it, where a dynamic cache copies itself
    every step)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            layer.batch_size = int(keep.numel())


def _next_logits(model: nn.Module, tokens: torch.Tensor, cache: Cache) -> torch.Tensor:
    """fp32 logits of the next token of every row, after `tokens` (one per row) appended to `cache`."""
    return model(input_ids=tokens[:, None], use_cache=True, **{_cache_name(model): cache}).logits[:, -1].float()


def _rows_within(cache: Cache, vocab: int, options: SamplingOptions) -> int:
    """Rows of a decode loop whose state fits `options.memory_mib`: each row's KV cache (its bytes per token read
    from the one-token cache of one row, whatever the family and dtype) and its fp32 logits."""
    per_token = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    per_row = per_token * options.new_tokens + LOGIT_COPIES * 4 * vocab
    return max(1, options.memory_mib * 2**20 // per_row)


def distinct_ratio(tokens: Sequence[int], n: int = 2) -> float:
    """The share of a token sequence's `n`-grams that are distinct: near 1 for text, low for a loop (1 for a
    sequence too short to repeat one). `SamplingOptions.min_distinct` bounds it for bigrams."""
    grams = list(zip(*(tokens[i:] for i in range(n)), strict=False))
    return len(set(grams)) / len(grams) if len(grams) > 1 else 1.0


def lowest_perplexity(samples: Sequence[Sample], n: int) -> list[int]:
    """Indices, in order, of the `n` samples of lowest perplexity (ties: the earlier sample)."""
    return sorted(sorted(range(len(samples)), key=lambda i: (samples[i].nll, i))[:n])


@torch.inference_mode()
def sampled_texts(model: nn.Module, tokenizer: PreTrainedTokenizerBase, options: SamplingOptions) -> list[str]:
    """Exactly `options.n` texts sampled from the model (nucleus sampling from the start token, each text ended
    where the model ends it), seeded. Texts shorter than `min_chars` or that loop (`min_distinct`) are dropped,
    then the `drop_tail` share of highest perplexity; decode loops run until enough remain, the first sized to
    need no second. The model is left in the mode it was in, the global RNG as it was."""
    start, stop = start_token(tokenizer), stop_tokens(model, tokenizer)
    was_training = model.training
    model.eval()
    kept: list[tuple[Sample, str]] = []
    drawn = 0
    try:
        for loop in range(MAX_LOOPS):
            rate = len(kept) / drawn if drawn else FIRST_KEEP_RATE
            rows = math.ceil((options.pool - len(kept)) / max(rate, MIN_KEEP_RATE) * MARGIN)
            samples = decode(model, start, stop, rows, options, loop)
            drawn += len(samples)
            texts = tokenizer.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
            kept += [(s, t.strip()) for s, t in zip(samples, texts, strict=True)
                     if len(t.strip()) >= options.min_chars and distinct_ratio(s.tokens) >= options.min_distinct]
            if len(kept) >= options.pool:
                pool = kept[:options.pool]
                return [pool[i][1] for i in lowest_perplexity([s for s, _ in pool], options.n)]
    finally:
        model.train(was_training)
    raise CalibrationError(f"the model gave only {len(kept)} of the {options.pool} texts needed ({drawn} sampled): "
                           f"too many shorter than {options.min_chars} characters or looping")


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
