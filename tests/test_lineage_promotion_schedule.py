"""Lineage audit, gated promotion and scheduled runs against the real local stack."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import NO_SERVING, cli, s3_of

pytestmark = [pytest.mark.slow, pytest.mark.stack]

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny-lineage"


@pytest.fixture(scope="module")
def env(local_stack, tmp_path_factory):
    stack, _settings = local_stack
    return {**os.environ, **stack.client_env(), "PIPPRUNE_HOME": str(tmp_path_factory.mktemp("home")),
            "PIPPRUNE_S3_BUCKET": "lineage-tests"}






@pytest.fixture(scope="module")
def registered(env, tiny_reference_dir):
    s3_of(env).create_bucket(Bucket="lineage-tests")
    done = cli(env, "compress", "--model", str(tiny_reference_dir), "--calibration", str(tiny_reference_dir),
               "--ratio", "0.2", "--unit", "block",
               "--iterations", "2", "--n-samples", "6", "--tasks", "pipprune_wordnet_cloze", "--include-path",
               str(tiny_reference_dir / "tasks"), "--eval-limit", "20", "--name", NAME, "--json", *NO_SERVING)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout[done.stdout.index("{"):])


def test_lineage_of_fresh_run_verifies(env, registered, tiny_reference_dir):
    done = cli(env, "lineage", NAME, "--version", registered["model_version"], "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    lineage = json.loads(done.stdout[done.stdout.index("{"):])
    assert lineage["problems"] == []
    assert [it["iteration"] for it in lineage["iterations"]] == [1, 2]
    assert lineage["final_s3_uri"] == registered["s3_uri"]
    assert lineage["source_model"] == str(tiny_reference_dir)
    table = cli(env, "lineage", NAME)
    assert table.returncode == 0 and "lineage verified" in table.stdout


def test_lineage_detects_a_modified_s3_object(env, registered):
    s3 = s3_of(env)
    key = f"runs/{registered['run_key']}/iter-1/model/config.json"
    original = s3.get_object(Bucket="lineage-tests", Key=key)["Body"].read()
    s3.put_object(Bucket="lineage-tests", Key=key, Body=original + b" ")
    try:
        done = cli(env, "lineage", NAME, "--version", registered["model_version"])
        assert done.returncode == 1
        assert "iter-1" in done.stdout or "iteration 1" in done.stdout
        assert "config.json" in done.stdout
    finally:
        s3.put_object(Bucket="lineage-tests", Key=key, Body=original)


def test_lineage_detects_a_modified_tag(env, registered):
    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    version = registered["model_version"]
    good = client.get_model_version(NAME, version).tags["pipprune.calibration_hash"]
    client.set_model_version_tag(NAME, version, "pipprune.calibration_hash", "0" * 64)
    try:
        done = cli(env, "lineage", NAME, "--version", version)
        assert done.returncode == 1
        assert "pipprune.calibration_hash" in done.stdout
    finally:
        client.set_model_version_tag(NAME, version, "pipprune.calibration_hash", good)


def test_promotion_fails_then_passes_on_the_right_gates(env, registered, tmp_path):
    from mlflow import MlflowClient

    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump({"gates": {"param_reduction_min": 0.5, "perplexity_increase_max": 100.0}}))
    done = cli(env, "promote", NAME, "--version", registered["model_version"], "--alias", "champion",
               "--gates", str(strict))
    assert done.returncode == 1
    assert "FAIL parameter reduction" in done.stdout and "PASS perplexity increase" in done.stdout
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert "champion" not in client.get_registered_model(NAME).aliases

    lenient = tmp_path / "lenient.yaml"
    lenient.write_text(yaml.safe_dump({"gates": {"param_reduction_min": 0.15, "perplexity_increase_max": 100.0,
                                                 "retained_min": {"pipprune_wordnet_cloze.acc": 0.1}}}))
    for _ in range(2):  # the second promotion is a no-op
        done = cli(env, "promote", NAME, "--version", registered["model_version"], "--alias", "champion",
                   "--gates", str(lenient), "--reason", "nightly")
        assert done.returncode == 0, done.stdout + done.stderr
    assert "nothing changed" in done.stdout
    version = client.get_model_version_by_alias(NAME, "champion")
    assert version.version == registered["model_version"]
    assert version.tags["pipprune.promotion.champion.why"] == "nightly"

    missing = cli(env, "promote", NAME, "--version", "999", "--alias", "champion")
    assert missing.returncode == 2 and "999" in missing.stderr


def test_schedule_deployment_runs_on_a_process_worker(env, tiny_reference_dir, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": str(tiny_reference_dir), "calibration": str(tiny_reference_dir), "ratio": 0.1, "unit": "block",
        "method": "magnitude", "iterations": 1, "n_samples": 4, "registered_model_name": "tiny-scheduled",
        "serving": {"measure": False}}))
    prefect = [sys.executable, "-m", "prefect"]
    made = subprocess.run([*prefect, "work-pool", "create", "test-pool", "--type", "process"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 or "already exists" in made.stdout + made.stderr, made.stdout + made.stderr
    done = cli(env, "schedule", "--config", str(job), "--cron", "0 3 * * *", "--name", "nightly",
               "--work-pool", "test-pool")
    assert done.returncode == 0, done.stdout + done.stderr

    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployments import COMPRESS

    async def read_deployment():
        async with get_client() as client:
            return await client.read_deployment_by_name("compress/nightly")

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        deployment = asyncio.run(read_deployment())
        assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
        assert deployment.entrypoint == COMPRESS.entrypoint
        flow_run = run_deployment("compress/nightly", timeout=0)
    final, out = run_on_worker_once(env, "test-pool", flow_run.id)
    assert final.is_completed(), out[-3000:]


def run_on_worker_once(env: dict[str, str], pool: str, flow_run_id) -> tuple:  # a UUID
    """Start a `process` worker for one flow run of `pool`; returns the run's final state and the worker's output."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--run-once"],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = worker.communicate(timeout=600)
    finally:
        worker.kill()

    async def state():
        async with get_client() as client:
            return (await client.read_flow_run(flow_run_id)).state

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        deadline = time.time() + 60
        while not (final := asyncio.run(state())).is_final() and time.time() < deadline:
            time.sleep(1)
    return final, out


def test_prefect_yaml_is_current_deploys_and_runs_on_a_process_worker(env, tiny_reference_dir):
    from flows.deployments import WORK_POOL, render_prefect_yaml

    assert (ROOT / "prefect.yaml").read_text() == render_prefect_yaml(), "run: python -m flows.deployments > prefect.yaml"
    if env["PIPPRUNE_S3_BUCKET"] not in [b["Name"] for b in s3_of(env).list_buckets()["Buckets"]]:
        s3_of(env).create_bucket(Bucket=env["PIPPRUNE_S3_BUCKET"])
    prefect = [sys.executable, "-m", "prefect"]
    made = subprocess.run([*prefect, "work-pool", "create", WORK_POOL, "--type", "process"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 or "already exists" in made.stdout + made.stderr, made.stdout + made.stderr
    deployed = subprocess.run([*prefect, "--no-prompt", "deploy", "--all"], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    params = {"config": {"model": str(tiny_reference_dir), "ratio": 0.1, "registered_model_name": "tiny-deployed",
                         "calibration": {"source": str(tiny_reference_dir), "n_samples": 4, "heldout_samples": 2},
                         "scoring": {"unit": "block", "method": "magnitude", "iterations": 1},
                         "serving": {"measure": False}}}
    started = subprocess.run([*prefect, "deployment", "run", "compress/compress", "--params", json.dumps(params)],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", started.stdout).group(1)
    final, out = run_on_worker_once(env, WORK_POOL, flow_run_id)
    assert final.is_completed(), out[-3000:]
    from mlflow import MlflowClient

    versions = MlflowClient(env["MLFLOW_TRACKING_URI"]).search_model_versions("name = 'tiny-deployed'")
    assert [v.tags["pipprune.prefect_flow_run_id"] for v in versions] == [flow_run_id]
