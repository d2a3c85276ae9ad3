"""`pipprune reference build`: the offline reference model, tasks and calibration data."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True)


@app.command()
def build(
    size: str = typer.Option("tiny", help="tiny (about a minute, for tests) | small (benchmark subject)"),
    out: Path = typer.Option(..., help="output directory"),
    cache_dir: Optional[Path] = typer.Option(None, help="corpus/tokenizer cache (default: PIPPRUNE_HOME/cache)"),
    seed: int = typer.Option(0),
    force: bool = typer.Option(False, help="rebuild even if OUT already holds a finished build"),
) -> None:
    """Build a real Llama (GQA) trained offline on public-domain text, with lm-eval tasks."""
    import json
    import logging

    from infra.settings import Settings

    if size not in ("tiny", "small"):
        typer.secho(f"error: unknown size {size!r}; use tiny or small", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    manifest_path = out / "manifest.json"
    if manifest_path.is_file() and not force:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("name") == f"pipprune-reference-{size}" and manifest.get("seed") == seed:
            typer.echo(f"reference {size} already built in {out} (use --force to rebuild)")
            return
    import sys

    from infra import progress

    mode = progress.choose_mode(False, sys.stderr.isatty())  # a bar on a terminal, one line per 5% in a log
    progress.configure(mode)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from infra.reference.build import OutputInUse, build_reference
    from infra.reference.sources import MissingDataPackage

    try:
        manifest = build_reference(size, out, cache_dir or Settings().home / "cache", seed=seed,
                                   progress=mode == "bar")
    except (MissingDataPackage, OutputInUse) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"built {manifest['name']} in {out}: {manifest['num_parameters']:,} parameters, "
               f"train loss {manifest['training']['final_train_loss']:.3f}, "
               f"held-out perplexity {manifest['heldout_perplexity']:.1f} (uniform: {manifest['uniform_perplexity']:.0f})")
