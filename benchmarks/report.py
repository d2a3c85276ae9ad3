"""Collect every benchmarks/results/*.md table into benchmarks/results/README.md (linked from the README),
headed by a targets table computed from the JSON results, so the verdicts never drift from the figures.
"""

from __future__ import annotations

import json
import statistics

from benchmarks.common import RESULTS

ORDER = ["quality", "peer", "cost", "overhead", "inference", "recovery"]

HEADER = """# pipprune benchmarks

All figures were measured on the project's 2-core CPU machine (no GPU); the JSON beside each table
holds every run, the environment and the arguments. Regenerate: `make bench` and `make bench-peer`
(or each `python -m benchmarks.<name>`), then `python -m benchmarks.report`. Ratios are measured
within one run because the machine is shared and noisy. `benchmarks/gpu_check.sh` is the GPU check
(not run here: no accelerator was lent to this task).
"""


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _quality_rows(quality: dict) -> list[str]:
    rows = []
    runs = [r for r in quality["runs"] if abs(r["ratio"] - 0.2) < 1e-9]
    for unit in sorted({r["unit"] for r in runs}):
        by_method = {}
        for r in runs:
            if r["unit"] == unit:
                by_method.setdefault(r["method"], []).append(r["cloze_retained"])
        if "pip" not in by_method:
            continue
        pip = statistics.mean(by_method["pip"])
        rows.append(f"| PIP {unit} 0.2 keeps >= 90% cloze accuracy | {pip:.3f} ({len(by_method['pip'])} seeds) | "
                    f"{'met' if pip >= 0.9 else 'missed'} |")
        others = {m: statistics.mean(v) for m, v in by_method.items() if m != "pip"}
        best_name, best = max(others.items(), key=lambda kv: kv[1])
        verdict = "met" if pip > best else "missed"
        rows.append(f"| PIP {unit} 0.2 beats every baseline's retained cloze accuracy | PIP {pip:.3f} vs best "
                    f"baseline {best_name} {best:.3f} | {verdict} |")
    return rows


def targets() -> list[str]:
    lines = ["## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
    quality, cost, overhead, inference = _load("quality"), _load("cost"), _load("overhead"), _load("inference")
    if quality:
        lines += _quality_rows(quality)
    if cost:
        for row in cost["rows"]:
            lines.append(f"| scoring cost <= 1.3x the two-pass limit ({row['size']}) | {row['cost_ratio']:.2f}x | "
                         f"{'met' if row['cost_ratio'] <= 1.3 else 'missed'} |")
            lines.append(f"| peak memory <= 2.5x weights ({row['size']}) | {row['peak_over_weights']:.2f}x | "
                         f"{'met' if row['peak_over_weights'] <= 2.5 else 'missed'} |")
    if overhead:
        o = overhead["row"]["overhead"]
        lines.append(f"| orchestration overhead <= 10% (small) | {o:+.1%} | {'met' if o <= 0.10 else 'missed'} |")
    if inference:
        for r in inference["rows"]:
            lines.append(f"| inference gain >= 80% of ideal ({r.get('model', '')} {r['unit']}, batch {r['batch']}) | "
                         f"{r['fraction_of_ideal']:.0%} | {'met' if r['fraction_of_ideal'] >= 0.8 else 'missed'} |")
    return lines + [""]


def main() -> None:
    parts = [HEADER, "\n".join(targets())]
    for name in ORDER:
        path = RESULTS / f"{name}.md"
        if path.is_file():
            parts.append(path.read_text())
    (RESULTS / "README.md").write_text("\n".join(parts))
    print(RESULTS / "README.md")


if __name__ == "__main__":
    main()
