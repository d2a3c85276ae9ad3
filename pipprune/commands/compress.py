"""`pipprune compress`: the options, the job config they make, and the compress flow run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from pipprune.commands import options
from pipprune.commands.common import (
    FAILED,
    CliError,
    check_inputs,
    check_out,
    config_help,
    fail,
    home,
    json_output,
    runtime,
    validation_message,
)


def compress(
    model: Optional[str] = typer.Option(None, help="a GGUF file, a Hugging Face hub id or a local model directory "
                                        "(required unless --config names `model:`)"),
    ratio: Optional[float] = options.ratio(),
    target: Optional[str] = options.target(),
    unit: Optional[str] = options.unit(),
    width_mode: Optional[str] = options.width_mode(),
    align: Optional[int] = options.align(),
    width_split: Optional[str] = typer.Option(None, help=config_help("scoring.width_split")),
    serve_context: Optional[int] = options.serve_context(),
    serve_batch: Optional[int] = options.serve_batch(),
    method: Optional[str] = typer.Option(None, help=config_help("scoring.method")),
    iterations: Optional[int] = options.iterations(),
    calibration: Optional[str] = typer.Option(None, help=config_help(
        "calibration.source", "(default: the model dir itself when it is a reference build, else self: texts the "
        "model samples, with wanda_sp and KD recovery unless told otherwise)")),
    wordlist: Optional[str] = typer.Option(None, help=config_help("calibration.wordlist")),
    n_samples: Optional[int] = typer.Option(None, help=config_help("calibration.n_samples")),
    seed: Optional[int] = typer.Option(None, help=config_help("seed")),
    tasks: Optional[str] = typer.Option(None, help=config_help("evaluation.tasks")),
    include_path: Optional[str] = typer.Option(None, help=config_help("evaluation.include_path")),
    eval_limit: Optional[int] = typer.Option(None, help=config_help("evaluation.limit")),
    name: Optional[str] = typer.Option(None, help=config_help("registered_model_name")),
    recovery_steps: Optional[int] = typer.Option(None, help=config_help("recovery.steps")),
    recovery: Optional[str] = typer.Option(None, help=config_help("recovery.kind", "(with --recovery-steps N)")),
    repair: Optional[str] = typer.Option(None, help=config_help("repair.form")),
    vocab_corpus: Optional[str] = typer.Option(None, help=config_help("vocab.corpus")),
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
    min_distinct_ratio: Optional[float] = typer.Option(None, help=config_help("evaluation.min_distinct_ratio")),
    allow_deep_cut: Optional[bool] = typer.Option(None, "--allow-deep-cut", help=config_help("allow_deep_cut")),
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
    log_file = None if (json_out or verbose or debug) else log_path_for(home(), "compress")
    with json_output(json_out) as doc, console_output(log_file) as console:
        if model is None and config is None:
            fail("--model is required: a GGUF file, a Hugging Face hub id or a local model directory (or --config "
                 "with `model:`)")
        cfg = _compress_config(model, config, calibration, include_path, tasks, dict(
            ratio=ratio, target=target, unit=unit, width_mode=width_mode, align=align, width_split=width_split,
            serve_context=serve_context,
            serve_batch=serve_batch, method=method, iterations=iterations,
            wordlist=wordlist, n_samples=n_samples, seed=seed, eval_limit=eval_limit, registered_model_name=name,
            device=device, dtype=dtype, max_kl=max_kl, max_ppl_ratio=max_ppl_ratio,
            min_distinct_ratio=min_distinct_ratio, allow_deep_cut=allow_deep_cut,
            recovery=_recovery_options(recovery_steps, recovery), repair=repair, vocab_corpus=vocab_corpus))
        out_dir = check_out(out, overwrite)
        budget = check_inputs(cfg)
        progress.stage(f"budget: {budget.describe()}")
        settings = runtime(auto_stack)
        summary = _run_compress(cfg, out_dir, overwrite)
        if console.log_path is not None:  # the summary as JSON beside the log, for scripts that read a plain run
            console.log_path.with_suffix(".summary.json").write_text(summary.model_dump_json(indent=1))
        if json_out:
            doc.emit({"ok": True, **summary.model_dump(mode="json")})
        else:
            from pipprune.commands.summary import print_summary

            print_summary(summary, settings, console.out, Settings().home)


def _recovery_options(steps: int | None, kind: str | None) -> dict | None:
    """--recovery-steps / --recovery as a partial `recovery` group (merged over a config file's)."""
    options = {k: v for k, v in (("steps", steps), ("kind", kind)) if v is not None}
    return options or None


def _compress_config(model: str | None, config: Path | None, calibration: str | None, include_path: str | None,
                     tasks: str | None, options: dict):  # infra.config.CompressConfig, lazily
    """The validated job config from the options and the config file; every problem is bad input (exit 2).

    The options given are passed as they are: what the job gets where they are silent is the job config's own rule
    (`infra.config.job_defaults`), the same for a config file.
    """
    from pydantic import ValidationError

    from infra.config import CompressConfig, load_config_file

    fields = dict(model=model, calibration=calibration, eval_tasks=tasks,
                  eval_include_path=str(Path(include_path).resolve()) if include_path else None, **options)
    try:
        if config is not None:
            return load_config_file(config, **fields)
        return CompressConfig(**{k: v for k, v in fields.items() if v is not None})
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        fail(("config: " if config is None else f"{config}: ") + validation_message(exc)
             if isinstance(exc, ValidationError) else validation_message(exc))


def _run_compress(cfg, out_dir: str | None, overwrite: bool):  # noqa: ANN001
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
        from infra.settings import Settings
        from infra.stack import s3_failure_hint

        fail(f"compress failed: {type(exc).__name__}: {exc}{s3_failure_hint(exc, Settings())}", code=FAILED)
