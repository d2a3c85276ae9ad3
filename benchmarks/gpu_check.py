"""GPU check: PIP scoring throughput, peak memory / weights, and generation speedup of the pruned model,
for a ~1B-parameter random-init Llama in bf16 (a smaller fp32 model on CPU); the fused (liger-kernel)
loss against the chunked torch loss on CUDA; and the compress flow itself (`pipprune compress`,
bf16 checkpoint, --device auto = cuda) with the embedded stack. Self-contained: builds its own
tokenizer and calibration pairs, needs no downloads and no reference build. On a GPU the JSON is
written to benchmarks/results/gpu_check.json.

The serving part prunes the same 1B model to 0.2 with the product's planner and selector (block; uniform
width aligned to 64 and unaligned) and times it with `pip_core.serving.measure`, the code of the flow's
serving task, at batch 1 and 8: what a transformers deployment on this GPU would see.

Usage: python -m benchmarks.gpu_check [--size 1b|small] [--pairs 16] [--skip-flow] [--parts core,flow,serving]
(a run of some parts updates those keys of an existing gpu_check.json and leaves the others)
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from infra.layout import model_dir_layout
from pip_core.importance import CalibrationData

SIZES = {"1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=4,
                    intermediate_size=5632),
         "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=688)}
WORDS = ("the host said that later every guest would alter the plan and the ghost sat near the door while "
         "a cat and a bat watched the mat as bread and wine were brought to the table before night").split()


def build_inputs(pairs: int, seed: int = 0, words_per_text: int = 96):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pip_core.perturb import Perturber
    from pip_core.wordlist import WordList

    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(words_per_text)) for _ in range(pairs)]
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(texts * 4, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>")
    words = WordList.of(WORDS + ["alter", "later", "ghost", "host", "bat", "cat", "mat", "map", "wind"])
    result = Perturber(words, rate=0.1, seed=seed).perturb_many(texts)
    return tok, [(p.original, p.perturbed) for p in result.pairs]


def loss_parity(tok, pairs, device: str) -> dict:
    """PIP scores through liger's fused linear cross-entropy vs the chunked torch path (float32, same model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pip_core import chunked_loss, importance, units

    if not chunked_loss.fused_available(torch.device(device)):
        return {"fused_available": False}
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, **SIZES["small"]))
    model = model.float().eval()
    found = units.discover(model, "width")
    fused = importance.score(model, "pip", found, CalibrationData(tok, pairs[:4]), progress=False)
    original = chunked_loss.fused_available
    chunked_loss.fused_available = lambda _device: False  # force the torch path for the comparison
    try:
        chunked = importance.score(model, "pip", found, CalibrationData(tok, pairs[:4]), progress=False)
    finally:
        chunked_loss.fused_available = original
    rel = ((fused - chunked).abs() / chunked.abs().clamp_min(1e-12)).max().item()
    return {"fused_available": True, "max_relative_difference": rel, "allclose_rtol_1e-4": rel <= 1e-4}


def vocab_128k_memory(tok, pairs, device: str) -> dict:
    """Peak GPU memory / weights of PIP scoring at a 128k vocabulary (seq 512, bf16): sliced loss vs whole logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pip_core import chunked_loss, importance, units

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128256, hidden_size=512, num_hidden_layers=8,
                                             num_attention_heads=8, num_key_value_heads=4, intermediate_size=1376,
                                             tie_word_embeddings=True))
    model = model.to(torch.bfloat16).eval()
    weights = sum(p.numel() for p in model.parameters()) * 2
    found = units.discover(model, "width")
    long_pairs = [(" ".join([a] * 6), " ".join([b] * 6)) for a, b in pairs[:3]]
    row = {"weights_mb": weights / 2**20}
    for name, loss in (("sliced", chunked_loss.per_sequence_loss),
                       ("whole_logits", chunked_loss.full_logits_per_sequence_loss)):
        original = importance.per_sequence_loss
        importance.per_sequence_loss = loss
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            importance.score(model, "pip", found, CalibrationData(tok, long_pairs), max_length=512, progress=False)
            torch.cuda.synchronize()
            row[f"peak_over_weights_{name}"] = torch.cuda.max_memory_allocated() / weights
        finally:
            importance.per_sequence_loss = original
    return row


def flow_check(tok, pairs, cuda: bool) -> dict:
    """`pipprune compress` on a bf16 checkpoint: bf16 must come out, smaller by the removed parameters."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    from pip_core import io as core_io

    work = Path(tempfile.mkdtemp(prefix="pipprune-gpu-flow-"))
    src = work / "source"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, **SIZES["small"]))
    model.to(torch.bfloat16).save_pretrained(src, safe_serialization=True)
    tok.save_pretrained(src)
    (src / "calibration").mkdir()
    with (model_dir_layout(src).calibration).open("w") as fh:
        for original, _ in pairs * 4:
            fh.write(json.dumps({"text": original}) + "\n")
    (model_dir_layout(src).wordlist).write_text("\n".join(sorted(set(WORDS))) + "\n")
    out = work / "out"
    env = {**os.environ, "PIPPRUNE_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "pipprune.cli", "compress", "--model", str(src), "--ratio", "0.2", "--unit", "width",
            "--iterations", "2", "--n-samples", "16", "--device", "cuda" if cuda else "cpu", "--out", str(out),
            "--json", "--name", "gpu-check"]
    start = time.perf_counter()
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=400)
    seconds = time.perf_counter() - start
    subprocess.run([sys.executable, "-m", "pipprune.cli", "stack", "down"], env=env, capture_output=True, timeout=120)
    if run.returncode != 0:
        return {"ok": False, "returncode": run.returncode, "stderr_tail": run.stderr[-2000:]}
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {"ok": True, "seconds": seconds, "device": "cuda" if cuda else "cpu",
            "out_dtype": json.loads((out / "config.json").read_text()).get("dtype"),
            "bytes_ratio": out_bytes / src_bytes,
            "params_ratio": core_io.param_count_from_dir(out) / core_io.param_count_from_dir(src)}


def serving_rows(tok, size: str, device: str, dtype: torch.dtype, ratio: float = 0.2) -> list[dict]:
    """Decode speed of the planned, pruned model against the dense one (same prompts), per unit and alignment."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.serving import speed_row
    from pip_core import schedule
    from pip_core.budget import plan_budget
    from pip_core.rules import Selection

    torch.manual_seed(0)
    with torch.device(device):
        dense = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, **SIZES[size]))
    dense = dense.to(dtype).eval()
    prompts = torch.randint(5, len(tok), (4, 64))
    measure = dict(new_tokens=64, batch_sizes=(1, 8), repeats=3)
    rows = []
    for unit, align in (("block", 1), ("width", 64), ("width", 1)):
        plan = plan_budget(dense.config.to_dict(), f"ratio={ratio}", Selection(unit=unit, align=align), iterations=2)
        pruned = copy.deepcopy(dense)
        # random-init weights: the speed depends on the kept shapes only, so a gradient-free criterion picks them
        options = schedule.ScoringOptions("magnitude", unit, width_mode="uniform", align=plan.effective_align)
        schedule.prune_iteratively(pruned, CalibrationData(tok), options, plan.ratio, 2, progress=False)
        rows.append(speed_row(dense, pruned, tok, prompts, measure, plan, unit, align, ratio))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("dense", "pruned")}), flush=True)
        del pruned
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default=None, choices=sorted(SIZES))
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--skip-flow", action="store_true", help="only pip_core (no stack, no flow)")
    parser.add_argument("--parts", default="core,flow,serving", help="comma list of core, flow, serving")
    args = parser.parse_args()
    parts = set(args.parts.split(",")) - ({"flow"} if args.skip_flow else set())


    cuda = torch.cuda.is_available()
    size = args.size or ("1b" if cuda else "small")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    tok, pairs = build_inputs(args.pairs)
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "size": size, "dtype": str(dtype)}
    if "core" in parts:
        result.update(core_check(tok, pairs, size, device, dtype, cuda))
    if "flow" in parts:
        try:
            result["compress_flow"] = flow_check(tok, pairs, cuda)
        except Exception as exc:  # noqa: BLE001 - reported, the pip_core figures above still stand
            result["compress_flow"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    if "serving" in parts:
        result["serving_ratio_0.2"] = serving_rows(tok, size, device, dtype)
    print(json.dumps({k: v for k, v in result.items() if k != "serving_ratio_0.2"}, indent=1))
    if cuda:
        from benchmarks.common import RESULTS, environment

        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / "gpu_check.json"
        previous = json.loads(path.read_text()) if path.is_file() else {}
        if previous.get("size") != size:
            previous = {}
        path.write_text(json.dumps({**previous, "benchmark": "gpu_check", "environment": environment(), **result,
                                    "parts_last_run": sorted(parts)}, indent=1))


def core_check(tok, pairs, size: str, device: str, dtype: torch.dtype, cuda: bool) -> dict:
    """PIP scoring throughput and peak memory, generation speedup of a plainly pruned copy, loss parity, 128k vocab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pip_core import importance, prune, units

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, **SIZES[size]))
    model = model.to(dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    weights = n_params * model.dtype.itemsize
    found = units.discover(model, "width")
    importance.score(model, "pip", found, CalibrationData(tok, pairs[:1]), progress=False)  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tokens = sum(len(tok(a)["input_ids"]) + len(tok(b)["input_ids"]) for a, b in pairs)
    start = time.perf_counter()
    scores = importance.score(model, "pip", found, CalibrationData(tok, pairs), progress=False)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else None

    @torch.no_grad()
    def gen_speed(m) -> float:
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
    from pip_core.chunked_loss import fused_available

    result = {"params": n_params, "pairs": len(pairs), "scoring_tokens_per_s": tokens / seconds,
              "scoring_seconds": seconds, "fused_loss": fused_available(torch.device(device)),
              "peak_gpu_memory_over_weights": (peak / weights) if peak else None,
              "removed_ratio": 1 - units.param_count(model) / total,
              "generation_speedup": pruned_speed / dense_speed,
              "generation_speedup_of": "prune.select over every layer (per-layer widths, no alignment), generate() at batch 1"}
    del model
    if cuda:
        torch.cuda.empty_cache()
        result["loss_parity"] = loss_parity(tok, pairs, device)
        result["vocab_128k_seq_512_bf16"] = vocab_128k_memory(tok, pairs, device)
    return result


if __name__ == "__main__":
    main()
