"""Budgets and the serving measurement against the real stack: an infeasible target leaves no trace;
a compress run logs its speedup, tags the version with it, and promotion gates read it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml

from tests.helpers import cli, s3_of

pytestmark = [pytest.mark.slow, pytest.mark.stack]

BUCKET = "budget-tests"
NAME = "tiny-budget"


@pytest.fixture(scope="module")
def env(local_stack, tmp_path_factory):
    stack, _settings = local_stack
    env = {**os.environ, **stack.client_env(), "PIPPRUNE_HOME": str(tmp_path_factory.mktemp("home")),
           "PIPPRUNE_S3_BUCKET": BUCKET}
    s3_of(env).create_bucket(Bucket=BUCKET)
    return env


def _flow_runs(env: dict[str, str]) -> int:
    import httpx

    return int(httpx.post(env["PREFECT_API_URL"].rstrip("/") + "/flow_runs/count", json={}, timeout=30).json())


def test_infeasible_target_is_refused_before_weights_flow_runs_or_registration(env, tiny_reference_dir, tmp_path):
    from mlflow import MlflowClient

    model = tmp_path / "model"
    shutil.copytree(tiny_reference_dir, model)
    (model / "model.safetensors").write_bytes(b"not weights: reading them would fail with another message")
    runs_before, objects_before = _flow_runs(env), s3_of(env).list_objects_v2(Bucket=BUCKET).get("KeyCount", 0)
    done = cli(env, "compress", "--model", str(model), "--calibration", str(tiny_reference_dir), "--unit", "width",
               "--target", "params=1000", "--name", "never-registered")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "params=1000 is infeasible" in done.stderr and "nearest feasible target: --target params=" in done.stderr
    assert _flow_runs(env) == runs_before
    assert s3_of(env).list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == objects_before
    assert not [m for m in MlflowClient(env["MLFLOW_TRACKING_URI"]).search_registered_models()
                if m.name == "never-registered"]


@pytest.fixture(scope="module")
def registered(env, tiny_reference_dir):
    # the gates under test here are the speed ones: the tiny model's continuations after a 30% cut may loop,
    # so the repetition bound is relaxed (its own behaviour: tests/test_quality_gate.py)
    done = cli(env, "compress", "--model", str(tiny_reference_dir), "--ratio", "0.3", "--unit", "width",
               "--iterations", "1", "--n-samples", "4", "--eval-limit", "5", "--name", NAME, "--json",
               "--min-distinct-ratio", "0.3")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout[done.stdout.index("{"):])


def test_serving_speed_is_logged_and_tagged_with_the_budget(env, registered):
    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    version = client.get_model_version(NAME, registered["model_version"])
    tags = version.tags
    assert float(tags["pipprune.serving.decode_speedup"]) > 0 and tags["pipprune.serving.backend"] == "transformers"
    assert tags["pipprune.align"] == "64" and tags["pipprune.target"] == "ratio=0.3"
    assert float(tags["pipprune.achieved_ratio"]) == pytest.approx(registered["achieved_ratio"], abs=1e-6)
    assert int(tags["pipprune.achieved_params"]) == int(tags["pipprune.planned_params"]) == registered["params_after"]
    metrics = client.get_run(registered["mlflow_run_id"]).data.metrics
    for key in ("serving.decode_speedup", "serving.ideal_speedup", "serving.fraction_of_ideal",
                "serving.dense.b1.decode_tokens_per_s", "serving.pruned.b8.latency_p95_s",
                "serving.pruned.b1.prefill_tokens_per_s", "serving.dense.peak_memory_bytes"):
        assert key in metrics, key
    assert metrics["serving.ideal_speedup"] > 1.0
    artifacts = [a.path for a in client.list_artifacts(registered["mlflow_run_id"], "serving")]
    assert "serving/serving_speed.png" in artifacts


def test_decode_speedup_gate_passes_and_fails(env, registered, tmp_path):
    from mlflow import MlflowClient

    speedup = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(registered["mlflow_run_id"]).data.metrics[
        "serving.decode_speedup"]
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump({"gates": {"decode_speedup": f">= {speedup * 2:.4f}"}}))
    done = cli(env, "promote", NAME, "--version", registered["model_version"], "--alias", "fast", "--gates", str(strict))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL decode speedup" in done.stdout
    lenient = tmp_path / "lenient.yaml"
    lenient.write_text(yaml.safe_dump({"gates": {"decode_speedup": f">= {speedup / 2:.4f}"}}))
    done = cli(env, "promote", NAME, "--version", registered["model_version"], "--alias", "fast", "--gates", str(lenient))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS decode speedup" in done.stdout
