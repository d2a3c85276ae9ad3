"""The `pipprune` command line. Heavy imports (torch, prefect, mlflow) happen inside commands.

Exit codes: 0 success, 1 a failed run or check, 2 bad input (named in the message).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from pipprune.commands import keys as keys_cmd
from pipprune.commands import promote as promote_cmd
from pipprune.commands import reference as reference_cmd
from pipprune.commands import stack as stack_cmd

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Auditable PIP pruning of causal LMs: compress, evaluate, trace, promote.")
app.add_typer(stack_cmd.app, name="stack", help="Local S3 / MLflow / Prefect stack on 127.0.0.1.")
app.add_typer(reference_cmd.app, name="reference", help="Build the offline reference model and tasks.")
app.add_typer(keys_cmd.app, name="keys", help="The key that signs registered models (OpenSSF model-signing).")
app.command("lineage")(promote_cmd.lineage)
app.command("promote")(promote_cmd.promote)


def fail(message: str, code: int = 2) -> None:
    """Print a one-line error to stderr and exit (2 = bad input, 1 = failed run)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def compress(
    model: str = typer.Option(..., help="Hugging Face hub id or local model directory"),
    ratio: Optional[float] = typer.Option(None, help="fraction of parameters to remove, in (0, 0.9] [default: 0.2]"),
    unit: Optional[str] = typer.Option(None, help="block | attn | mlp | width [default: block]"),
    width_mode: Optional[str] = typer.Option(None, help="uniform | per-layer: uniform keeps every layer equally "
                                             "wide (stock config, loads anywhere) [default: uniform]"),
    method: Optional[str] = typer.Option(None, help="pip | random | magnitude | taylor | block-influence [default: pip]"),
    iterations: Optional[int] = typer.Option(None, help="prune/re-score steps to reach the ratio [default: 4]"),
    calibration: Optional[str] = typer.Option(None, help="calibration JSONL/TXT or reference model dir "
                                              "(default: the model dir itself when it is a reference build)"),
    wordlist: Optional[str] = typer.Option(None, help="word list for the perturber (default: beside calibration)"),
    n_samples: Optional[int] = typer.Option(None, help="calibration pairs [default: 32]"),
    seed: Optional[int] = typer.Option(None, help="[default: 0]"),
    tasks: Optional[str] = typer.Option(None, help="lm-eval tasks for the final evaluation, comma separated"),
    include_path: Optional[str] = typer.Option(None, help="directory of local lm-eval task YAMLs"),
    eval_limit: Optional[int] = typer.Option(None, help="limit examples per lm-eval task"),
    name: Optional[str] = typer.Option(None, help="registered model name"),
    recovery_steps: Optional[int] = typer.Option(None, help="LoRA recovery steps after pruning, merged back "
                                                 "(0 = off) [default: 0]"),
    config: Optional[Path] = typer.Option(None, help="YAML/JSON config file (CLI options override it)"),
    out: Optional[Path] = typer.Option(None, help="also copy the final model here"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Prune a model with PIP (or a baseline) end to end: track, checkpoint, evaluate, register."""
    from pydantic import ValidationError

    from infra.config import CompressConfig, load_config_file

    default_calibration = calibration
    if default_calibration is None and not config:
        candidate = Path(model) / "calibration" / "calibration.jsonl"
        if not candidate.is_file():
            fail("--calibration is required (a JSONL/TXT file of texts, or a reference model directory)")
        default_calibration = model
    if include_path is None and tasks is None and (Path(model) / "tasks").is_dir():
        include_path = str(Path(model) / "tasks")
        tasks = ",".join(sorted(p.stem for p in Path(include_path).glob("*.yaml")))
    fields = dict(model=model, ratio=ratio, unit=unit, width_mode=width_mode, method=method, iterations=iterations,
                  calibration=default_calibration, wordlist=wordlist, n_samples=n_samples, seed=seed,
                  eval_tasks=tasks, eval_include_path=str(Path(include_path).resolve()) if include_path else None,
                  eval_limit=eval_limit, registered_model_name=name,
                  recovery=None if recovery_steps is None else {"steps": recovery_steps})
    try:
        if config is not None:
            cfg = load_config_file(config, **fields)
        else:
            cfg = CompressConfig(**{k: v for k, v in fields.items() if v is not None})
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        fail(_validation_message(exc))
    from infra.preflight import PreflightError, check_inputs, check_services

    try:  # fail fast on inputs, before any server is started or contacted
        check_inputs(cfg)
    except (PreflightError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    from infra.runtime import prepare_runtime

    from infra.stack import StackError

    try:
        settings = prepare_runtime()
        check_services(settings)
    except ValidationError as exc:
        fail("settings: " + _validation_message(exc))
    except (PreflightError, StackError) as exc:
        fail(str(exc), code=1)
    from flows.compress import compress_flow

    from infra.runtime import prefect_settings

    try:
        with prefect_settings():
            summary = compress_flow(cfg, out_dir=str(out.resolve()) if out else None)
    except ValueError as exc:
        fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - report, exit non-zero
        fail(f"compress failed: {type(exc).__name__}: {exc}", code=1)
    if json_out:
        print(summary.model_dump_json(indent=1))
    else:
        _print_summary(summary, settings)


def _validation_message(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
    return str(exc)


def _print_summary(summary, settings) -> None:  # noqa: ANN001 - rich output only
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pipprune compress: run {summary.run_key}")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_row("parameters", f"{summary.params_before:,}", f"{summary.params_after:,}")
    table.add_row("removed", "", f"{summary.achieved_ratio:.2%}")
    for key in sorted(set(summary.metrics_before) | set(summary.metrics_after)):
        b, a = summary.metrics_before.get(key), summary.metrics_after.get(key)
        table.add_row(key, "" if b is None else f"{b:.4g}", "" if a is None else f"{a:.4g}")
    console = Console()
    console.print(table)
    console.print(f"MLflow run: {summary.mlflow_run_id}  ({settings.mlflow_tracking_uri})")
    console.print(f"Registered: {summary.registered_model} version {summary.model_version}")
    console.print(f"S3 checkpoint: {summary.s3_uri}")
    if summary.metrics_before_recovery:
        ppl = summary.metrics_before_recovery.get("heldout_perplexity")
        if ppl is not None:
            console.print(f"LoRA recovery: held-out perplexity {ppl:.4g} before recovery, "
                          f"{summary.metrics_after.get('heldout_perplexity', float('nan')):.4g} after")
    if summary.iterations_resumed:
        console.print(f"Resumed after {summary.iterations_resumed} completed iteration(s) found in S3")
    if summary.out_dir:
        console.print(f"Model copied to: {summary.out_dir}")


@app.command("eval")
def eval_cmd(
    model: str = typer.Option(..., help="model directory"),
    tasks: str = typer.Option(..., help="comma-separated lm-eval task names"),
    include_path: Optional[Path] = typer.Option(None, help="directory of local lm-eval task YAMLs"),
    limit: Optional[int] = typer.Option(None, help="limit examples per task"),
) -> None:
    """Evaluate a model directory with lm-eval; prints JSON {task: {metric: value}} on stdout."""
    from infra.runtime import prepare_runtime

    prepare_runtime(start_stack=False)
    from infra.lmeval import run_lmeval

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        fail("--tasks is empty")
    if not Path(model).is_dir():
        fail(f"model directory not found: {model}")
    try:
        results = run_lmeval(Path(model), names, include_path=include_path, limit=limit)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        fail(f"evaluation failed: {exc}")
    json.dump(results, sys.stdout, indent=1)
    sys.stdout.write("\n")


@app.command("plan")
def plan_cmd(
    model: str = typer.Option(..., help="hub id, local model dir, or a config.json file"),
    unit: str = typer.Option("block", help="block | attn | mlp | width (scoring memory is the same)"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    seq_len: int = typer.Option(128, help="calibration sequence length"),
    gradient_checkpointing: bool = typer.Option(False, help="recompute activations in backward"),
    device: str = typer.Option("cpu", help="device whose free memory to compare with"),
) -> None:
    """Memory each stage needs, from the config alone (no weights are loaded)."""
    from rich.console import Console
    from rich.table import Table

    from pip_core.memory_plan import available_bytes, plan_memory

    config = _read_config(model)
    try:
        plan = plan_memory(config, dtype=dtype, batch=2, seq_len=seq_len,
                           gradient_checkpointing=gradient_checkpointing)
    except (ValueError, TypeError, KeyError) as exc:
        fail(f"cannot plan memory for {model}: {exc}")
    free = available_bytes(device)
    table = Table(title=f"{model}: {plan.num_params:,} parameters, {dtype}, unit {unit}, seq {seq_len}")
    table.add_column("stage")
    table.add_column("GiB", justify="right")
    for label, value in [("weights", plan.weights), ("largest live gradient", plan.gradients_peak),
                         ("activations (2 views)", plan.activations), ("logits", plan.logits),
                         ("peak: PIP scoring", plan.peak_scoring), ("peak: evaluation", plan.peak_eval),
                         (f"free on {device}", free)]:
        table.add_row(label, f"{value / 2**30:.2f}")
    Console().print(table)
    if plan.peak_scoring > free:
        typer.secho("does not fit: PIP scoring needs more memory than is free", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


def _read_config(model: str) -> dict:
    path = Path(model)
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
    out: Optional[Path] = typer.Option(None, help="copy each run's final model here"),
) -> None:
    """Run compress on a cron schedule: served by this process, or by a team's work pool workers."""
    from pydantic import ValidationError

    from infra.config import load_config_file

    try:
        from prefect.client.schemas.schedules import CronSchedule

        CronSchedule(cron=cron)
        cfg = load_config_file(config)
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        fail(_validation_message(exc))
    from infra.runtime import prepare_runtime

    prepare_runtime()
    from flows.schedule import deploy_to_pool, serve_locally

    from infra.runtime import prefect_settings

    out_dir = str(out.resolve()) if out else None
    with prefect_settings():
        if work_pool:
            deployment_id = deploy_to_pool(cfg, cron, name, work_pool, out_dir)
            typer.echo(f"deployment compress/{name} ({deployment_id}) on pool {work_pool!r}, cron {cron!r}")
        else:
            typer.echo(f"serving compress/{name} on cron {cron!r} (Ctrl-C to stop)")
            serve_locally(cfg, cron, name, out_dir)


if __name__ == "__main__":  # pragma: no cover
    app()
