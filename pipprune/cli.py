"""The `pipprune` command line. Heavy imports (torch, prefect, mlflow) happen inside commands.

Exit codes: 0 success; 1 a verification or gate failed, or a run failed; 2 bad input (named in the
message, with the fix); 3 a service unreachable; 130 interrupted. `--debug` shows tracebacks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from pipprune.commands import export as export_cmd
from pipprune.commands import keys as keys_cmd
from pipprune.commands import promote as promote_cmd
from pipprune.commands import reference as reference_cmd
from pipprune.commands import stack as stack_cmd
from pipprune.commands import sweep as sweep_cmd
from pipprune.commands.common import (
    BAD_INPUT,
    FAILED,
    INTERRUPTED,
    UNREACHABLE,
    CliError,
    config_help,
    fail,
    json_output,
    print_error,
    validation_message,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Auditable PIP pruning of causal LMs: compress, evaluate, trace, promote.")
app.add_typer(stack_cmd.app, name="stack", help="Local S3 / MLflow / Prefect stack on 127.0.0.1.")
app.add_typer(reference_cmd.app, name="reference", help="Build the offline reference model and tasks.")
app.add_typer(keys_cmd.app, name="keys", help="The key that signs registered models (OpenSSF model-signing).")
app.command("lineage")(promote_cmd.lineage)
app.command("promote")(promote_cmd.promote)
app.command("export")(export_cmd.export)
app.command("sweep")(sweep_cmd.sweep)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="show Python tracebacks (accepted anywhere on the "
                                     "command line)")) -> None:
    """Options for every command; `--debug` itself is read by `main`."""


@app.command()
def compress(
    model: str = typer.Option(..., help="Hugging Face hub id or local model directory"),
    ratio: Optional[float] = typer.Option(None, help=config_help("ratio")),
    target: Optional[str] = typer.Option(None, help=config_help("target")),
    unit: Optional[str] = typer.Option(None, help=config_help("scoring.unit")),
    width_mode: Optional[str] = typer.Option(None, help=config_help("scoring.width_mode")),
    align: Optional[int] = typer.Option(None, help=config_help("scoring.align")),
    serve_context: Optional[int] = typer.Option(None, help=config_help("serving.context")),
    serve_batch: Optional[int] = typer.Option(None, help=config_help("serving.batch")),
    method: Optional[str] = typer.Option(None, help=config_help("scoring.method")),
    iterations: Optional[int] = typer.Option(None, help=config_help("scoring.iterations")),
    calibration: Optional[str] = typer.Option(None, help=config_help(
        "calibration.source", "(default: the model dir itself when it is a reference build)")),
    wordlist: Optional[str] = typer.Option(None, help=config_help("calibration.wordlist")),
    n_samples: Optional[int] = typer.Option(None, help=config_help("calibration.n_samples")),
    seed: Optional[int] = typer.Option(None, help=config_help("seed")),
    tasks: Optional[str] = typer.Option(None, help=config_help("evaluation.tasks")),
    include_path: Optional[str] = typer.Option(None, help=config_help("evaluation.include_path")),
    eval_limit: Optional[int] = typer.Option(None, help=config_help("evaluation.limit")),
    name: Optional[str] = typer.Option(None, help=config_help("registered_model_name")),
    recovery_steps: Optional[int] = typer.Option(None, help=config_help("recovery.steps")),
    recovery: Optional[str] = typer.Option(None, help=config_help("recovery.kind", "(with --recovery-steps N)")),
    device: Optional[str] = typer.Option(None, help=config_help("runtime.device")),
    dtype: Optional[str] = typer.Option(None, help=config_help("runtime.dtype")),
    config: Optional[Path] = typer.Option(None, help="YAML/JSON config file (CLI options override it)"),
    out: Optional[Path] = typer.Option(None, help="also copy the final model to this new or empty directory"),
    overwrite: bool = typer.Option(False, help="let --out replace a previous pipprune output (never anything else)"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as one JSON document (logs: stderr)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bars and no per-stage lines"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="every log line on the terminal (default: one line "
                                 "per stage, the rest in a log file whose path is printed)"),
    max_kl: Optional[float] = typer.Option(None, help=config_help("evaluation.max_kl")),
    max_ppl_ratio: Optional[float] = typer.Option(None, help=config_help("evaluation.max_ppl_ratio")),
    auto_stack: Optional[bool] = typer.Option(None, "--auto-stack/--no-auto-stack",
                                              help="start the embedded stack if it is down [default: "
                                                   "PIPPRUNE_AUTO_STACK, true]"),
) -> None:
    """Prune a model with PIP (or a baseline) end to end: track, checkpoint, evaluate, register.

    --model takes a local Hugging Face directory, a GGUF file (llama.cpp / Ollama; dequantized once into the
    cache) or a hub id.
    """
    from infra import progress
    from infra.settings import Settings
    from pipprune.commands.console import console_output, log_path_for

    progress.configure(progress.choose_mode(quiet, sys.stderr.isatty() and verbose))
    debug = os.environ.get("PIPPRUNE_DEBUG") == "1"  # --debug: every line and the traceback on the terminal
    log_file = None if (json_out or verbose or debug) else log_path_for(_home(), "compress")
    with json_output(json_out) as doc, console_output(log_file) as console:
        cfg = _compress_config(model, config, calibration, include_path, tasks, dict(
            ratio=ratio, target=target, unit=unit, width_mode=width_mode, align=align, serve_context=serve_context,
            serve_batch=serve_batch, method=method, iterations=iterations,
            wordlist=wordlist, n_samples=n_samples, seed=seed, eval_limit=eval_limit, registered_model_name=name,
            device=device, dtype=dtype, max_kl=max_kl, max_ppl_ratio=max_ppl_ratio,
            recovery=_recovery_options(recovery_steps, recovery)))
        if recovery is not None and not cfg.recovery.enabled:
            fail(f"--recovery {recovery} needs recovery steps: add --recovery-steps N (or recovery.steps in the config)")
        out_dir = _check_out(out, overwrite)
        _check_inputs(cfg)
        settings = _runtime(auto_stack)
        summary = _run_compress(cfg, out_dir, overwrite)
        if json_out:
            doc.emit({"ok": True, **summary.model_dump(mode="json")})
        else:
            from pipprune.commands.summary import print_summary

            print_summary(summary, settings, console.out, Settings().home)


def _recovery_options(steps: int | None, kind: str | None) -> dict | None:
    """--recovery-steps / --recovery as a partial `recovery` group (merged over a config file's)."""
    options = {k: v for k, v in (("steps", steps), ("kind", kind)) if v is not None}
    return options or None


def _compress_config(model: str, config: Path | None, calibration: str | None, include_path: str | None,
                     tasks: str | None, options: dict):  # noqa: ANN202 - infra.config.CompressConfig, lazily
    """The validated job config from the options and the config file; every problem is bad input (exit 2)."""
    from pydantic import ValidationError

    from infra.config import CompressConfig, load_config_file
    from infra.model_source import ModelNotFoundError, local_model_dir

    if calibration is None and not config:
        try:
            local = local_model_dir(model)  # "model not found" comes before "--calibration is required"
        except ModelNotFoundError as exc:
            fail(str(exc))
        if not (local / "calibration" / "calibration.jsonl").is_file():
            fail("--calibration is required (a JSONL/TXT file of texts, or a reference model directory)")
        calibration = model
    tasks_origin = None
    if include_path is None and tasks is None:
        include_path, tasks, tasks_origin = _default_tasks(model, calibration, config)
    fields = dict(model=model, calibration=calibration, eval_tasks=tasks,
                  eval_include_path=str(Path(include_path).resolve()) if include_path else None,
                  evaluation={"tasks_origin": tasks_origin} if tasks_origin else None, **options)
    try:
        if config is not None:
            return load_config_file(config, **fields)
        return CompressConfig(**{k: v for k, v in fields.items() if v is not None})
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        fail(("config: " if config is None else f"{config}: ") + validation_message(exc)
             if isinstance(exc, ValidationError) else validation_message(exc))


def _default_tasks(model: str, calibration: str | None, config: Path | None) -> tuple[str | None, str | None, str]:
    """The local lm-eval tasks a run gets when none are named, and why (shown in the summary).

    A reference build's own tasks, else those of the reference build the calibration comes from:
    any model, a GGUF file or a hub id included, is then measured on the same held-out tasks.
    """
    if config is not None:
        return None, None, "as the config file says (no tasks there: none run)"
    candidates = ((model, "the model is a pipprune reference build"),
                  (calibration, "the calibration source is a pipprune reference build"))
    for candidate, why in candidates:
        folder = Path(candidate) / "tasks" if candidate else None
        if folder is not None and folder.is_dir() and list(folder.glob("*.yaml")):
            names = ",".join(sorted(p.stem for p in folder.glob("*.yaml")))
            return str(folder), names, f"{why}: its local tasks in {folder}"
    return None, None, ("none: no --tasks given, and neither the model nor the calibration source is a reference "
                        "build with local tasks (pass --tasks and --include-path)")


def _check_out(out: Path | None, overwrite: bool) -> str | None:
    from infra.output_dir import OutputDirError, check_output_dir

    if out is None:
        return None
    try:
        return str(check_output_dir(out, overwrite))
    except OutputDirError as exc:
        fail(str(exc))


def _check_inputs(cfg) -> None:  # noqa: ANN001
    """Model, weights, tokenizer, calibration, evaluation tasks: before any server is started or contacted."""
    from infra.preflight import PreflightError, check_inputs

    try:
        check_inputs(cfg)
    except (PreflightError, ValueError, OSError) as exc:
        fail(str(exc))


def _runtime(auto_stack: bool | None):  # noqa: ANN202 - infra.settings.Settings
    """Settings applied, the stack up (or started, or refused), S3/MLflow/Prefect answering with these keys."""
    from pydantic import ValidationError

    from infra.preflight import PreflightError, ServiceUnreachable, check_services
    from infra.runtime import StackDown, prepare_runtime
    from infra.stack import StackError

    try:
        settings = prepare_runtime(auto_stack=auto_stack)
        check_services(settings)
    except ValidationError as exc:
        fail("settings (PIPPRUNE_* environment): " + validation_message(exc))
    except (ServiceUnreachable, StackDown, StackError) as exc:
        fail(str(exc), code=UNREACHABLE)
    except PreflightError as exc:
        fail(str(exc))
    return settings


def _run_compress(cfg, out_dir: str | None, overwrite: bool):  # noqa: ANN001, ANN202
    from flows.compress import compress_flow
    from infra.output_dir import OutputDirError
    from infra.runtime import prefect_settings

    try:
        with prefect_settings():
            return compress_flow(cfg, out_dir=out_dir, overwrite=overwrite)
    except OutputDirError as exc:
        fail(str(exc))
    except (KeyboardInterrupt, CliError):
        raise
    except Exception as exc:  # noqa: BLE001 - report, exit non-zero
        fail(f"compress failed: {type(exc).__name__}: {exc}", code=FAILED)


def _home() -> Path:
    """PIPPRUNE_HOME as the settings read it (a bad value is reported later, with the other settings)."""
    from pydantic import ValidationError

    from infra.settings import Settings

    try:
        return Settings().home
    except ValidationError:
        return Path(".pipprune").resolve()


@app.command("eval")
def eval_cmd(
    model: str = typer.Option(..., help="model directory"),
    tasks: str = typer.Option("", help="comma-separated lm-eval task names"),
    include_path: Optional[Path] = typer.Option(None, help="directory of local lm-eval task YAMLs"),
    limit: Optional[int] = typer.Option(None, help="limit examples per task"),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N"),
    dtype: str = typer.Option("auto", help="auto | bfloat16 | float16 | float32 (auto: the checkpoint's own)"),
    reference: Optional[Path] = typer.Option(None, help="dense model dir: add KL / top-1 agreement / ppl ratio"),
    heldout: Optional[Path] = typer.Option(None, help="held-out text (JSONL 'text' or blank-line separated) for "
                                           "--reference; default REFERENCE/tasks/persuasion.jsonl"),
) -> None:
    """Evaluate a model directory with lm-eval; stdout: {"schema": 1, "results": {task: {metric: value}}}.

    With --reference, results["divergence"] holds KL / top-1 agreement / ppl ratio to the dense model.
    """
    from infra import progress

    progress.configure(progress.choose_mode(False, sys.stderr.isatty()))
    with json_output(True) as doc:
        from pip_core.placement import check_dtype_spec, resolve_device

        try:  # before any work: a missing GPU or a typo is bad input
            device, dtype = resolve_device(device), check_dtype_spec(dtype)
        except ValueError as exc:
            fail(str(exc))
        from infra.runtime import prepare_runtime

        prepare_runtime(start_stack=False)
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        if not names and reference is None:
            fail("--tasks is empty (give --tasks, --reference, or both)")
        model_dir = _eval_model_dir(model, "model not found")
        reference = _eval_model_dir(reference, "reference model directory not found") if reference else None
        from infra.preflight import PreflightError, check_eval_tasks, check_weights_intact

        try:
            check_weights_intact(model_dir)
            if names:
                check_eval_tasks(tuple(names), str(include_path) if include_path else None)
        except PreflightError as exc:
            fail(str(exc))
        from infra.lmeval import run_lmeval_recorded

        try:
            results, record = run_lmeval_recorded(model_dir, names, include_path=include_path, limit=limit,
                                                  device=device, dtype=dtype) if names else ({}, None)
        except (ValueError, KeyError, FileNotFoundError) as exc:
            fail(f"evaluation failed: {exc}", code=FAILED)
        if reference is not None:
            from pip_core.errors import PipCoreError
            from tasks.evaluation import reference_divergence

            try:
                results["divergence"] = reference_divergence(model_dir, reference, heldout, device=device)
            except PipCoreError as exc:
                fail(str(exc))
        from infra import eval_provenance

        div = results.get("divergence")
        heldout = {"source": "--heldout file (sha256 of its bytes)", "sha256": div["heldout_sha256"],
                   "documents": int(div["documents"]), "tokens": int(div["tokens"]),
                   "max_length": int(div["max_length"])} if div else None
        provenance = eval_provenance.build({"model": record} if record else {}, heldout)
        doc.emit({"ok": True, "model": model, "results": results,
                  "provenance": {**provenance, "sha256": eval_provenance.digest(provenance)}})


def _eval_model_dir(model: str | Path, missing: str) -> Path:
    """A model directory, or a GGUF file's dequantized directory (made once, in the cache)."""
    from infra.gguf_source import is_gguf
    from infra.model_source import ModelNotFoundError, local_model_dir

    if is_gguf(str(model)):
        try:
            return local_model_dir(str(model))
        except ModelNotFoundError as exc:
            fail(str(exc))
    if not Path(model).is_dir():
        fail(f"{missing}: {model} is not a directory or a GGUF file")
    return Path(model)


@app.command("plan")
def plan_cmd(
    model: str = typer.Option(..., help="hub id, local model dir, or a config.json file"),
    unit: str = typer.Option("block", help="block | attn | mlp | width (scoring memory is the same)"),
    target: Optional[str] = typer.Option(None, help=config_help("target")),
    ratio: Optional[float] = typer.Option(None, help="short for --target ratio=R"),
    width_mode: str = typer.Option("uniform", help=config_help("scoring.width_mode")),
    iterations: int = typer.Option(4, help=config_help("scoring.iterations")),
    align: int = typer.Option(64, help=config_help("scoring.align")),
    protect_first: int = typer.Option(1, help=config_help("scoring.protect_first")),
    protect_last: int = typer.Option(1, help=config_help("scoring.protect_last")),
    serve_context: int = typer.Option(0, help=config_help("serving.context")),
    serve_batch: int = typer.Option(1, help=config_help("serving.batch")),
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
    budget = _budget_plan(config, target, ratio, dict(
        unit=unit, width_mode=width_mode.replace("-", "_"), iterations=iterations, align=align,
        protect_first=protect_first, protect_last=protect_last, dtype=dtype), serve_context, serve_batch)
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


def _budget_plan(config: dict, target: str | None, ratio: float | None, options: dict, context: int,
                 batch: int):  # noqa: ANN202 - pip_core.budget.BudgetPlan | None
    """The budget plan, or exit 2 naming the problem (an infeasible target: with the nearest feasible one)."""
    from infra.budgeting import refusal
    from pip_core.budget import BudgetError, Serving, plan_budget
    from pip_core.errors import PipCoreError

    if target is not None and ratio is not None:
        fail("give --ratio or --target, not both")
    if target is None and ratio is None:
        return None
    try:
        return plan_budget(config, target or f"ratio={ratio}", serving=Serving(context, batch), **options)
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


@app.command()
def schedule(
    config: Path = typer.Option(..., help="YAML/JSON compress config (same keys as `compress`)"),
    cron: str = typer.Option(..., help="cron expression, e.g. '0 3 * * 1'"),
    name: str = typer.Option("scheduled-compress", help="deployment name"),
    work_pool: Optional[str] = typer.Option(None, help="deploy to this Prefect work pool instead of serving here"),
    out: Optional[Path] = typer.Option(None, help="copy each run's final model here (replacing the previous run's "
                                       "copy; a directory pipprune did not write is refused)"),
    auto_stack: Optional[bool] = typer.Option(None, "--auto-stack/--no-auto-stack",
                                              help="start the embedded stack if it is down [default: true]"),
) -> None:
    """Run compress on a cron schedule: served by this process, or by a team's work pool workers."""
    from pydantic import ValidationError

    from infra.config import load_config_file

    try:
        from prefect.client.schemas.schedules import CronSchedule

        CronSchedule(cron=cron)
        cfg = load_config_file(config)
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        fail(f"{config}: " + validation_message(exc) if isinstance(exc, ValidationError) else validation_message(exc))
    out_dir = _check_out(out, overwrite=True)
    _check_inputs(cfg)
    _runtime(auto_stack)
    from flows.schedule import deploy_to_pool, serve_locally
    from infra.runtime import prefect_settings

    with prefect_settings():
        if work_pool:
            deployment_id = deploy_to_pool(cfg, cron, name, work_pool, out_dir)
            typer.echo(f"deployment compress/{name} ({deployment_id}) on pool {work_pool!r}, cron {cron!r}")
        else:
            typer.echo(f"serving compress/{name} on cron {cron!r} (Ctrl-C to stop)")
            serve_locally(cfg, cron, name, out_dir)


def main(argv: list[str] | None = None) -> None:
    """The console script: one line and an exit code for every failure; a traceback only with --debug."""
    import click

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if debug:
        os.environ["PIPPRUNE_DEBUG"] = "1"
    try:
        code = app(args=args, prog_name="pipprune", standalone_mode=False)
    except click.ClickException as exc:  # usage errors: unknown option, missing value
        exc.show()
        code = BAD_INPUT
    except (KeyboardInterrupt, click.exceptions.Abort):
        print_error("interrupted")
        code = INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the catch-all that keeps tracebacks behind --debug
        if debug:
            raise
        print_error(f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)")
        code = FAILED
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
