"""A real engine runs the exported files: llama.cpp (through llama-cpp-python) loads each GGUF written by
benchmarks.gguf_export, its greedy continuations are compared with transformers' on the same weights (the file
as transformers' GGUF loader rebuilds it), its own tokenizer with the model's, and decode speed is measured
dense against pruned.

llama-cpp-python is a source package (it builds llama.cpp with CMake), so this is not part of `make test`:
`make bench-llama-cpp` installs it and runs this.

    python -m benchmarks.llama_cpp --files .pipprune/bench-gguf/tiny/gguf/files.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import ROOT, write


def _continuations_agree(a: list[int], b: list[int]) -> int:
    """Tokens the two continuations share before they first differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_file(entry: dict, prompts: list[str], new_tokens: int, threads: int, repeats: int) -> dict:
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from tasks.export import read_back

    path = Path(entry["path"])
    hf_tok = AutoTokenizer.from_pretrained(entry["parent_dir"])
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_batch=512, seed=0, verbose=False)
    hf, _ = read_back(path)
    tokenizer_equal, agree, exact, speeds = 0, [], 0, []
    for text in prompts:
        ids = hf_tok(text)["input_ids"]
        tokenizer_equal += llm.tokenize(text.encode("utf-8"), add_bos=bool(hf_tok.bos_token_id is not None
                                                                            and ids[:1] == [hf_tok.bos_token_id]),
                                        special=False) == ids
        ours: list[int] = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            ours.append(int(token))
            if len(ours) >= new_tokens:
                break
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=hf_tok.pad_token_id)
        theirs = out[0, len(ids):].tolist()
        shared = _continuations_agree(ours, theirs)
        agree.append(shared / new_tokens)
        exact += shared == new_tokens
    for text in prompts[:repeats]:  # decode speed: time between the first and the last generated token
        ids = hf_tok(text)["input_ids"]
        stamps = []
        for _ in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) >= new_tokens:
                break
        speeds.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {"parent": entry["parent"], "quant": entry["quant"], "file": path.name, "bytes": entry["size_bytes"],
            "prompts": len(prompts), "new_tokens": new_tokens, "tokenizer_equal": tokenizer_equal / len(prompts),
            "greedy_identical": exact / len(prompts), "greedy_shared_fraction": statistics.mean(agree),
            "decode_tokens_per_s": statistics.median(speeds), "threads": threads}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=Path, default=ROOT / ".pipprune" / "bench-gguf" / "tiny" / "gguf" / "files.json",
                        help="files.json written by benchmarks.gguf_export")
    parser.add_argument("--heldout", type=Path, default=None, help="prompt texts [the dense parent's Persuasion]")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="prompts timed for decode speed")
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--name", default="llama_cpp")
    args = parser.parse_args(argv)

    import llama_cpp

    from pip_core.divergence import read_texts

    torch.set_num_threads(args.threads)
    files = json.loads(args.files.read_text())
    dense_dir = Path(next(f["parent_dir"] for f in files if f["parent"] == "dense"))
    texts = read_texts(args.heldout or dense_dir / "tasks" / "persuasion.jsonl")
    prompts = [t[: args.prompt_chars] for t in texts[: args.prompts]]
    rows = [run_file(entry, prompts, args.new_tokens, args.threads, args.repeats) for entry in files]
    dense_speed = {r["quant"]: r["decode_tokens_per_s"] for r in rows if r["parent"] == "dense"}
    for r in rows:
        r["speedup_vs_dense"] = r["decode_tokens_per_s"] / dense_speed[r["quant"]] if r["quant"] in dense_speed else None
    table = [f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {args.threads} threads) runs each exported file: "
             f"greedy continuations of {len(prompts)} Persuasion prompts ({args.new_tokens} new tokens) against "
             "transformers on the same weights (the file read back by its GGUF loader), llama.cpp's tokenizer against "
             "the model's, decode speed (median of timed prompts).", "",
             "| parent | type | size (MB) | tokenizer ids equal | greedy identical | greedy tokens shared | "
             "decode tok/s | vs dense |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        speedup = f"{r['speedup_vs_dense']:.2f}x" if r["speedup_vs_dense"] else ""
        table.append(f"| {r['parent']} | {r['quant']} | {r['bytes'] / 1e6:.2f} | {r['tokenizer_equal']:.0%} | "
                     f"{r['greedy_identical']:.0%} | {r['greedy_shared_fraction']:.0%} | "
                     f"{r['decode_tokens_per_s']:.0f} | {speedup} |")
    md = write(args.name, {"files": str(args.files), "llama_cpp_python": llama_cpp.__version__, "rows": rows}, table)
    print(md.read_text())


if __name__ == "__main__":
    main()
