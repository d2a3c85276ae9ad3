"""Faults, safety and concurrency against the real local stack (no mocks of pipprune code)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import NO_SERVING, cli, s3_of

pytestmark = [pytest.mark.slow, pytest.mark.stack]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env(local_stack, tmp_path_factory):
    stack, _ = local_stack
    return {**os.environ, **stack.client_env(), "PIPPRUNE_HOME": str(tmp_path_factory.mktemp("rel-home"))}




def compress_args(ref: Path, name: str, *extra: str) -> list[str]:
    return ["compress", "--model", str(ref), "--calibration", str(ref), "--ratio", "0.2", "--unit", "mlp", "--iterations", "2",
            "--n-samples", "4", "--tasks", "pipprune_wordnet_cloze", "--include-path", str(ref / "tasks"),
            "--eval-limit", "10", "--name", name, "--json", *NO_SERVING, *extra]


def summary_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout[done.stdout.index("{"):])


def versions(env: dict[str, str], name: str) -> list:
    from mlflow import MlflowClient

    return MlflowClient(env["MLFLOW_TRACKING_URI"]).search_model_versions(f"name = '{name}'")


def test_corrupted_checkpoint_is_never_loaded(env, tiny_reference_dir, tmp_path):
    s3 = s3_of(env)
    s3.create_bucket(Bucket="corrupt")
    first_env = {**env, "PIPPRUNE_S3_BUCKET": "corrupt", "PIPPRUNE_HOME": str(tmp_path / "a")}
    first = summary_of(cli(first_env, *compress_args(tiny_reference_dir, "rel-corrupt")))
    key = f"runs/{first['run_key']}/iter-2/model/model.safetensors"
    good = s3.get_object(Bucket="corrupt", Key=key)["Body"].read()
    s3.put_object(Bucket="corrupt", Key=key, Body=good[:-8] + b"\0" * 8)  # same size, wrong bytes
    # a fresh machine (empty state dir) must not resume from the corrupted iteration 2
    second = summary_of(cli({**first_env, "PIPPRUNE_HOME": str(tmp_path / "b")},
                            *compress_args(tiny_reference_dir, "rel-corrupt")))
    assert second["iterations_resumed"] == 1
    assert s3.get_object(Bucket="corrupt", Key=key)["Body"].read() == good  # recomputed identically


def test_mlflow_unavailable_fails_fast_and_writes_nothing(env, tiny_reference_dir, tmp_path):
    dead = {**env, "PIPPRUNE_MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "MLFLOW_TRACKING_URI": "http://127.0.0.1:9",
            "PIPPRUNE_S3_BUCKET": "nomlflow", "PIPPRUNE_HOME": str(tmp_path / "h")}
    s3_of(env).create_bucket(Bucket="nomlflow")
    done = cli(dead, *compress_args(tiny_reference_dir, "rel-nomlflow"))
    assert done.returncode == 3 and "cannot reach MLflow" in done.stderr  # 3: a service unreachable
    assert "Contents" not in s3_of(env).list_objects_v2(Bucket="nomlflow")


def test_disk_full_while_saving_leaves_no_manifest(env, tiny_reference_dir, tmp_path):
    small = tmp_path / "tiny-disk"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        s3_of(env).create_bucket(Bucket="diskfull")
        done = cli({**env, "PIPPRUNE_HOME": str(small), "PIPPRUNE_S3_BUCKET": "diskfull"},
                   *compress_args(tiny_reference_dir, "rel-diskfull"))
    finally:
        subprocess.run(["umount", str(small)])
    assert done.returncode != 0
    assert "No space left" in done.stdout + done.stderr
    keys = [o["Key"] for o in s3_of(env).list_objects_v2(Bucket="diskfull").get("Contents", [])]
    assert not [k for k in keys if k.endswith("iter-2/manifest.json")]  # the step that hit the full disk
    from infra.s3store import CheckpointStore

    for key in {k.split("/")[1] for k in keys}:  # whatever did get a manifest is complete and verifies
        store = CheckpointStore(s3_of(env), "diskfull", key)
        assert all(store.verify_checkpoint(ref) == [] for ref in store.complete_checkpoints())
    assert versions(env, "rel-diskfull") == []


def test_checkpoints_are_safetensors_and_foreign_code_never_runs(tiny_reference_dir, tmp_path):
    from pip_core import io as core_io
    from pip_core.errors import UnsupportedArchitectureError

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil"
    shutil.copytree(tiny_reference_dir, evil, ignore=shutil.ignore_patterns("tasks", "calibration"))
    (evil / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    config = json.loads((evil / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (evil / "config.json").write_text(json.dumps(config))
    model, _ = core_io.load(evil)  # stock class; the auto_map is ignored
    assert type(model).__name__ == "LlamaForCausalLM" and not marker.exists()
    config["model_type"] = "evil"
    (evil / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="evil"):
        core_io.load(evil)
    assert not marker.exists()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_reference_dir / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        core_io.load(pickled)


def test_three_runs_at_once_two_identical_all_register_and_never_leak_credentials(env, local_stack,
                                                                                 tiny_reference_dir, tmp_path):
    """Three runs on one stack and one state dir, two of them identical (a retried schedule): the identical pair
    takes turns on its run key, every run registers, lineage verifies every version, and the stack's S3 keys
    appear in no output, MLflow param or tag, Prefect parameter or log, manifest or state file."""
    stack, _ = local_stack
    keys = stack.credentials()
    s3_of(env).create_bucket(Bucket="concurrent")
    run_env = {**env, "PIPPRUNE_S3_BUCKET": "concurrent", "PIPPRUNE_HOME": str(tmp_path / "shared")}
    procs = [subprocess.Popen([sys.executable, "-m", "pipprune.cli",
                               *compress_args(tiny_reference_dir, "rel-concurrent", "--seed", str(seed))],
                              env=run_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (11, 11, 12)]
    summaries, texts = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-2000:] + err[-2000:]
        summaries.append(json.loads(out[out.index("{"):]))
        texts += [out, err]
    assert summaries[0]["run_key"] == summaries[1]["run_key"] != summaries[2]["run_key"]
    # registration is idempotent per (run key, weights): the retried run gets the version its twin registered
    assert summaries[0]["model_version"] == summaries[1]["model_version"] != summaries[2]["model_version"]
    assert summaries[0]["s3_uri"] == summaries[1]["s3_uri"]  # the second reused the first's checkpoints
    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    for summary in summaries:
        lineage = cli(run_env, "lineage", "rel-concurrent", "--version", summary["model_version"], "--json")
        assert lineage.returncode == 0, lineage.stdout + lineage.stderr
        texts += [lineage.stdout, lineage.stderr]
        version = client.get_model_version("rel-concurrent", summary["model_version"])
        assert version.tags["pipprune.run_key"] == summary["run_key"]
        manifest = json.loads(s3_of(env).get_object(
            Bucket="concurrent", Key=f"runs/{summary['run_key']}/iter-2/manifest.json")["Body"].read())
        run = client.get_run(summary["mlflow_run_id"])
        texts += [json.dumps(run.data.params), json.dumps(run.data.tags), json.dumps(dict(version.tags)),
                  json.dumps(manifest), *_prefect_params_and_logs(env, version.tags["pipprune.prefect_flow_run_id"])]
    status = cli(env, "stack", "status", "--json")
    texts += [status.stdout, status.stderr, cli(env, "stack", "status").stdout]
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.stat().st_size < 5_000_000:
            texts.append(path.read_bytes().decode("latin-1"))
    assert len(texts) > 20
    for text in texts:
        assert keys.access_key_id not in text and keys.secret_access_key not in text


def _prefect_params_and_logs(env: dict[str, str], flow_run_id: str) -> list[str]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def read() -> list[str]:
        async with get_client() as client:
            run = await client.read_flow_run(flow_run_id)
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            return [json.dumps(run.parameters, default=str), *(entry.message for entry in logs)]

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        found = asyncio.run(read())
    assert len(found) > 1, "no Prefect logs read back"
    return found


def test_an_s3_500_wrapped_by_upload_file_is_retried_and_a_refusal_is_not():
    """boto3's upload_file raises S3UploadFailedError while handling the ClientError; the task retries judge
    what it wraps (seen: SeaweedFS "InternalError" under three concurrent runs failed a run with no retry)."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError

    from tasks._common import is_transient

    def wrapped(code: str, status: int) -> S3UploadFailedError:
        try:
            try:
                raise ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
            except ClientError as exc:
                raise S3UploadFailedError(f"Failed to upload a to b: {exc}")  # noqa: B904 (boto3's own shape)
        except S3UploadFailedError as failed:
            return failed

    assert is_transient(wrapped("InternalError", 500)) and is_transient(wrapped("SlowDown", 503))
    assert not is_transient(wrapped("AccessDenied", 403)) and not is_transient(S3UploadFailedError("no cause"))
