"""Prune, then quantize: each parent (the dense model, block- and uniform-width-pruned) against its GGUF files.

Every row is measured against the dense model on the reference's held-out Persuasion: the parent as a
transformers directory, and each GGUF file as transformers' own GGUF loader rebuilds it (an independent
reader of pipprune's writer). The pruned parents are made here by PIP (one step, calibration pairs from the
reference build); the exported files stay under --out for the llama.cpp benchmark (benchmarks.llama_cpp).

    python -m benchmarks.gguf_export --model .pipprune/reference/tiny
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import ROOT, Timer, calibration_pairs, write
from infra.layout import model_dir_layout
from pip_core.importance import CalibrationData

DEFAULT_OUT = ROOT / ".pipprune" / "bench-gguf"


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def make_parents(model_dir: Path, out: Path, units: list[str], ratio: float, pairs: int, seed: int) -> dict[str, Path]:
    """{label: model dir}: the dense model itself and one PIP-pruned (uniform widths) model per unit kind."""
    from pip_core import io, schedule

    parents = {"dense": model_dir}
    calib = calibration_pairs(model_dir, pairs, seed)[0] if pairs else None
    for unit in units:
        label = f"{unit}-{ratio:g}"
        target = out / label
        if not (target / "config.json").is_file():
            model, tok = io.load(model_dir, dtype=torch.float32)
            options = schedule.ScoringOptions("pip" if calib else "magnitude", unit, width_mode="uniform", align=32)
            schedule.prune_iteratively(model, CalibrationData(tok, calib), options, ratio, 1, seed=seed, progress=False)
            io.save_pruned(model, tok, target)
        parents[label] = target
    return parents


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".pipprune" / "reference" / "tiny",
                        help="dense reference build (with tasks/persuasion.jsonl and calibration/)")
    parser.add_argument("--units", default="block,width")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--quants", default="f16,q8_0")
    parser.add_argument("--pairs", type=int, default=32, help="PIP calibration pairs (0: magnitude scores)")
    parser.add_argument("--docs", type=int, default=32, help="held-out Persuasion documents")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help=f"where parents and files go [{DEFAULT_OUT}/MODEL]")
    parser.add_argument("--name", default="gguf_export")
    args = parser.parse_args(argv)

    from infra.gguf_write import write_gguf
    from pip_core import io
    from pip_core.divergence import read_texts
    from tasks.export import gguf_quality

    out = args.out or DEFAULT_OUT / args.model.name
    texts = read_texts(model_dir_layout(args.model).heldout)[: args.docs]
    parents = make_parents(args.model, out, [u for u in args.units.split(",") if u], args.ratio, args.pairs, args.seed)
    dense, tok = io.load(args.model, dtype=torch.float32)
    rows, files = [], []
    for label, parent_dir in parents.items():
        parent = dense if label == "dense" else io.load(parent_dir, dtype=torch.float32, tokenizer=False)[0]
        for quant in [q for q in args.quants.split(",") if q]:
            with Timer() as timer:
                info = write_gguf(parent_dir, out / "gguf" / f"{label}-{quant}.gguf", quant,
                                  name=f"{args.model.name}-{label}")
            m = gguf_quality(dense, parent, tok, info.path, texts, args.max_length)
            files.append({"parent": label, "parent_dir": str(parent_dir), **info.as_dict()})
            if not any(r["parent"] == label and r["format"] == "transformers" for r in rows):
                rows.append({"parent": label, "format": "transformers", "bytes": _dir_bytes(parent_dir),
                             "kl": m["parent.heldout_kl"], "top1": m["parent.heldout_top1_agreement"],
                             "ppl_ratio": m["parent.heldout_ppl_ratio"], "ppl": m["parent.heldout_perplexity"],
                             "ppl_dense": m["source.heldout_perplexity"]})
            rows.append({"parent": label, "format": f"gguf {quant}", "bytes": info.size_bytes,
                         "kl": m["final.heldout_kl"], "top1": m["final.heldout_top1_agreement"],
                         "ppl_ratio": m["final.heldout_ppl_ratio"], "ppl": m["final.heldout_perplexity"],
                         "kl_to_parent": m["gguf.kl_to_parent"], "top1_to_parent": m["gguf.top1_to_parent"],
                         "tokenizer_match": m["gguf.tokenizer_match"], "tensor_types": info.tensor_types,
                         "fallbacks": len(info.fallbacks), "write_seconds": timer.seconds, "tokens": m["heldout.tokens"]})
        del parent
    (out / "gguf" / "files.json").write_text(json.dumps(files, indent=1))
    table = [f"GGUF export of `{args.model.name}`: each parent (dense; {args.units} pruned {args.ratio:g} by PIP, "
             f"uniform widths) as a transformers directory and as GGUF files read back by transformers' GGUF loader, "
             f"against the dense model on {len(texts)} held-out Persuasion documents ({args.max_length} tokens max).",
             "", "| parent | format | size (MB) | KL to dense | top-1 agreement | ppl ratio | perplexity | "
             "KL to parent | tokenizer ids equal | tensors |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        types = ", ".join(f"{k} {v}" for k, v in r.get("tensor_types", {}).items())
        table.append(f"| {r['parent']} | {r['format']} | {r['bytes'] / 1e6:.2f} | {r['kl']:.4f} | {r['top1']:.3f} | "
                     f"{r['ppl_ratio']:.3f} | {r['ppl']:.2f} | "
                     + (f"{r['kl_to_parent']:.5f} | {r['tokenizer_match']:.0%} | {types}"
                        + (f" ({r['fallbacks']} F16: rows not whole blocks)" if r.get("fallbacks") else "") + " |"
                        if "kl_to_parent" in r else "| | |"))
    md = write(args.name, {"model": str(args.model), "ratio": args.ratio, "units": args.units, "pairs": args.pairs,
                           "documents": len(texts), "max_length": args.max_length, "rows": rows, "files": files}, table)
    print(md.read_text())


if __name__ == "__main__":
    main()
