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
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import ROOT, write
from infra.layout import model_dir_layout


def _continuations_agree(a: list[int], b: list[int]) -> int:
    """Tokens the two continuations share before they first differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def open_file(entry: dict, threads: int):  # llama_cpp.Llama (the file is memory-mapped)
    from llama_cpp import Llama

    return Llama(model_path=entry["path"], n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 seed=0, logits_all=True, verbose=False)


def greedy(llm, ids: list[int], new_tokens: int) -> list[int]:
    out: list[int] = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) >= new_tokens:
            break
    return out


def hf_greedy(hf, ids: list[int], new_tokens: int) -> list[int]:
    """Plain argmax decoding in transformers, past end-of-sequence as llama.cpp's generate goes (`generate` with
    min_new_tokens would instead forbid EOS and pick the runner-up)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq


def compare_file(entry: dict, llm, prompts: list[str], new_tokens: int) -> dict:
    """llama.cpp against transformers on the same weights: tokenizer, next-token logits on the same tokens (teacher
    forced on transformers' greedy continuation), and free-running greedy continuations."""
    import numpy as np
    from transformers import AutoTokenizer

    from tasks.export import read_back

    hf, tok = read_back(Path(entry["path"]))[0], AutoTokenizer.from_pretrained(entry["parent_dir"])
    tokenizer_equal, shared, exact, top1, max_diff, margins = 0, [], 0, [], [], []
    for text in prompts:
        ids = tok(text)["input_ids"]
        bos = tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id]
        tokenizer_equal += llm.tokenize(text.encode("utf-8"), add_bos=bos, special=False) == ids
        full = hf_greedy(hf, ids, new_tokens)
        with torch.no_grad():
            hf_logits = hf(torch.tensor([full])).logits[0].float().numpy()
        llm.reset()
        llm.eval(full)
        cpp_logits = np.asarray(llm.scores[: len(full)], dtype=np.float32)
        span = slice(len(ids) - 1, len(full) - 1)  # the positions that predict the continuation
        top1.append(float((cpp_logits[span].argmax(-1) == hf_logits[span].argmax(-1)).mean()))
        max_diff.append(float(np.abs(cpp_logits - hf_logits).max()))
        ours, theirs = greedy(llm, ids, new_tokens), full[len(ids):]
        k = _continuations_agree(ours, theirs)
        shared.append(k / new_tokens)
        exact += k == new_tokens
        if k < new_tokens:  # where they part: how far apart transformers put the two candidates
            row = hf_logits[len(ids) - 1 + k]
            margins.append(float(row[theirs[k]] - row[ours[k]]))
    return {"parent": entry["parent"], "quant": entry["quant"], "file": Path(entry["path"]).name,
            "bytes": entry["size_bytes"], "prompts": len(prompts), "new_tokens": new_tokens,
            "tokenizer_equal": tokenizer_equal / len(prompts), "teacher_forced_top1": statistics.mean(top1),
            "max_logit_diff": max(max_diff), "greedy_identical": exact / len(prompts),
            "greedy_shared_fraction": statistics.mean(shared),
            "divergence_margin_median": statistics.median(margins) if margins else None}


def decode_speed(opened: dict, prompt_ids: list[list[int]], new_tokens: int, rounds: int) -> dict[str, float]:
    """Median decode tokens/s per file: each round times every file once, so load drift on a shared machine hits all
    files alike (the time between the first and the last generated token)."""
    speeds: dict[str, list[float]] = {name: [] for name in opened}
    for _ in range(rounds):
        for name, llm in opened.items():
            for ids in prompt_ids:
                stamps = []
                for _token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
                    stamps.append(time.perf_counter())
                    if len(stamps) >= new_tokens:
                        break
                speeds[name].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {name: statistics.median(v) for name, v in speeds.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=Path, default=ROOT / ".pipprune" / "bench-gguf" / "tiny" / "gguf" / "files.json",
                        help="files.json written by benchmarks.gguf_export")
    parser.add_argument("--heldout", type=Path, default=None, help="prompt texts [the dense parent's Persuasion]")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (each times every file on 3 prompts)")
    parser.add_argument("--speed-tokens", type=int, default=64, help="tokens generated per timed prompt")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (1: no barrier waits on a busy "
                        "machine; raise it on a quiet one)")
    parser.add_argument("--name", default="llama_cpp")
    args = parser.parse_args(argv)

    import llama_cpp

    from pip_core.divergence import read_texts

    torch.set_num_threads(args.threads)
    files = json.loads(args.files.read_text())
    dense_dir = Path(next(f["parent_dir"] for f in files if f["parent"] == "dense"))
    texts = read_texts(args.heldout or model_dir_layout(dense_dir).heldout)
    prompts = [t[: args.prompt_chars] for t in texts[: args.prompts]]
    opened = {entry["path"]: open_file(entry, args.threads) for entry in files}
    rows = [compare_file(entry, opened[entry["path"]], prompts, args.new_tokens) for entry in files]
    from transformers import AutoTokenizer

    first = AutoTokenizer.from_pretrained(files[0]["parent_dir"])
    speed = decode_speed(opened, [first(p)["input_ids"] for p in prompts[:3]], args.speed_tokens, args.rounds)
    for entry, row in zip(files, rows, strict=True):
        row["decode_tokens_per_s"], row["threads"] = speed[entry["path"]], args.threads
    dense_speed = {r["quant"]: r["decode_tokens_per_s"] for r in rows if r["parent"] == "dense"}
    for r in rows:
        r["speedup_vs_dense"] = r["decode_tokens_per_s"] / dense_speed[r["quant"]] if r["quant"] in dense_speed else None
    table = [f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {args.threads} threads) runs each exported file: "
             f"greedy continuations of {len(prompts)} Persuasion prompts ({args.new_tokens} new tokens) against "
             "transformers on the same weights (the file read back by its GGUF loader), next-token top-1 agreement and "
             "largest logit difference with both fed the same tokens, llama.cpp's tokenizer against the model's, "
             f"decode speed ({args.speed_tokens} tokens, median over {args.rounds} interleaved rounds).", "",
             "| parent | type | size (MB) | tokenizer ids equal | same-token top-1 | max logit diff | greedy identical | "
             "greedy tokens shared | margin where greedy parts | decode tok/s | vs dense |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        speedup = f"{r['speedup_vs_dense']:.2f}x" if r["speedup_vs_dense"] else ""
        margin = "" if r["divergence_margin_median"] is None else f"{r['divergence_margin_median']:.3f}"
        table.append(f"| {r['parent']} | {r['quant']} | {r['bytes'] / 1e6:.2f} | {r['tokenizer_equal']:.0%} | "
                     f"{r['teacher_forced_top1']:.3f} | {r['max_logit_diff']:.3f} | {r['greedy_identical']:.0%} | "
                     f"{r['greedy_shared_fraction']:.0%} | {margin} | {r['decode_tokens_per_s']:.0f} | {speedup} |")
    md = write(args.name, {"files": str(args.files), "llama_cpp_python": llama_cpp.__version__, "rows": rows}, table)
    print(md.read_text())


if __name__ == "__main__":
    main()
