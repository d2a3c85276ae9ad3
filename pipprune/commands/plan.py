"""`pipprune plan`: memory each stage needs and, with a target, the budget's schedule (config alone, no weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from pipprune.commands import options
from pipprune.commands.common import (
    fail,
    json_output,
)

if TYPE_CHECKING:
    from pip_core.budget import BudgetPlan


def plan_cmd(
    model: str = typer.Option(..., help="hub id, local model dir, or a config.json file"),
    unit: Optional[str] = options.unit(),
    target: Optional[str] = options.target(),
    ratio: Optional[float] = options.ratio(),
    width_mode: Optional[str] = options.width_mode(),
    iterations: Optional[int] = options.iterations(),
    align: Optional[int] = options.align(),
    protect_first: Optional[int] = options.protect_first(),
    protect_last: Optional[int] = options.protect_last(),
    serve_context: Optional[int] = options.serve_context(),
    serve_batch: Optional[int] = options.serve_batch(),
    vocab_corpus: Optional[str] = typer.Option(None, help="trim the vocabulary to this corpus first (as compress "
                                               "--vocab-corpus): the plan counts the tokens it keeps (needs the "
                                               "model's tokenizer: a model directory or GGUF file)"),
    json_out: bool = typer.Option(False, "--json", help="print the plan as one JSON document (logs: stderr)"),
    dtype: str = typer.Option("auto", help="auto | bfloat16 | float16 | float32 (auto: the checkpoint's own)"),
    seq_len: int = typer.Option(128, help="calibration sequence length"),
    gradient_checkpointing: bool = typer.Option(False, help="force recomputing activations in backward"),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N: the device whose free memory counts"),
) -> None:
    """Memory each stage needs and, with --target/--ratio, the budget's schedule: from the config alone (no weights)."""
    from rich.console import Console
    from rich.table import Table

    from pip_core.memory_plan import plan_memory
    from pip_core.placement import plan_placement

    config = _read_config(model)
    vocab_after = _kept_tokens(model, vocab_corpus) if vocab_corpus else None
    budget = _budget_plan(config, target, ratio, dtype, dict(
        unit=unit, width_mode=width_mode, iterations=iterations, align=align, protect_first=protect_first,
        protect_last=protect_last), dict(context=serve_context, batch=serve_batch), vocab_after)
    unit = budget.unit if budget else (unit or options.scoring().unit)
    if json_out:
        with json_output(True) as doc:
            doc.emit({"ok": True, "model": model, "budget": budget.as_dict() if budget else None})
        return
    if budget is not None:
        _print_budget(budget)
    try:
        placement = plan_placement(config, device, dtype, seq_len=seq_len)
        plan = placement.plan
        if gradient_checkpointing and not plan.gradient_checkpointing:
            plan = plan_memory(config, dtype=placement.dtype, batch=2, seq_len=seq_len, gradient_checkpointing=True)
    except (ValueError, TypeError, KeyError) as exc:
        fail(f"cannot plan memory for {model}: {exc}")
    free, where = placement.free_bytes, placement.device
    if placement.device_map:
        where = "all GPUs + host (device_map='auto')"
    table = Table(title=f"{model}: {plan.num_params:,} parameters, {placement.dtype}, unit {unit}, seq {seq_len}")
    table.add_column("stage")
    table.add_column("GiB", justify="right")
    for label, value in [("weights", plan.weights), ("largest live gradient", plan.gradients_peak),
                         ("activations (2 views)" + (", checkpointed" if plan.gradient_checkpointing else ""),
                          plan.activations), ("logits (one slice of the sequence)", plan.logits),
                         ("peak: PIP scoring", plan.peak_scoring), ("peak: evaluation", plan.peak_eval),
                         (f"free on {where}", free)]:
        table.add_row(label, f"{value / 2**30:.2f}")
    console = Console()
    console.print(table)
    console.print(f"placement: {placement.describe()}")
    if not placement.fits:
        typer.secho("does not fit: PIP scoring needs more memory than is free", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


def _kept_tokens(model: str, corpus: str) -> int:
    """The tokens `corpus` keeps of the model's vocabulary, or exit 2 naming why it cannot be counted."""
    from infra.budgeting import kept_tokens
    from infra.vocab_source import VocabSourceError
    from pip_core.errors import PipCoreError

    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".json":
        fail("--vocab-corpus needs the model's tokenizer: give the model directory or GGUF file, not its config.json")
    try:
        return kept_tokens(model, corpus)
    except (VocabSourceError, PipCoreError, OSError, ValueError) as exc:
        fail(f"vocab corpus {corpus!r}: {exc}")


def _budget_plan(config: dict, target: str | None, ratio: float | None, dtype: str, scoring: dict,
                 serving: dict, vocab_after: int | None = None) -> BudgetPlan | None:
    """The budget plan of the job these options describe (the config's defaults for the rest, planned as the
    flow plans it), or exit 2 naming the problem (an infeasible target: with the nearest feasible one)."""
    from infra.budgeting import plan_with, refusal
    from pip_core.budget import BudgetError
    from pip_core.errors import PipCoreError

    if target is not None and ratio is not None:
        fail("give --ratio or --target, not both")
    if target is None and ratio is None:
        if vocab_after is not None:
            fail("--vocab-corpus plans with a budget: give --ratio or --target")
        return None
    scoring_group, serving_group = options.scoring(**scoring), options.serving(**serving)
    try:
        return plan_with(config, target or f"ratio={ratio}", scoring_group, serving_group, dtype, vocab_after)
    except BudgetError as exc:
        fail(refusal(exc))
    except (PipCoreError, ValueError, TypeError, KeyError) as exc:
        fail(f"cannot plan the budget: {exc}")


def _print_budget(plan) -> None:  # noqa: ANN001 - rich output only
    from rich.console import Console
    from rich.table import Table

    from pip_core.budget import format_bytes

    console = Console()
    for note in plan.notes:
        console.print(f"note: {note}")
    align = f", align {plan.effective_align}" if plan.effective_align > 1 else ""
    console.print(f"target {plan.target}: {plan.params_before:,} -> {plan.params_after:,} parameters "
                  f"({plan.achieved_ratio:.2%} removed; unit {plan.unit}{align}; one step of granularity = "
                  f"{plan.granularity:,} parameters), memory {format_bytes(plan.memory_before)} -> "
                  f"{format_bytes(plan.memory_after)} ({plan.dtype}"
                  + (f", KV cache {format_bytes(plan.kv_cache_after)}" if plan.kv_cache_after else "") + ")"
                  + ("" if plan.exact else " [per-layer widths: the figure is the target rounded to one unit]"))
    if plan.vocab:
        console.print(f"vocabulary first: {plan.vocab.describe(plan.params_before)}")
    console.print(f"decoder layers: the target takes {plan.body.describe()}")
    if plan.body.deep:
        from infra.budgeting import deep_cut_refusal

        console.print(f"[bold red]compress stops before any work here:[/] {deep_cut_refusal(plan)}")
    table = Table(title="schedule")
    for col in ("step", "cumulative ratio", "budget (params)", "parameters after", "layers", "KV heads",
                "MLP width", "memory"):
        table.add_column(col, justify="right")
    for s in plan.steps:
        table.add_row(str(s.step), f"{s.target_ratio:.4f}", f"{s.params_to_remove:,}", f"{s.num_params:,}",
                      str(s.layers), str(s.kv_heads), str(s.intermediate), format_bytes(s.memory_bytes))
    console.print(table)


def _read_config(model: str) -> dict:
    """config.json, a model directory's config, or a GGUF file's (from its header: no tensor is read)."""
    from infra.gguf_source import GgufError, is_gguf

    path = Path(model)
    if is_gguf(model):
        from infra.model_source import gguf_source

        if not path.is_file():
            fail(f"model not found: GGUF file {path} does not exist")
        try:
            gguf_source(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns)  # refuses what cannot load
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(str(path.resolve().parent), gguf_file=path.name).to_dict()
        except (GgufError, OSError) as exc:
            fail(str(exc))
    if path.is_file():
        return json.loads(path.read_text())
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model).to_dict()
    except (OSError, ValueError) as exc:
        fail(f"cannot read a model config from {model!r}: {exc}")
