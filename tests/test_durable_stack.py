"""The embedded stack is durable and authenticated: the audit chain survives a restart and a killed server.

Real servers only (SeaweedFS, MLflow, Prefect); the shared session stack is stopped, killed and
restarted here, and always left running for the modules after this one.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import boto3
import botocore.exceptions
import pytest

from tests.conftest import stack_settings
from tests.helpers import NO_SERVING, ROOT, cli, s3_of

pytestmark = [pytest.mark.slow, pytest.mark.stack]


@pytest.fixture(scope="module")
def env(local_stack, tmp_path_factory):
    stack, _ = local_stack
    home = tmp_path_factory.mktemp("durable-home")
    return {**os.environ, **stack.client_env(), "PIPPRUNE_HOME": str(home), "PIPPRUNE_S3_BUCKET": "durable"}


@pytest.fixture(scope="module")
def durable_run(env, tiny_reference_dir) -> dict:
    """One finished 3-step run in the durable bucket: what the stack restart must keep, and the uninterrupted
    twin a run killed by a dead S3 server must resume into."""
    s3_of(env).create_bucket(Bucket="durable")
    return summary_of(cli(env, *compress_args(tiny_reference_dir, "durable-model", 3)))


def compress_args(ref: Path, name: str, iterations: int) -> list[str]:
    return ["compress", "--model", str(ref), "--calibration", str(ref), "--ratio", "0.3", "--unit", "width",
            "--method", "magnitude", "--iterations", str(iterations), "--n-samples", "4", "--tasks", "pipprune_wordnet_cloze",
            "--include-path", str(ref / "tasks"), "--eval-limit", "5", "--name", name, "--json", *NO_SERVING]


def summary_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout[done.stdout.index("{"):])


def final_weights_sha(env: dict[str, str], summary: dict) -> str:
    bucket, _, prefix = summary["s3_uri"][5:].partition("/")
    body = s3_of(env).get_object(Bucket=bucket, Key=prefix + "model.safetensors")["Body"].read()
    return hashlib.sha256(body).hexdigest()


def test_credentials_are_per_install_private_and_enforced(local_stack, env):
    stack, settings = local_stack
    path = settings.stack_dir / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = stack.credentials()
    assert len(keys.secret_access_key) >= 32
    wrong = boto3.client("s3", endpoint_url=env["PIPPRUNE_S3_ENDPOINT_URL"], region_name="us-east-1",
                         aws_access_key_id=keys.access_key_id, aws_secret_access_key="not-the-key")
    with pytest.raises(botocore.exceptions.ClientError, match="SignatureDoesNotMatch|InvalidAccessKeyId|403"):
        wrong.list_buckets()
    other_home = stack_settings(settings.home.parent / "never-started")
    from infra.credentials import ensure_credentials

    assert ensure_credentials(other_home.stack_dir) != keys  # every install gets its own


def test_seaweedfs_runs_clean_and_its_health_reads_through_the_volume_layer(local_stack):
    """Every port pinned (the admin worker finds its admin), and healthy means an object reads back."""
    stack, settings = local_stack
    s3 = {s.name: s for s in stack.status()}["s3"]
    assert s3.up and s3.rss_mb > 10, s3
    log = (settings.stack_dir / "s3.log").read_text(errors="replace")
    assert "connection refused" not in log and "INITIAL CONNECTION FAILED" not in log, log[-2000:]
    from infra.stack import HEALTH_KEY

    keys = stack.credentials()
    client = boto3.client("s3", endpoint_url=stack.urls["s3"], region_name="us-east-1",
                          aws_access_key_id=keys.access_key_id, aws_secret_access_key=keys.secret_access_key)
    assert client.get_object(Bucket=settings.s3_bucket, Key=HEALTH_KEY)["Body"].read() == b"ok\n"


def test_the_store_takes_a_bucket_per_run_whatever_the_disks_free_space(local_stack):
    """CI's disk had room for a handful of 1 GiB volumes, and every bucket claims one: the resume tests' own
    buckets then failed their first write. The cap is pinned, not derived from free space."""
    stack, _ = local_stack
    from infra.stack import WEED_MAX_VOLUMES

    master = stack.aux_ports()["master.port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{master}/dir/status", timeout=10) as response:
        topology = json.load(response)["Topology"]
    assert topology["Max"] == WEED_MAX_VOLUMES, topology
    s3 = s3_of({**os.environ, **stack.client_env()})
    for i in range(12):
        s3.create_bucket(Bucket=f"many-{i}")
        s3.put_object(Bucket=f"many-{i}", Key="x", Body=b"x")
        assert s3.get_object(Bucket=f"many-{i}", Key="x")["Body"].read() == b"x"


def test_a_stale_pid_reused_by_another_program_is_never_signalled(tmp_path):
    """After a reboot the recorded pid may belong to someone else: status says stale, down leaves it alone."""
    from infra.stack import LocalStack, weed_binary

    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        settings = stack_settings(tmp_path / "home")
        settings.stack_dir.mkdir(parents=True)
        (settings.stack_dir / "state.json").write_text(json.dumps(
            {"s3": {"pid": stranger.pid, "cmd": [weed_binary(), "mini", f"-dir={tmp_path}"], "log": "x"}}))
        stack = LocalStack(settings)
        s3 = {s.name: s for s in stack.status()}["s3"]
        assert not s3.up and s3.pid is None and s3.detail == "stale pid"
        stack.down(timeout=2)
        time.sleep(0.5)
        assert stranger.poll() is None, "down signalled a process it did not start"
    finally:
        stranger.kill()
        stranger.wait()


def test_wrong_key_is_refused_before_any_model_is_loaded(env, tiny_reference_dir, tmp_path):
    bad = {**env, "AWS_SECRET_ACCESS_KEY": "definitely-wrong", "PIPPRUNE_HOME": str(tmp_path / "h")}
    started = time.monotonic()
    done = cli(bad, *compress_args(tiny_reference_dir, "never-registered", 1))
    assert done.returncode != 0
    assert f"S3 refused the credentials for {env['PIPPRUNE_S3_ENDPOINT_URL']}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and time.monotonic() - started < 120
    assert not (tmp_path / "h" / "work").exists()  # nothing was scored, pruned or written


def test_wrong_key_through_the_mlflow_artifact_proxy_is_refused(local_stack, tiny_reference_dir, tmp_path,
                                                                 monkeypatch):
    """An MLflow server holding a wrong key cannot write artifacts: the proxy passes the refusal on."""
    stack, settings = local_stack
    from infra.stack import LocalStack

    port = stack_settings(tmp_path).mlflow_port
    spec = LocalStack(settings).services()["mlflow"]
    cmd = [c if c != str(settings.mlflow_port) else str(port) for c in spec.cmd]
    cmd = [c.replace(str(settings.home / "mlflow"), str(tmp_path)) for c in cmd]
    server_env = {**os.environ, **spec.env, "AWS_SECRET_ACCESS_KEY": "wrong-wrong-wrong"}
    proc = subprocess.Popen(cmd, env=server_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient(f"http://127.0.0.1:{port}")
        deadline = time.time() + 120
        while True:
            try:
                experiment = client.create_experiment("proxy-check")
                break
            except MlflowException:
                assert time.time() < deadline, "MLflow server did not start"
                time.sleep(1)
        run = client.create_run(experiment)
        artifact = tmp_path / "a.txt"
        artifact.write_text("x")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the refusal is final: no backoff minutes
        with pytest.raises(MlflowException):
            client.log_artifact(run.info.run_id, str(artifact))
        # compress finds out in its preflight, before any model is loaded, not at its first plot
        from infra.preflight import PreflightError, check_mlflow_artifacts

        url = f"http://127.0.0.1:{port}"
        with pytest.raises(PreflightError, match="S3 refused its credentials"):
            check_mlflow_artifacts(url)
        check_mlflow_artifacts(stack.urls["mlflow"])  # the stack's own server holds the right keys
        proxied = {**os.environ, **stack.client_env(), "PIPPRUNE_HOME": str(tmp_path / "h"),
                   "PIPPRUNE_MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_URI": url}
        done = cli(proxied, *compress_args(tiny_reference_dir, "never-proxied", 1))
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]  # a misconfigured server: bad input
        assert f"the MLflow server at {url} cannot store artifacts: S3 refused its credentials" in done.stderr
        assert stack.credentials().secret_access_key not in done.stdout + done.stderr
        assert not (tmp_path / "h" / "work").exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def test_lineage_survives_stack_down_and_up(local_stack, env, durable_run):
    stack, _ = local_stack
    summary = durable_run
    assert cli(env, "lineage", "durable-model", "--version", summary["model_version"]).returncode == 0
    stack.down()
    try:
        assert cli(env, "lineage", "durable-model", "--version", summary["model_version"]).returncode != 0
    finally:
        stack.up(wait=True, timeout=240)
    again = cli(env, "lineage", "durable-model", "--version", summary["model_version"], "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert client.get_run(summary["mlflow_run_id"]).data.metrics["num_params"] == summary["params_after"]
    artifacts = {a.path for a in client.list_artifacts(summary["mlflow_run_id"], "iterations/iter-1")}
    assert "iterations/iter-1/score_table.csv" in artifacts  # artifacts live in the durable bucket


def test_s3_killed_mid_run_fails_clearly_then_resumes_identically(local_stack, env, tiny_reference_dir, durable_run,
                                                                   tmp_path):
    stack, settings = local_stack
    s3 = s3_of(env)
    s3.create_bucket(Bucket="killed")
    reference = durable_run  # the same job, uninterrupted, in another bucket and home
    run_env = {**env, "PIPPRUNE_S3_BUCKET": "killed", "PIPPRUNE_HOME": str(tmp_path / "k")}
    victim = subprocess.Popen([sys.executable, "-m", "pipprune.cli", *compress_args(tiny_reference_dir, "durable-killed", 3)],
                              env=run_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while not any(o["Key"].endswith("iter-1/manifest.json")
                  for o in s3.list_objects_v2(Bucket="killed", Prefix="runs/").get("Contents", [])):
        assert victim.poll() is None and time.time() < deadline, victim.stdout.read()[-3000:]
        time.sleep(0.2)
    s3_pid = json.loads((settings.stack_dir / "state.json").read_text())["s3"]["pid"]
    os.killpg(s3_pid, signal.SIGKILL)  # the S3 server dies during iteration 2
    try:
        out, _ = victim.communicate(timeout=600)
        assert victim.returncode == 1, out[-3000:]
        # either pipprune's S3 client or MLflow's artifact proxy (S3 behind it) names the dead endpoint
        assert "compress failed" in out and ("Could not connect" in out or "500 error" in out), out[-3000:]
        from mlflow import MlflowClient

        assert MlflowClient(env["MLFLOW_TRACKING_URI"]).search_model_versions("name = 'durable-killed'") == []
    finally:
        stack.up(wait=True, timeout=240)  # restarts the S3 server on its data
    resumed = summary_of(cli(run_env, *compress_args(tiny_reference_dir, "durable-killed", 3)))
    assert resumed["iterations_resumed"] >= 1
    assert resumed["run_key"] == reference["run_key"]
    assert final_weights_sha(env, resumed) == final_weights_sha({**env}, reference)
