"""`pipprune trim-vocab --model M --corpus public --out DIR`: the model with only the tokens a corpus needs.

Runs on the machine alone (no stack): the kept tokens are the corpus's, the tokens their merges are built from, the
special tokens and the byte alphabet; the directory written loads with the stock class and AutoTokenizer, every
corpus text encodes to the same tokens renumbered (checked before the directory is renamed into place), and
`compress --model DIR` prunes it further. `vocab_trim.json` beside it records the source and the kept ids' hash.
"""

from __future__ import annotations

from pathlib import Path

import typer

from pipprune.commands.common import fail, json_output


def trim_vocab(
    model: str = typer.Option(..., help="local model directory or GGUF file (a GGUF is dequantized into the cache)"),
    corpus: str = typer.Option(..., help="the text the model must still encode as before: a .txt file (one text "
                               "per paragraph), a .jsonl file ('text' per line) or 'public' (the English text the "
                               "install fetches: five Austen novels, the King James Bible, the Python docs' prose, "
                               "fortunes; Persuasion and WordNet, held out for evaluation, left out)"),
    out: Path = typer.Option(..., help="the directory to write (must not exist)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document (logs: stderr)"),
) -> None:
    """Trim a model's vocabulary to a corpus: embedding and LM-head rows of the tokens it never uses go."""
    from infra.gguf_source import GgufError
    from infra.model_source import local_model_dir
    from infra.settings import Settings
    from infra.vocab_source import VocabSourceError, trim_to_dir
    from pip_core.errors import PipCoreError

    with json_output(json_out) as doc:
        out = out.expanduser().resolve()
        if out.exists():
            fail(f"{out} exists; name a new directory (pipprune never overwrites one)")
        try:
            source = Path(local_model_dir(model))
            record = trim_to_dir(source, corpus, out, Settings().home / "cache")
        except (VocabSourceError, PipCoreError, GgufError, ValueError, OSError) as exc:
            fail(str(exc))
        if json_out:
            doc.emit({"ok": True, "out": str(out), **record.__dict__, "removed_ratio": record.removed_ratio})
            return
        typer.echo(f"{out}: {record.vocab_after:,} of {record.vocab_before:,} tokens kept "
                   f"({record.corpus_texts:,} texts of {record.corpus}); parameters {record.params_before:,} -> "
                   f"{record.params_after:,} ({record.removed_ratio:.1%} removed); kept ids sha256 "
                   f"{record.kept_sha256[:16]}; every corpus text encodes as before")
