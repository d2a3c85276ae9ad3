"""sign_checkpoint: the final checkpoint's model directory gets an OpenSSF model-signing signature in S3."""

from __future__ import annotations

import logging

from prefect import task

from infra.hashing import sha256_bytes
from infra.settings import Settings
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.models import ensure_local
from tasks.refs import ModelRef, SignatureRef

log = logging.getLogger(__name__)


@task(name="sign-checkpoint", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def sign_checkpoint(model: ModelRef) -> SignatureRef:
    """Sign the model directory of `model`'s S3 checkpoint with the install's key; store `model.sig` beside it.

    A rerun finds the signature it made before and keeps it (ECDSA signatures differ each time, and
    a version already registered names the first one). Before upload, the signed per-file sha256
    digests must equal the checkpoint manifest's: the signature vouches for exactly the S3 copy.
    """
    from infra.s3store import CheckpointStore
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

    if not model.s3_uri:
        raise SigningError(f"model {model.fingerprint[:12]} has no S3 checkpoint to sign")
    settings = Settings()
    key = resolve_signing_key(settings)
    public = public_key_pem(key)
    store = CheckpointStore.for_uri(settings, model.s3_uri)
    uri, local = signature_uri(model.s3_uri), ensure_local(model, settings)
    body = store.get_bytes(uri)
    if body is not None and not verify_directory(local, body, public):
        log.info("checkpoint %s already signed by key %s", model.s3_uri, fingerprint(public)[:16])
    else:
        body = sign_directory(local, key)
        in_s3 = store.files_under(model.s3_uri)
        if signed_digests(body) != in_s3:
            raise SigningError(f"the local copy of {model.s3_uri} differs from its S3 manifest; not signing it")
        store.put_bytes(uri, body)
        log.info("signed %s (%d files) with key %s -> %s", model.s3_uri, len(in_s3), fingerprint(public)[:16], uri)
    return SignatureRef(uri=uri, sha256=sha256_bytes(body), key_fingerprint=fingerprint(public))
