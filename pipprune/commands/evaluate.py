"""`pipprune eval`: lm-eval on a model directory, and divergence to a dense reference; JSON on stdout."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from pipprune.commands.common import (
    FAILED,
    fail,
    json_output,
)


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
        heldout = eval_provenance.heldout_figures("--heldout file (sha256 of its bytes)", div["heldout_sha256"],
                                                  div["documents"], div["tokens"], div["max_length"]) if div else None
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
