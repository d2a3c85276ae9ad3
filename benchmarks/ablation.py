"""Ablations of PIP's own settings: perturbation rate, one-shot vs iterative, number of calibration pairs.

The harness is benchmarks.divergence's: each run prunes a copy of the model (schedule.prune_iteratively,
method pip_l2 by default) and measures KL(dense || pruned), top-1 agreement and the perplexity ratio per
held-out document. One setting is varied at a time off the default (rate 0.15, 2 iterations, 32 pairs);
each ablated value is compared with the default's run on the same documents (paired bootstrap, 95%),
and every PIP run also with one baseline (Taylor) at the default settings, so a reader sees whether an
ablated setting changes PIP's verdict against it.
Usage: python -m benchmarks.ablation --model DIR [--axes rate,iterations,pairs] [--units block,width]
       [--heldout persuasion,wordnet] [--rates 0.05,0.15,0.3] [--iterations 1,2,4,5] [--pairs 32,128,512]
       [--resume runs.jsonl] [--name ablation]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_MODEL, add_harness_args, calibration_pairs, write
from benchmarks.divergence import N_BOOT, ci, heldout_texts, kl_comparison, metric_intervals, model_identity, prune_and_measure

#: the ablated settings, in the order their tables are shown
AXES = ("rate", "iterations", "pairs")
WORD = re.compile(r"[A-Za-z]+")
#: what identifies a setting within a (unit, ratio, seed) cell
SETTING = ("axis", "method", "rate", "iterations", "pairs")


@dataclass(frozen=True)
class Setting:
    """One pruning configuration of the ablation; `axis` names what differs from the default ("default", "baseline")."""

    axis: str
    method: str
    rate: float
    iterations: int
    pairs: int

    def key(self, unit: str) -> str:
        return f"{unit}|{self.axis}|{self.method}|{self.rate:g}|{self.iterations}|{self.pairs}"


def plan(default: Setting, values: dict[str, list], baseline: str | None) -> list[Setting]:
    """The default, the baseline at the default settings, then each axis's values other than the default's."""
    settings = [default]
    if baseline:
        settings.append(replace(default, axis="baseline", method=baseline))
    for axis, axis_values in values.items():
        if axis not in AXES:
            raise SystemExit(f"unknown ablation axis {axis!r}; choose from {', '.join(AXES)}")
        for value in axis_values:
            if value != getattr(default, axis):
                settings.append(replace(default, axis=axis, **{axis: value}))
    return settings


def edited_words(pairs: list[tuple[str, str]]) -> float:
    """Mean number of words a pair's perturbed view changes (the perturber's edits keep the word count)."""
    return sum(sum(a != b for a, b in zip(WORD.findall(o), WORD.findall(p), strict=False)) for o, p in pairs) / len(pairs)


def _mean(runs: list[dict], field: str) -> float | None:
    values = [r.get(field) for r in runs]
    return None if None in values else sum(values) / len(values)


def _compare(unit: str, ratio: float, seed: int | str, group: dict[tuple, list[dict]], n_boot: int,
             boot_seed: int) -> tuple[list[dict], list[dict]]:
    """Intervals and verdicts of one cell; `group` maps a setting (SETTING fields) to its runs, one per seed."""
    from pip_core.divergence import DocStats

    defaults = [k for k in group if k[0] == "default"]
    baselines = [k for k in group if k[0] == "baseline"]
    if len(defaults) != 1 or len(baselines) > 1:
        raise ValueError(f"{unit} ratio {ratio} seed {seed}: need exactly one default run and at most one "
                         f"baseline run, got {len(defaults)} and {len(baselines)}")

    def stats(key: tuple):  # one DocStats, or a list of them (pooled over seeds)
        found = [DocStats.from_json(r["docs"]) for r in group[key]]
        return found[0] if len(found) == 1 else found

    default = stats(defaults[0])
    baseline = stats(baselines[0]) if baselines else None
    order = ["default", "baseline", *AXES]
    summary, verdicts = [], []
    for key in sorted(group, key=lambda k: (order.index(k[0]), k[SETTING.index(k[0])] if k[0] in AXES else 0)):
        row = {"unit": unit, "ratio": ratio, "seed": seed, **dict(zip(SETTING, key, strict=True))}
        mine = stats(key)
        summary.append({**row, **{f: _mean(group[key], f) for f in ("edited_words_per_pair", "seconds")},
                        **metric_intervals(mine, boot_seed, n_boot)})
        value = row[row["axis"]] if row["axis"] in AXES else None
        if row["axis"] in AXES:
            verdicts.append({**row, "value": value, "vs": "default", **kl_comparison(mine, default, boot_seed, n_boot)})
        if baseline is not None and row["axis"] != "baseline":
            verdicts.append({**row, "value": value, "vs": baselines[0][1],
                             **kl_comparison(mine, baseline, boot_seed, n_boot)})
    return summary, verdicts


def summarise(runs: list[dict], n_boot: int = N_BOOT) -> tuple[list[dict], list[dict]]:
    """Per run: intervals; per ablated run: paired KL difference to the default run of its unit/ratio/seed;
    per PIP run (default included): paired KL difference to the baseline run of its unit/ratio/seed.
    With several seeds, the same again pooled over seeds (mean over seeds, seed "mean of ...") for
    every setting measured at every seed."""
    summary, verdicts = [], []
    for unit, ratio, seed in sorted({(r["unit"], r["ratio"], r["seed"]) for r in runs}):
        group: dict[tuple, list[dict]] = {}
        for r in runs:
            if (r["unit"], r["ratio"], r["seed"]) == (unit, ratio, seed):
                group.setdefault(tuple(r[k] for k in SETTING), []).append(r)
        if any(len(v) > 1 for v in group.values()):
            raise ValueError(f"{unit} ratio {ratio} seed {seed}: a setting was measured twice")
        cell_summary, cell_verdicts = _compare(unit, ratio, seed, group, n_boot, seed)
        summary += cell_summary
        verdicts += cell_verdicts
    for unit, ratio in sorted({(r["unit"], r["ratio"]) for r in runs}):
        cell = sorted((r for r in runs if (r["unit"], r["ratio"]) == (unit, ratio)), key=lambda r: r["seed"])
        seeds = sorted({r["seed"] for r in cell})
        if len(seeds) < 2:
            continue
        group = {}
        for r in cell:
            group.setdefault(tuple(r[k] for k in SETTING), []).append(r)
        group = {k: v for k, v in group.items() if [r["seed"] for r in v] == seeds}
        cell_summary, cell_verdicts = _compare(unit, ratio, "mean of " + ",".join(map(str, seeds)), group, n_boot, 0)
        summary += cell_summary
        verdicts += cell_verdicts
    return summary, verdicts


def tables(model: str, summary: list[dict], verdicts: list[dict], docs: int, heldout: str, default: Setting) -> list[str]:
    def verdict(row: dict, vs: str) -> str:
        found = [v for v in verdicts if v["vs"] == vs and all(v[k] == row[k] for k in
                 ("unit", "ratio", "seed", "axis", "method", "rate", "iterations", "pairs"))]
        return f"{ci(found[0]['kl_diff'])} {found[0]['relative']:+.1%} **{found[0]['verdict']}**" if found else ""

    baseline = next((s["method"] for s in summary if s["axis"] == "baseline"), None)
    lines = [f"# Ablations of PIP ({default.method}) ({model}, {docs} held-out {heldout} documents, paired bootstrap 95%)",
             "", f"One setting varied at a time off the default (rate {default.rate:g}, {default.iterations} iterations, "
             f"{default.pairs} pairs); 'vs default' is KL(ablated) - KL(default) on the same documents "
             "(better = lower KL than the default)" + (f"; 'vs {baseline}' is KL(row) - KL({baseline} at the default "
                                                        "settings)." if baseline else ".") + " Seed 'mean of ...': "
             "the metric averaged over seeds (calibration draws), paired over the same documents.", "",
             f"| unit | ratio | seed | ablated | method | rate | iterations | pairs | edited words / pair | KL(dense‖pruned) | "
             f"top-1 agreement | ppl / dense | vs default (KL diff, relative, verdict) | "
             f"vs {baseline or '-'} (KL diff, relative, verdict) | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        perturbed = s["axis"] != "baseline"  # a baseline scores the original texts only: no rate, no edits
        words = f"{s['edited_words_per_pair']:.2f}" if perturbed and s.get("edited_words_per_pair") is not None else "-"
        seconds = f"{s['seconds']:.0f}" if s.get("seconds") is not None else ""
        rate = f"{s['rate']:g}" if perturbed else "-"
        lines.append(f"| {s['unit']} | {s['ratio']:.1f} | {s['seed']} | {s['axis']} | {s['method']} | {rate} | "
                     f"{s['iterations']} | {s['pairs']} | {words} | {ci(s['kl'])} | {ci(s['top1_agreement'])} | "
                     f"{ci(s['ppl_ratio'])} | "
                     f"{verdict(s, 'default')} | {verdict(s, baseline) if baseline else ''} | {seconds} |")
    return lines


def render(result: dict) -> list[str]:
    """The markdown table of a written result, recomputed from its JSON (benchmarks.report re-renders with it)."""
    default = Setting(**result["default"])
    return tables(Path(str(result["args"]["model"])).name, result["summary"], result["verdicts"], result["documents"],
                  result["heldout"], default)


def _values(text: str, kind: type) -> list:
    return [kind(v) for v in text.split(",") if v.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--axes", default=",".join(AXES), help="comma list of rate, iterations, pairs")
    parser.add_argument("--units", default="block,width")
    parser.add_argument("--method", default="pip_l2", help="the PIP form ablated (pip_l2 is the default PIP form)")
    parser.add_argument("--baseline", default="taylor", help="one baseline at the default settings ('' for none)")
    parser.add_argument("--rates", default="0.05,0.15,0.3")
    parser.add_argument("--iterations", default="1,2,4,5", help="2: this harness's default; 4: the config default")
    parser.add_argument("--pairs", default="32,128,512")
    parser.add_argument("--default-rate", type=float, default=0.15)
    parser.add_argument("--default-iterations", type=int, default=2)
    parser.add_argument("--default-pairs", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--seeds", default="0", help="comma list; several seeds add verdicts pooled over seeds")
    add_harness_args(parser)
    parser.add_argument("--name", default="ablation")
    args = parser.parse_args()
    started = time.perf_counter()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    from infra.calibration import calibration_hash
    from pip_core import io, schedule

    axes = [a for a in args.axes.split(",") if a]
    parse = {"rate": (args.rates, float), "iterations": (args.iterations, int), "pairs": (args.pairs, int)}
    default = Setting("default", args.method, args.default_rate, args.default_iterations, args.default_pairs)
    settings = plan(default, {a: _values(*parse[a]) if a in parse else [] for a in axes}, args.baseline or None)
    base, tokenizer = io.load(args.model)
    sets = {h: heldout_texts(args.model, h) for h in args.heldout.split(",")}
    done: dict[str, dict] = {}
    identity = model_identity(args.model)  # a committed runs file is reused from any checkout path
    if args.resume and args.resume.is_file():
        for line in args.resume.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                same = record.get("model_id", record["model"]) in (identity, str(args.model))
                if same and record["digests"] == {h: d for h, (_, d) in sets.items()}:
                    done[record["key"]] = record["runs"]
    runs: dict[str, list[dict]] = {h: [] for h in sets}
    for unit in args.units.split(","):
        for seed in _values(args.seeds, int):
            for s in settings:
                key = f"{s.key(unit)}|{args.ratio:g}|{seed}|{args.width_mode}|{args.max_length}"
                if key not in done:
                    pairs, calib = calibration_pairs(args.model, s.pairs, seed, rate=s.rate)
                    options = schedule.ScoringOptions(s.method, unit, width_mode=args.width_mode)
                    measured = prune_and_measure(base, tokenizer, options, args.ratio, s.iterations, pairs, calib, seed,
                                                 sets, args.max_length, unit=unit, ratio=args.ratio, seed=seed,
                                                 **asdict(s), calibration_sha256=calibration_hash(calib),
                                                 edited_words_per_pair=edited_words(pairs))
                    done[key] = measured
                    if args.resume:
                        with args.resume.open("a") as fh:
                            fh.write(json.dumps({"key": key, "model": str(args.model), "model_id": identity, "runs": measured,
                                                 "digests": {h: d for h, (_, d) in sets.items()}}) + "\n")
                for held, run in done[key].items():
                    runs[held].append(run)
                first = next(iter(done[key].values()))
                print({k: v for k, v in first.items() if k != "docs"}, flush=True)
    for n, (held, (texts, digest)) in enumerate(sets.items()):
        summary, verdicts = summarise(runs[held])
        meta = {"heldout": held, "heldout_sha256": digest, "documents": len(texts), "default": asdict(default),
                "width_mode": args.width_mode, "align": schedule.ScoringOptions("pip", "width").align,
                "wall_seconds": time.perf_counter() - started,  # runs reused from --resume cost nothing here
                "run_seconds_total": sum(r["seconds"] for r in runs[list(sets)[-1]]),  # pruning + every held-out set
                "bootstrap": {"n_boot": N_BOOT, "level": 0.95, "over": "held-out documents, paired"}}
        name = args.name if n == 0 else f"{args.name}_{Path(held).stem}"
        print(write(name, {"args": vars(args), **meta, "runs": runs[held], "summary": summary, "verdicts": verdicts},
                    tables(args.model.name, summary, verdicts, len(texts), held, default)))


if __name__ == "__main__":
    main()
