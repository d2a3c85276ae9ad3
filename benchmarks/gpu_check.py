"""GPU check: PIP scoring throughput, peak memory / weights, and generation speedup of the pruned model,
for a ~1B-parameter random-init Llama in bf16 (a smaller fp32 model on CPU). Self-contained: builds its
own tokenizer and calibration pairs, needs no downloads and no reference build.

Usage: python -m benchmarks.gpu_check [--size 1b|small] [--pairs 16]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

SIZES = {"1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=4,
                    intermediate_size=5632),
         "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=688)}
WORDS = ("the host said that later every guest would alter the plan and the ghost sat near the door while "
         "a cat and a bat watched the mat as bread and wine were brought to the table before night").split()


def build_inputs(pairs: int, seed: int = 0):  # noqa: ANN201
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pip_core.perturb import Perturber
    from pip_core.wordlist import WordList

    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(96)) for _ in range(pairs)]
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(texts * 4, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>")
    words = WordList.of(WORDS + ["alter", "later", "ghost", "host", "bat", "cat", "mat", "map", "wind"])
    result = Perturber(words, rate=0.1, seed=seed).perturb_many(texts)
    return tok, [(p.original, p.perturbed) for p in result.pairs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default=None, choices=sorted(SIZES))
    parser.add_argument("--pairs", type=int, default=16)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from pip_core import importance, prune, units

    cuda = torch.cuda.is_available()
    size = args.size or ("1b" if cuda else "small")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    tok, pairs = build_inputs(args.pairs)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, **SIZES[size]))
    model = model.to(dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    weights = n_params * model.dtype.itemsize
    found = units.discover(model, "width")
    importance.score(model, "pip", found, tokenizer=tok, pairs=pairs[:1], progress=False)  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tokens = sum(len(tok(a)["input_ids"]) + len(tok(b)["input_ids"]) for a, b in pairs)
    start = time.perf_counter()
    scores = importance.score(model, "pip", found, tokenizer=tok, pairs=pairs, progress=False)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else None

    @torch.no_grad()
    def gen_speed(m) -> float:  # noqa: ANN001
        prompt = torch.randint(5, len(tok), (1, 32), device=device)
        m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        m.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        if cuda:
            torch.cuda.synchronize()
        return 64 / (time.perf_counter() - t)

    dense_speed = gen_speed(model)
    total = units.param_count(model)
    chosen = prune.select(found, scores, int(0.2 * total))
    prune.apply(model, chosen)
    pruned_speed = gen_speed(model)
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "size": size, "params": n_params,
                      "dtype": str(dtype), "pairs": len(pairs), "scoring_tokens_per_s": tokens / seconds,
                      "scoring_seconds": seconds,
                      "peak_gpu_memory_over_weights": (peak / weights) if peak else None,
                      "removed_ratio": 1 - units.param_count(model) / total,
                      "generation_speedup": pruned_speed / dense_speed}, indent=1))


if __name__ == "__main__":
    main()
