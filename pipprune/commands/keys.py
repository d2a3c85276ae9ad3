"""`pipprune keys`: the key that signs registered models (OpenSSF model-signing, key mode)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("export-public")
def export_public() -> None:
    """Print the public key (PEM) that verifies this install's model signatures; the fingerprint goes to stderr.

    Hand it to whoever verifies models: `pipprune lineage --public-key` or `model_signing verify key`.
    """
    from infra.settings import Settings
    from infra.signing import SigningError, fingerprint, public_key_pem, signing_key_path

    settings = Settings()
    try:
        pem = public_key_pem(signing_key_path(settings))
    except SigningError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    typer.echo(pem.decode(), nl=False)
    typer.echo(f"fingerprint sha256:{fingerprint(pem)} ({signing_key_path(settings)})", err=True)
