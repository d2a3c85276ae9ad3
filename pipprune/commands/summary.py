"""The end of a compress run as a person reads it: the figures, the verdict in words, what both models say."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO


def print_summary(summary: Any, settings: Any, stream: TextIO, home: Path) -> None:  # CompressSummary, Settings
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream, width=max(100, Console(file=stream).width))
    table = Table(title=f"pipprune compress: run {summary.run_key}")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_row("parameters", f"{summary.params_before:,}", f"{summary.params_after:,}")
    table.add_row("removed", "", f"{summary.achieved_ratio:.2%}")
    for key in sorted(set(summary.metrics_before) | set(summary.metrics_after)):
        b, a = summary.metrics_before.get(key), summary.metrics_after.get(key)
        table.add_row(key, "" if b is None else f"{b:.4g}", "" if a is None else f"{a:.4g}")
    console.print(table)
    _print_vocab(console, summary.vocab)
    _print_general_set(console, summary.general_set)
    console.print(f"lm-eval tasks: {', '.join(summary.tasks) or 'none'} ({summary.tasks_origin or 'as given'})")
    if summary.samples:
        samples = Table(title="greedy continuations", show_lines=True)
        for column in ("prompt", "dense", "compressed"):
            samples.add_column(column, overflow="fold")
        for row in summary.samples:
            samples.add_row(row["prompt"], row["dense"].strip(), row["compressed"].strip())
        console.print(samples)
    _print_repair(console, summary.repair)
    _print_repetition(console, summary.metrics_before, summary.metrics_after)
    _print_verdict(console, summary.quality, recovered=bool(summary.metrics_before_recovery))
    if summary.peak_rss_bytes:
        own = (f"; {summary.run_memory_over_weights:.2f}x above the {summary.baseline_rss_bytes / 2**30:.2f} GiB "
               "the process held before reading a model" if summary.baseline_rss_bytes else "")
        console.print(f"peak memory: {summary.peak_rss_bytes / 2**30:.2f} GiB resident "
                      f"({summary.peak_rss_over_weights:.2f}x the weights in the run's dtype{own})")
    console.print(f"MLflow run: {summary.mlflow_run_id}  ({settings.mlflow_tracking_uri})")
    console.print(f"Registered: {summary.registered_model} version {summary.model_version}")
    console.print(f"S3 checkpoint: {summary.s3_uri}")
    if summary.metrics_before_recovery:
        ppl = summary.metrics_before_recovery.get("heldout_perplexity")
        if ppl is not None:
            console.print(f"recovery: held-out perplexity {ppl:.4g} before recovery, "
                          f"{summary.metrics_after.get('heldout_perplexity', float('nan')):.4g} after")
    if summary.iterations_resumed:
        console.print(f"Resumed after {summary.iterations_resumed} completed iteration(s) found in S3")
    if summary.out_dir:
        console.print(f"Model copied to: {summary.out_dir}")


def _print_vocab(console: Any, vocab: dict | None) -> None:  # rich Console
    """The vocabulary trimmed before pruning, and that the 'before' figures are the trimmed model's."""
    if not vocab:
        return
    removed = vocab["params_before"] - vocab["params_after"]
    console.print(f"vocabulary: {vocab['vocab_before']:,} -> {vocab['vocab_after']:,} tokens trimmed to "
                  f"{vocab['corpus']} ({vocab['corpus_texts']:,} texts encode as before), {removed:,} parameters "
                  f"({removed / vocab['params_before']:.1%} of the model) before any unit was pruned; kept ids sha256 "
                  f"{vocab['kept_sha256'][:16]}. The 'before' figures are the trimmed model's.")


def _print_repair(console: Any, repair: dict) -> None:  # rich Console
    """What the closed-form repair did: each step's layer output error against the dense model, before and after."""
    form = repair.get("form", "none")
    if form == "none":
        console.print("repair: none (pruned layers kept as cut; --repair lstsq refits them in closed form)")
        return
    steps = repair.get("steps", [])
    parts = [f"step {int(s['iteration'])}: {s['error_before']:.3f} -> {s['error_after']:.3f}" for s in steps]
    seconds = sum(s.get("seconds", 0.0) for s in steps)
    console.print(f"repair: {form} after each pruning step, {seconds:.0f} s; output error of the repaired layers "
                  f"against the dense model's (relative, mean over layers): {'; '.join(parts) or 'no step repaired'}")


def _print_general_set(console: Any, general: dict) -> None:  # rich Console
    """What the general_* rows were measured on: the verdict's perplexity ratio reads them."""
    if general:
        console.print(f"general held-out set (general_* rows): {general['source']}; {general['tokens']:,} tokens in "
                      f"{general['windows']} windows of at most {general['max_length']} tokens; sha256 "
                      f"{general['sha256'][:16]}" + (f"; {general['precision']}" if general.get("precision") else ""))


def _print_repetition(console: Any, before: dict, after: dict) -> None:  # rich Console
    from pip_core.repetition import ngram_name

    dense, compressed = before.get("samples_distinct"), after.get("samples_distinct")
    if dense is not None and compressed is not None:
        console.print(f"repetition: share of distinct {ngram_name()} in the continuations: dense {dense:.3f}, "
                      f"compressed {compressed:.3f} (x{after.get('samples_distinct_ratio', float('nan')):.2f})")


def _print_verdict(console: Any, quality: dict, recovered: bool = False) -> None:  # rich Console
    verdict = quality.get("verdict")
    if verdict is None:
        return
    bounds = [f"KL <= {quality.get('max_kl')}", f"perplexity ratio <= {quality.get('max_ppl_ratio')}"
              + (" (general held-out set)" if "general_ppl_ratio" in quality.get("figures", {}) else "")]
    if "min_distinct_ratio" in quality:
        bounds.append(f"distinct-token ratio >= {quality['min_distinct_ratio']}")
    unmeasured = "; ".join(quality.get("not_measured") or [])
    gate = f"(gate: {', '.join(bounds)}{'; ' + unmeasured if unmeasured and verdict == 'usable' else ''})"
    if verdict == "usable":
        console.print(f"[bold green]verdict: usable[/] {gate}")
        return
    reasons = "; ".join(quality.get("reasons", []))
    recovery = ("more recovery steps than this run's (--recovery-steps N)" if recovered  # it did recover: say so
                else "recovery (--recovery-steps N --recovery kd)")
    console.print(f"[bold red]verdict: {verdict.upper()}[/]: {reasons} {gate}. The version is registered and marked "
                  f"so; promotion is refused. Try a smaller ratio, another method or unit, or {recovery}.")
