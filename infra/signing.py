"""OpenSSF model signing (PyPI `model-signing`, key mode): sign a model directory, verify it with the public key.

Why: the sha256 manifests that lineage re-checks are written beside the files they hash, so anyone
who can write to the bucket can replace a model and its manifest together. A signature made with a
key the bucket's writers do not hold closes that gap, and the OpenSSF format (a Sigstore bundle over
the sha256 of every file) is checked by the stock `model_signing verify key` CLI as well.

Keys are elliptic-curve keys (P-256/384/521) in PEM; a key's fingerprint is the sha256 of its
SubjectPublicKeyInfo PEM, the same value model-signing writes into each signature as the key hint.
Key mode works offline; Sigstore keyless signing (README) needs network access.
"""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import BaseModel, Field, computed_field

from infra.hashing import sha256_bytes, sha256_dir
from infra.settings import Settings
from infra.tags import S3_URI, SIGNATURE_SHA256, SIGNATURE_URI, SIGNING_KEY_FINGERPRINT

#: the install's own key, created by `stack up` when PIPPRUNE_SIGNING_KEY names none
INSTALL_KEY = Path("keys") / "signing-key.pem"
_CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model-signing accepts


class SigningError(ValueError):
    """No usable key, or a signature that cannot be made; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------- keys
def install_key_path(settings: Settings) -> Path:
    return settings.home / INSTALL_KEY


def signing_key_path(settings: Settings) -> Path:
    """PIPPRUNE_SIGNING_KEY when set, else the install's key (which may not exist yet)."""
    return settings.signing_key or install_key_path(settings)


def load_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """The EC private key in `path`; errors name the file and what to do."""
    if not path.is_file():
        raise SigningError(f"signing key {path} not found: set PIPPRUNE_SIGNING_KEY to a PEM EC private key "
                           "(e.g. `openssl ecparam -name prime256v1 -genkey -noout -out key.pem`) or run "
                           "`pipprune stack up` to create the install's key")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"signing key {path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in _CURVES:
        raise SigningError(f"signing key {path} must be an elliptic-curve key on one of {', '.join(_CURVES)} "
                           "(model-signing's key mode)")
    return key


def resolve_signing_key(settings: Settings) -> Path:
    """The path of the private key this install signs with, checked loadable."""
    path = signing_key_path(settings)
    load_private_key(path)
    return path


def ensure_signing_key(settings: Settings) -> Path:
    """The key to sign with: PIPPRUNE_SIGNING_KEY as given (checked by preflight, not here), else the
    install's own, created (P-256, mode 0600) the first time. An existing file is never replaced.
    """
    path = signing_key_path(settings)
    if settings.signing_key is not None:
        return path
    if path.exists():
        load_private_key(path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:  # O_EXCL: two `stack up` racing cannot both write, and the file is 0600 from its first byte
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        load_private_key(path)
        return path
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    return path


def public_key_pem(private_key_path: Path) -> bytes:
    """The SubjectPublicKeyInfo PEM of the key in `private_key_path` (what `keys export-public` prints)."""
    return _spki(load_private_key(private_key_path).public_key())


def load_public_key(path: Path) -> bytes:
    """The public key PEM in `path`, normalised; errors name the file."""
    if not path.is_file():
        raise SigningError(f"public key {path} not found")
    data = path.read_bytes()
    if b"PRIVATE KEY" in data:
        raise SigningError(f"{path} holds a private key: pass the public key (`pipprune keys export-public`)")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise SigningError(f"public key {path} is not a PEM public key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in _CURVES:
        raise SigningError(f"public key {path} must be an elliptic-curve key on one of {', '.join(_CURVES)}")
    return _spki(key)


def fingerprint(public_pem: bytes) -> str:
    """sha256 of the SubjectPublicKeyInfo PEM: the key hint model-signing writes into its signatures."""
    return sha256_bytes(_spki(serialization.load_pem_public_key(public_pem)))


def _spki(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


# ------------------------------------------------------------------------------------- sign / verify
def sign_directory(model_dir: Path, private_key: Path) -> bytes:
    """The model-signing signature (a Sigstore bundle, JSON) of every file under `model_dir`."""
    from model_signing import signing

    load_private_key(private_key)
    with tempfile.TemporaryDirectory(prefix="pipprune-sign-") as tmp:
        out = Path(tmp) / "model.sig"
        signing.Config().use_elliptic_key_signer(private_key=private_key).sign(Path(model_dir), out)
        return out.read_bytes()


def signed_digests(signature: bytes) -> dict[str, str]:
    """file -> sha256 as listed in a signature's payload. NOT authenticated: call after verifying."""
    try:
        bundle = json.loads(signature)
        statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
        return {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise SigningError(f"not a model-signing signature: {exc}") from exc


def verify_directory(model_dir: Path, signature: bytes, public_pem: bytes) -> list[str]:
    """Problems found verifying `model_dir` against `signature` with `public_pem` (empty = verified).

    Verification is model-signing's own; when it fails on file contents, the files are named
    (changed, missing, or present but not signed) from the now-authenticated payload.
    """
    from model_signing import verifying

    with tempfile.TemporaryDirectory(prefix="pipprune-verify-") as tmp:
        sig_path, key_path = Path(tmp) / "model.sig", Path(tmp) / "public.pem"
        sig_path.write_bytes(signature)
        key_path.write_bytes(public_pem)
        try:
            verifying.Config().use_elliptic_key_verifier(public_key=key_path).verify(Path(model_dir), sig_path)
        except Exception as exc:  # noqa: BLE001 - any verifier failure (bad key, bad bundle, bad bytes) is "not verified"
            message = str(exc) or type(exc).__name__
            if not message.startswith("Signature mismatch"):  # the envelope itself did not verify with this key
                return [f"signature does not verify with public key {fingerprint(public_pem)[:16]}: {message[:300]}"]
            return _file_differences(Path(model_dir), signed_digests(signature)) or [message[:300]]
    return []


def _file_differences(model_dir: Path, signed: dict[str, str]) -> list[str]:
    actual = sha256_dir(model_dir)
    out = [f"{name}: changed since signing (sha256 {actual[name][:12]}, signed {digest[:12]})"
           for name, digest in sorted(signed.items()) if name in actual and actual[name] != digest]
    out += [f"{name}: signed but missing" for name in sorted(set(signed) - set(actual))]
    out += [f"{name}: present but not signed" for name in sorted(set(actual) - set(signed))]
    return out


# --------------------------------------------------------------------------- signatures of versions
def signature_uri(model_uri: str) -> str:
    """Where a checkpoint's signature lives: beside the model directory (iter-<i>/model.sig)."""
    return model_uri.rstrip("/") + ".sig"


class SignatureStore(Protocol):
    """What checking a version's signature needs from S3 (infra.s3store.CheckpointStore provides it)."""

    def get_bytes(self, uri: str) -> bytes | None: ...

    def download_prefix(self, uri: str, local_dir: Path) -> list[str]: ...


class SignatureCheck(BaseModel):
    """Outcome of checking one registered version's signature (part of `lineage --json`)."""

    signed: bool
    uri: str = ""
    sha256: str = ""
    key_fingerprint: str = Field("", description="the signing key registered with the version")
    verified_with: str = Field("", description="fingerprint of the public key the check used")
    files_verified: int = 0
    problems: list[str] = Field(default_factory=list)

    @computed_field
    @property
    def verified(self) -> bool:
        return self.signed and not self.problems


def check_version_signature(tags: dict[str, str], store: SignatureStore | None, public_pem: bytes | None,
                            scratch: Path | None = None) -> SignatureCheck:
    """Verify the signature a version's tags name against the model bytes now in S3, with `public_pem`.

    Checks: the signature object exists and has the registered sha256; the public key is the
    registered one; model-signing verifies the S3 copy of the model (downloaded as-is into
    `scratch`, not through the manifest, since the manifest is what a bucket writer could forge).
    """
    uri, model_uri = tags.get(SIGNATURE_URI, ""), tags.get(S3_URI, "")
    check = SignatureCheck(signed=bool(uri), uri=uri, sha256=tags.get(SIGNATURE_SHA256, ""),
                           key_fingerprint=tags.get(SIGNING_KEY_FINGERPRINT, ""))
    if not uri:
        check.problems.append(f"not signed: the version has no {SIGNATURE_URI} tag")
        return check
    if store is None or not model_uri:
        check.problems.append("signature: the version names no S3 model to verify")
        return check
    body = store.get_bytes(uri)
    if body is None:
        check.problems.append(f"signature {uri} is missing from S3")
        return check
    if sha256_bytes(body) != check.sha256:
        check.problems.append(f"signature {uri}: sha256 {sha256_bytes(body)[:12]} != registered {check.sha256[:12]}")
    if public_pem is None:
        check.problems.append("signature: no public key to verify with (pass --public-key PEM or set "
                              "PIPPRUNE_SIGNING_KEY)")
        return check
    check.verified_with = fingerprint(public_pem)
    if check.verified_with != check.key_fingerprint:
        check.problems.append(f"signature: registered signing key {check.key_fingerprint[:16]} is not the "
                              f"public key given ({check.verified_with[:16]})")
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pipprune-verify-model-", dir=scratch) as tmp:
        names = store.download_prefix(model_uri, Path(tmp) / "model")
        problems = verify_directory(Path(tmp) / "model", body, public_pem)
    check.problems.extend(f"signature: {model_uri}{p}" if _NAMES_FILE.match(p) else f"signature {uri}: {p}"
                          for p in problems)
    check.files_verified = 0 if problems else len(names)
    return check


_NAMES_FILE = re.compile(r"^[^:\s][^:]*: (changed since signing|signed but missing|present but not signed)")
