"""OpenSSF model signatures: keys, sign/verify, and lineage + promotion against the real stack."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import NO_SERVING, cli, s3_of

BUCKET = "signing-tests"
NAME = "tiny-signed"


def _new_key(path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.write_bytes(pem)
    return path


def _model_dir(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 4)
    return root


# ------------------------------------------------------------------------------ offline, no stack
def test_install_key_is_created_once_0600_and_never_replaced(tmp_path):
    from infra.settings import Settings
    from infra.signing import SigningError, ensure_signing_key, install_key_path, public_key_pem

    settings = Settings(home=tmp_path / "home", signing_key=None)
    path = ensure_signing_key(settings)
    assert path == install_key_path(settings) and path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_bytes()
    assert ensure_signing_key(settings) == path and path.read_bytes() == first
    assert b"BEGIN PUBLIC KEY" in public_key_pem(path)

    path.write_text("not a key")  # a broken file is named, never overwritten
    with pytest.raises(SigningError, match=str(path)):
        ensure_signing_key(settings)
    assert path.read_text() == "not a key"

    configured = Settings(home=tmp_path / "other", signing_key=str(tmp_path / "team.pem"))
    assert ensure_signing_key(configured) == tmp_path / "team.pem"  # a configured key is not created
    assert not (tmp_path / "team.pem").exists() and not install_key_path(configured).exists()


def test_sign_and_verify_name_the_changed_file_and_refuse_another_key(tmp_path):
    from infra.signing import fingerprint, public_key_pem, sign_directory, signed_digests, verify_directory

    model, key, other = _model_dir(tmp_path / "m"), _new_key(tmp_path / "k.pem"), _new_key(tmp_path / "o.pem")
    signature = sign_directory(model, key)
    public = public_key_pem(key)
    assert json.loads(signature)["verificationMaterial"]["publicKey"]["hint"] == fingerprint(public)
    assert set(signed_digests(signature)) == {"config.json", "sub/weights.bin"}
    assert verify_directory(model, signature, public) == []

    [refused] = verify_directory(model, signature, public_key_pem(other))
    assert "does not verify with public key" in refused

    data = bytearray((model / "sub" / "weights.bin").read_bytes())
    data[100] ^= 1
    (model / "sub" / "weights.bin").write_bytes(bytes(data))
    (model / "extra.txt").write_text("x")
    problems = verify_directory(model, signature, public)
    assert problems == [problems[0], "extra.txt: present but not signed"]
    assert problems[0].startswith("sub/weights.bin: changed since signing")


def test_export_public_prints_the_key_or_names_the_missing_one(tmp_path):
    env = {**os.environ, "PIPPRUNE_HOME": str(tmp_path / "home"), "PIPPRUNE_SIGNING_KEY": str(tmp_path / "no.pem")}
    missing = cli(env, "keys", "export-public", timeout=120)
    assert missing.returncode == 2 and str(tmp_path / "no.pem") in missing.stderr
    _new_key(tmp_path / "team.pem")
    done = cli({**env, "PIPPRUNE_SIGNING_KEY": str(tmp_path / "team.pem")}, "keys", "export-public", timeout=120)
    assert done.returncode == 0, done.stderr
    from infra.signing import fingerprint, public_key_pem

    assert done.stdout.encode() == public_key_pem(tmp_path / "team.pem")
    assert fingerprint(done.stdout.encode()) in done.stderr


# ------------------------------------------------------------------------------ the real stack
@pytest.fixture(scope="module")
def env(local_stack, tmp_path_factory):
    """The client environment, with this module's own bucket made (every test here may run first)."""
    stack, _settings = local_stack
    env = {**os.environ, **stack.client_env(), "PIPPRUNE_HOME": str(tmp_path_factory.mktemp("sign-home")),
           "PIPPRUNE_S3_BUCKET": BUCKET}
    s3 = s3_of(env)
    if BUCKET not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=BUCKET)
    return env


@pytest.fixture(scope="module")
def signed(env, tiny_reference_dir, tmp_path_factory):
    """One compress run (1 step, tiny); yields its summary, the version's tags and the exported public key."""
    done = cli(env, "compress", "--model", str(tiny_reference_dir), "--calibration", str(tiny_reference_dir),
               "--ratio", "0.2", "--unit", "block",
               "--iterations", "1", "--n-samples", "4", "--tasks", "pipprune_wordnet_cloze", "--include-path",
               str(tiny_reference_dir / "tasks"), "--eval-limit", "10", "--name", NAME, "--json", *NO_SERVING)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    from mlflow import MlflowClient

    tags = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_model_version(NAME, summary["model_version"]).tags
    exported = cli(env, "keys", "export-public", timeout=120)
    assert exported.returncode == 0, exported.stderr
    public = tmp_path_factory.mktemp("pub") / "public.pem"
    public.write_text(exported.stdout)
    return summary, tags, public


def _lineage(env, version, *extra):
    done = cli(env, "lineage", NAME, "--version", version, "--json", *extra)
    return done.returncode, json.loads(done.stdout[done.stdout.index("{"):]), done


def _download(s3, prefix: str, local: Path) -> Path:
    """Every object under `prefix`, as it is in S3, into `local`."""
    for obj in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]:
        target = local / obj["Key"][len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(BUCKET, obj["Key"], str(target))
    return local


def _key(uri: str) -> str:
    """The object key of an s3://BUCKET/KEY URI."""
    return uri[5:].split("/", 1)[1]


@pytest.mark.slow
@pytest.mark.stack
def test_signed_version_verifies_with_only_the_public_key(env, signed, local_stack):
    from infra.hashing import sha256_bytes
    from infra.signing import fingerprint, install_key_path

    summary, tags, public = signed
    stack_key = install_key_path(local_stack[1])  # `stack up` made the install's key, and clients sign with it
    assert env["PIPPRUNE_SIGNING_KEY"] == str(stack_key) and stat.S_IMODE(stack_key.stat().st_mode) == 0o600
    assert tags["pipprune.signature_uri"] == summary["s3_uri"].rstrip("/") + ".sig"
    body = s3_of(env).get_object(Bucket=BUCKET, Key=_key(tags["pipprune.signature_uri"]))["Body"].read()
    assert tags["pipprune.signature_sha256"] == sha256_bytes(body)
    assert tags["pipprune.signing_key_fingerprint"] == fingerprint(public.read_bytes())
    # only the public key: the private key is not reachable from the verifying process
    rc, lineage, done = _lineage({**env, "PIPPRUNE_SIGNING_KEY": "/nonexistent.pem"}, summary["model_version"],
                                 "--public-key", str(public))
    assert rc == 0, done.stdout + done.stderr
    assert lineage["problems"] == []
    assert lineage["signature"]["verified"] and lineage["signature"]["files_verified"] >= 3


@pytest.mark.slow
@pytest.mark.stack
def test_stock_model_signing_cli_verifies_a_downloaded_copy(env, signed, tmp_path):
    summary, tags, public = signed
    s3 = s3_of(env)
    prefix = _key(summary["s3_uri"])
    local = _download(s3, prefix, tmp_path / "model")
    s3.download_file(BUCKET, _key(tags["pipprune.signature_uri"]), str(tmp_path / "model.sig"))
    stock = [sys.executable, "-m", "model_signing", "verify", "key", str(local), "--signature",
             str(tmp_path / "model.sig"), "--public_key", str(public)]
    ok = subprocess.run(stock, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "Verification succeeded" in ok.stdout + ok.stderr, ok.stdout + ok.stderr
    (local / "config.json").write_bytes((local / "config.json").read_bytes() + b" ")
    bad = subprocess.run(stock, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "config.json" in bad.stdout + bad.stderr


@pytest.mark.slow
@pytest.mark.stack
def test_one_changed_byte_fails_lineage_even_with_a_forged_manifest(env, signed):
    """A bucket writer flips one weight byte and rewrites the manifest to match: the hashes agree, the signature not."""
    from infra.hashing import sha256_bytes

    summary, _tags, public = signed
    s3 = s3_of(env)
    prefix = _key(summary["s3_uri"])
    weights = prefix + "model.safetensors"
    manifest_key = prefix.rsplit("model/", 1)[0] + "manifest.json"
    original, original_manifest = (s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()
                                   for k in (weights, manifest_key))
    changed = bytearray(original)
    changed[len(changed) // 2] ^= 0x01
    manifest = json.loads(original_manifest)
    manifest["files"]["model/model.safetensors"]["sha256"] = sha256_bytes(bytes(changed))
    s3.put_object(Bucket=BUCKET, Key=weights, Body=bytes(changed))
    s3.put_object(Bucket=BUCKET, Key=manifest_key, Body=json.dumps(manifest).encode())
    try:
        rc, lineage, done = _lineage(env, summary["model_version"], "--public-key", str(public))
        assert rc == 1, done.stdout + done.stderr
        assert not any("iteration 1: " in p and "sha256" in p for p in lineage["problems"])  # the hashes were forged
        named = [p for p in lineage["problems"] if p.startswith("signature:")]
        assert named == [f"signature: {summary['s3_uri']}model.safetensors: changed since signing "
                         f"(sha256 {sha256_bytes(bytes(changed))[:12]}, signed {sha256_bytes(original)[:12]})"]
        table = cli(env, "lineage", NAME, "--version", summary["model_version"])
        assert table.returncode == 1 and "model.safetensors: changed since signing" in table.stdout
    finally:
        s3.put_object(Bucket=BUCKET, Key=weights, Body=original)
        s3.put_object(Bucket=BUCKET, Key=manifest_key, Body=original_manifest)
    assert _lineage(env, summary["model_version"])[0] == 0


@pytest.mark.slow
@pytest.mark.stack
def test_a_signature_made_with_another_key_is_refused(env, signed, tmp_path):
    from infra.signing import public_key_pem, sign_directory

    summary, tags, public = signed
    other = _new_key(tmp_path / "attacker.pem")
    (tmp_path / "attacker.pub").write_bytes(public_key_pem(other))
    rc, lineage, _ = _lineage(env, summary["model_version"], "--public-key", str(tmp_path / "attacker.pub"))
    assert rc == 1 and any("does not verify with public key" in p for p in lineage["problems"])

    # a bucket writer re-signs the (unchanged) model with their own key and replaces model.sig
    s3, prefix = s3_of(env), _key(summary["s3_uri"])
    local = _download(s3, prefix, tmp_path / "copy")
    sig_key = _key(tags["pipprune.signature_uri"])
    original = s3.get_object(Bucket=BUCKET, Key=sig_key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=sig_key, Body=sign_directory(local, other))
    try:
        rc, lineage, _ = _lineage(env, summary["model_version"], "--public-key", str(public))
        assert rc == 1
        assert any("does not verify with public key" in p and "Key mismatch" in p for p in lineage["problems"])
        refused = cli(env, "promote", NAME, "--version", summary["model_version"], "--alias", "attacked")
        assert refused.returncode == 1 and "FAIL signature" in refused.stdout, refused.stdout + refused.stderr
    finally:
        s3.put_object(Bucket=BUCKET, Key=sig_key, Body=original)


@pytest.mark.slow
@pytest.mark.stack
def test_promotion_refuses_an_unsigned_version_unless_the_gate_file_allows_it(env, signed, tmp_path):
    from mlflow import MlflowClient

    summary, tags, _public = signed
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    unsigned_tags = {k: v for k, v in tags.items() if not k.startswith("pipprune.sign")}
    unsigned = client.create_model_version(NAME, source=summary["s3_uri"], run_id=summary["mlflow_run_id"],
                                           tags=unsigned_tags).version
    refused = cli(env, "promote", NAME, "--version", str(unsigned), "--alias", "champion")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "FAIL signature: not signed" in refused.stdout
    assert "champion" not in client.get_registered_model(NAME).aliases

    allow = tmp_path / "allow-unsigned.yaml"
    allow.write_text(yaml.safe_dump({"gates": {"require_signature": False}}))
    done = cli(env, "promote", NAME, "--version", str(unsigned), "--alias", "legacy", "--gates", str(allow))
    assert done.returncode == 0, done.stdout + done.stderr

    signed_ok = cli(env, "promote", NAME, "--version", summary["model_version"], "--alias", "champion")
    assert signed_ok.returncode == 0 and "PASS signature: verified" in signed_ok.stdout, signed_ok.stdout


@pytest.mark.slow
@pytest.mark.stack
def test_compress_without_a_usable_signing_key_fails_before_any_work(env, tiny_reference_dir, tmp_path):
    missing = tmp_path / "missing.pem"
    done = cli({**env, "PIPPRUNE_SIGNING_KEY": str(missing)}, "compress", "--model", str(tiny_reference_dir),
               "--ratio", "0.2", "--unit", "block", "--iterations", "1", "--n-samples", "4", "--name", "never")
    assert done.returncode != 0 and str(missing) in done.stderr, done.stderr[-2000:]
