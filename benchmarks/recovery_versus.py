"""Two recovery curves against each other: the same recovery and budget after two different prunings.

`benchmarks.recovery --compare` gives one pruning's curve (no recovery, LoRA on the LM loss, KD at each budget).
Whether recovery should follow one pruning or another (width PIP, the default, against the best block method)
needs each row of one curve paired with the same row of the other, on the same held-out documents:

    python -m benchmarks.recovery_versus benchmarks/results/recovery_curve_smollm2_width.json \\
        benchmarks/results/recovery_curve_smollm2_block_influence.json --name recovery_versus_smollm2

Writes the KL and perplexity-ratio difference (first minus second, paired bootstrap over documents, 95%) and a
verdict for every row both curves have, on every held-out set, plus each side's WordNet cloze accuracy.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from benchmarks.common import write
from benchmarks.recovery import N_BOOT, _stats, run_label


def _label(payload: dict) -> str:
    args = payload["args"]
    return f"{args.get('method', 'pip')} {args['unit']} {args['ratio']}"


def versus(a: dict, b: dict, n_boot: int = N_BOOT) -> list[dict]:
    """Rows present in both curves, paired over documents; digests must match or the pairing means nothing."""
    from pip_core import bootstrap

    by_a, by_b = {}, {}
    for payload, by in ((a, by_a), (b, by_b)):
        for run in payload["runs"]:
            by.setdefault(run_label(run), []).append(run)
    rows = []
    for label in [k for k in by_a if k in by_b]:
        for heldout in by_a[label][0]["heldout"]:
            if heldout not in by_b[label][0]["heldout"]:
                continue
            if by_a[label][0]["heldout"][heldout]["sha256"] != by_b[label][0]["heldout"][heldout]["sha256"]:
                raise SystemExit(f"{label} {heldout}: the two curves measured different documents")
            sa = [_stats(r, heldout) for r in by_a[label]]
            sb = [_stats(r, heldout) for r in by_b[label]]
            row = {"recovery": label, "heldout": heldout, "seeds": [len(sa), len(sb)]}
            for metric in ("kl", "ppl_ratio"):
                diff = bootstrap.paired_difference(sa, sb, metric, n_boot)
                row[metric] = {"a": _mean(s.metrics()[metric] for s in sa),
                               "b": _mean(s.metrics()[metric] for s in sb),
                               "diff": diff.as_dict(), "verdict": bootstrap.verdict(diff)}
            row["cloze_acc"] = [_mean(r.get("cloze_acc") for r in by_a[label]),
                                _mean(r.get("cloze_acc") for r in by_b[label])]
            row["train_seconds"] = [_mean(r["train_seconds"] for r in by_a[label]),
                                    _mean(r["train_seconds"] for r in by_b[label])]
            rows.append(row)
    return rows


def _mean(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def table(rows: list[dict], a_name: str, b_name: str, dense_cloze: float | None) -> list[str]:
    lines = [f"# Recovery after {a_name} (A) against after {b_name} (B), same recovery and budget", "",
             "Paired bootstrap over the held-out documents (2000 resamples, 95%); difference = A - B, lower is "
             f"better for A. Cloze: WordNet cloze accuracy (dense {dense_cloze if dense_cloze is not None else '-'}).",
             "", "| recovery | held-out | KL A | KL B | KL A - B [95%] | verdict | ppl ratio A | ppl ratio B | "
             "ppl ratio verdict | cloze A / B | train s A / B |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl, pr, d = r["kl"], r["ppl_ratio"], r["kl"]["diff"]
        cloze = " / ".join("-" if c is None else f"{c:.2f}" for c in r["cloze_acc"])
        secs = " / ".join(f"{s:.0f}" for s in r["train_seconds"])
        lines.append(f"| {r['recovery']} | {r['heldout']} | {kl['a']:.3f} | {kl['b']:.3f} | {d['point']:+.3f} "
                     f"[{d['low']:+.3f}, {d['high']:+.3f}] | {kl['verdict']} | {pr['a']:.2f} | {pr['b']:.2f} | "
                     f"{pr['verdict']} | {cloze} | {secs} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="a recovery --compare result JSON")
    parser.add_argument("b", type=Path, help="another, measured on the same held-out documents")
    parser.add_argument("--name", default="recovery_versus")
    args = parser.parse_args()
    a, b = (json.loads(p.read_text()) for p in (args.a, args.b))
    rows = versus(a, b)
    if not rows:
        raise SystemExit("the two curves share no recovery row")
    payload = {"a": str(args.a), "b": str(args.b), "a_pruning": _label(a), "b_pruning": _label(b),
               "dense_cloze_acc": a.get("dense_cloze_acc"), "rows": rows}
    print(write(args.name, payload, table(rows, _label(a), _label(b), a.get("dense_cloze_acc"))))


if __name__ == "__main__":
    main()
