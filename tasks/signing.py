"""Signing what a run stored in S3: `sign_checkpoint` (the final checkpoint's model directory) and `sign_stored`, the
one procedure both it and the GGUF export's signing use."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import task

from infra.hashing import sha256_bytes
from infra.settings import Settings
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.models import ensure_local
from tasks.refs import ModelRef, SignatureRef

if TYPE_CHECKING:
    from infra.s3store import CheckpointStore

log = logging.getLogger(__name__)


def sign_stored(store: CheckpointStore, uri: str, folder: Path, stored: dict[str, str],
                settings: Settings) -> SignatureRef:
    """OpenSSF model signature of `folder`, the local copy of what lies at `uri`, kept in S3 beside it.

    A signature already there that verifies against `folder` with the install's key is kept (ECDSA
    signatures differ each time, and a version already registered names the first one). Before upload the
    signed per-file sha256 digests must equal `stored` (file -> sha256 of the S3 copy): the signature vouches
    for exactly what is in S3.
    """
    from infra.signing import (
        SigningError,
        fingerprint,
        public_key_pem,
        resolve_signing_key,
        sign_directory,
        signature_uri,
        signed_digests,
        verify_directory,
    )

    key = resolve_signing_key(settings)
    public = public_key_pem(key)
    sig_uri = signature_uri(uri)
    body = store.get_bytes(sig_uri)
    if body is not None and not verify_directory(folder, body, public):
        log.info("%s already signed by key %s", uri, fingerprint(public)[:16])
    else:
        body = sign_directory(folder, key)
        if signed_digests(body) != stored:
            raise SigningError(f"the local copy of {uri} differs from what S3 holds; not signing it")
        store.put_bytes(sig_uri, body)
        log.info("signed %s (%d files) with key %s -> %s", uri, len(stored), fingerprint(public)[:16], sig_uri)
    return SignatureRef(uri=sig_uri, sha256=sha256_bytes(body), key_fingerprint=fingerprint(public))


@task(name="sign-checkpoint", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def sign_checkpoint(model: ModelRef) -> SignatureRef:
    """Sign the model directory of `model`'s S3 checkpoint with the install's key; `model.sig` beside it."""
    from infra.s3store import CheckpointStore
    from infra.signing import SigningError

    if not model.s3_uri:
        raise SigningError(f"model {model.fingerprint[:12]} has no S3 checkpoint to sign")
    settings = Settings()
    store = CheckpointStore.for_uri(settings, model.s3_uri)
    return sign_stored(store, model.s3_uri, ensure_local(model, settings), store.files_under(model.s3_uri), settings)
