"""A registered version is an MLflow model users can load, serve and audit, against the real local stack.

One compress run on the tiny reference, started with nothing but the exports of `pipprune stack env`
(as a user would paste them), feeds every test here.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from infra.stack import free_port
from tests.helpers import NO_SERVING, cli, stack_settings_env

pytestmark = [pytest.mark.slow, pytest.mark.stack]

NAME = "tiny-mlflow-model"
BUCKET = "mlflow-model-tests"
PROMPT = "It is a truth universally acknowledged"


def _bare_env() -> dict[str, str]:
    """A shell's environment without any endpoint or key (what a new terminal has)."""
    drop = ("PIPPRUNE_", "MLFLOW_", "AWS_", "PREFECT_API")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.fixture(scope="module")
def user_env(local_stack) -> dict[str, str]:
    """The exports `pipprune stack env` prints, read back as a shell would."""
    _stack, settings = local_stack
    done = cli({**_bare_env(), **stack_settings_env(settings)}, "stack", "env")
    assert done.returncode == 0, done.stderr
    exports = {}
    for line in done.stdout.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            exports[key] = value.strip("'")
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert exports.get(key), f"`stack env` does not export {key}"
    return exports


@pytest.fixture(scope="module")
def session_env(user_env, tmp_path_factory) -> dict[str, str]:
    return {**_bare_env(), **user_env, "PIPPRUNE_HOME": str(tmp_path_factory.mktemp("mlflow-home")),
            "PIPPRUNE_S3_BUCKET": BUCKET}


@pytest.fixture(scope="module")
def registered(session_env, tiny_reference_dir, tmp_path_factory) -> dict:
    """compress run with only the `stack env` exports set (pipprune keeps working with them)."""
    import boto3

    boto3.client("s3", endpoint_url=session_env["MLFLOW_S3_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id=session_env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=session_env["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=BUCKET)
    out = tmp_path_factory.mktemp("export") / "model"
    done = cli(session_env, "compress", "--model", str(tiny_reference_dir), "--calibration", str(tiny_reference_dir),
               "--ratio", "0.3", "--unit", "block",
               "--iterations", "2", "--n-samples", "4", "--tasks", "pipprune_wordnet_cloze", "--include-path",
               str(tiny_reference_dir / "tasks"), "--eval-limit", "4", "--name", NAME, "--out", str(out), "--json",
               *NO_SERVING)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    from mlflow import MlflowClient

    MlflowClient(session_env["MLFLOW_TRACKING_URI"]).set_registered_model_alias(NAME, "champion",
                                                                               summary["model_version"])
    return summary


def _user_python(env: dict[str, str], code: str, timeout: float = 300) -> dict:
    """Run `code` in a fresh interpreter outside the repository (no pipprune import path): a user's session."""
    done = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": ""}, cwd="/", capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


LOAD_BOTH = f"""
import json, mlflow
uri = "models:/{NAME}@champion"
parts = mlflow.transformers.load_model(uri, return_type="components")
tok, model = parts["tokenizer"], parts["model"]
ids = tok({PROMPT!r}, return_tensors="pt")
out = model.generate(**ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
pyfunc = mlflow.pyfunc.load_model(uri)
text = pyfunc.predict([{PROMPT!r}], params={{"max_new_tokens": 8, "do_sample": False}})
info = mlflow.models.get_model_info(uri)
print(json.dumps({{"tokens": out[0].tolist(), "pyfunc": text, "model_class": type(model).__name__,
                  "signature": info.signature.to_dict() if info.signature else None,
                  "example": info.saved_input_example_info, "model_id": info.model_id, "run_id": info.run_id}}))
"""


def test_version_loads_with_both_loaders_like_the_saved_directory(registered, session_env):
    from pip_core import io as core_io

    got = _user_python(session_env, LOAD_BOTH)
    net, tok = core_io.load(registered["out_dir"])
    ids = tok(PROMPT, return_tensors="pt")
    expected = net.generate(**ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0]
    assert got["tokens"] == expected.tolist()
    # the pyfunc takes no min_new_tokens, so its greedy text may end early at an end-of-text token
    as_pyfunc = net.generate(**ids, max_new_tokens=8, do_sample=False)[0]
    assert got["pyfunc"] == [tok.decode(as_pyfunc, skip_special_tokens=True)]
    assert got["signature"]["inputs"] and "max_new_tokens" in got["signature"]["params"]
    assert got["example"]["artifact_path"] == "input_example.json"
    assert got["run_id"] == registered["mlflow_run_id"]
    from mlflow import MlflowClient

    version = MlflowClient(session_env["MLFLOW_TRACKING_URI"]).get_model_version(NAME, registered["model_version"])
    logged = MlflowClient(session_env["MLFLOW_TRACKING_URI"]).get_logged_model(got["model_id"])
    assert version.tags["pipprune.logged_model_id"] == logged.model_id
    assert logged.source_run_id == registered["mlflow_run_id"] and logged.status == "READY"
    assert logged.tags["pipprune.s3_uri"] == version.source  # the logged model points at the checkpoint
    linked = json.loads(logged.tags["mlflow.modelVersions"])
    assert {"name": NAME, "version": int(version.version)} in linked
    assert version.source == registered["s3_uri"].removesuffix("model/")


def test_mlflow_models_serve_answers(registered, session_env):
    port = free_port()
    # `mlflow models serve` execs uvicorn from PATH: the interpreter's bin dir, as in an activated venv
    env = {**session_env, "PYTHONPATH": "", "PATH": f"{Path(sys.executable).parent}:{session_env.get('PATH', '')}"}
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{NAME}@champion",
                               "--env-manager", "local", "--host", "127.0.0.1", "-p", str(port), "--workers", "1"],
                              env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, server.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "mlflow models serve did not become healthy in 240 s"
            time.sleep(1)
        body = json.dumps({"inputs": [PROMPT], "params": {"max_new_tokens": 8, "do_sample": False}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        text = answer["predictions"][0]
        assert text.startswith(PROMPT) and len(text) > len(PROMPT), answer
    finally:
        _stop_group(server)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (uvicorn workers included), SIGKILL what outlives 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def test_datasets_are_run_inputs_with_the_digest_lineage_reports(registered, session_env):
    from mlflow import MlflowClient

    done = cli(session_env, "lineage", NAME, "--version", registered["model_version"], "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    lineage = json.loads(done.stdout[done.stdout.index("{"):])
    assert lineage["problems"] == []
    run = MlflowClient(session_env["MLFLOW_TRACKING_URI"]).get_run(registered["mlflow_run_id"])
    inputs = {next(t.value for t in i.tags if t.key == "mlflow.data.context"): i.dataset
              for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"calibration", "evaluation"}
    assert inputs["calibration"].digest == lineage["datasets"]["calibration"]["digest"]
    assert lineage["calibration_hash"].startswith(inputs["calibration"].digest)
    assert json.loads(inputs["calibration"].source)  # a source that names where the texts came from
    version = MlflowClient(session_env["MLFLOW_TRACKING_URI"]).get_model_version(NAME, registered["model_version"])
    assert version.tags["pipprune.dataset.calibration.digest"] == inputs["calibration"].digest
    assert version.tags["pipprune.dataset.evaluation.digest"] == inputs["evaluation"].digest


def test_lineage_detects_a_modified_mlmodel(registered, session_env):
    import boto3

    s3 = boto3.client("s3", endpoint_url=session_env["MLFLOW_S3_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id=session_env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=session_env["AWS_SECRET_ACCESS_KEY"])
    key = registered["s3_uri"].removeprefix(f"s3://{BUCKET}/").removesuffix("model/") + "MLmodel"
    original = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=key, Body=original.replace(b"task: text-generation", b"task: summarization"))
    try:
        done = cli(session_env, "lineage", NAME, "--version", registered["model_version"])
        assert done.returncode == 1 and "MLmodel" in done.stdout, done.stdout + done.stderr
    finally:
        s3.put_object(Bucket=BUCKET, Key=key, Body=original)


def test_run_page_metadata(registered, session_env):
    from mlflow import MlflowClient

    client = MlflowClient(session_env["MLFLOW_TRACKING_URI"])
    run = client.get_run(registered["mlflow_run_id"])
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"
    tags = run.data.tags
    assert tags["mlflow.source.name"] == "flows/compress.py:compress_flow"
    assert tags["mlflow.source.type"] == "JOB"
    assert tags.get("mlflow.source.git.commit", "") in tags["pipprune.git_sha"]
    note = tags["mlflow.note.content"]
    for needle in ("pip", "block", f"{registered['achieved_ratio']:.3f}", registered["s3_uri"], "heldout_perplexity"):
        assert needle in note, f"description lacks {needle!r}:\n{note}"
    system = [k for k in run.data.metrics if k.startswith("system/")]
    assert any("cpu" in k for k in system) and any("memory" in k for k in system), system
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert "plots/quality_vs_params_removed.png" in artifacts


def test_final_weights_are_stored_once(registered, session_env):
    """No object in any bucket repeats a weight file of the final checkpoint (the MLflow model included). Other
    runs' checkpoints (`runs/<their key>/`) are not copies: other tests on this stack may prune the tiny model to
    the same weights."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=session_env["MLFLOW_S3_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id=session_env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=session_env["AWS_SECRET_ACCESS_KEY"])
    prefix = registered["s3_uri"].removeprefix(f"s3://{BUCKET}/").removesuffix("model/")
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key=prefix + "manifest.json")["Body"].read())
    weights = {rel: e for rel, e in manifest["files"].items() if rel.endswith((".safetensors", ".bin"))}
    assert weights, "the final checkpoint lists no weight file"
    copies: dict[str, list[str]] = {rel: [] for rel in weights}
    sizes = {e["size"] for e in weights.values()}
    own_run = "/".join(prefix.split("/")[:2]) + "/"  # runs/<run key>/
    for bucket in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                if obj["Size"] not in sizes or (obj["Key"].startswith("runs/") and not obj["Key"].startswith(own_run)):
                    continue
                digest = hashlib.sha256(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()).hexdigest()
                for rel, entry in weights.items():
                    if digest == entry["sha256"]:
                        copies[rel].append(f"s3://{bucket}/{obj['Key']}")
    for rel, found in copies.items():
        assert found == [f"s3://{BUCKET}/{prefix}{rel}"], f"{rel} stored {len(found)} times: {found}"


def test_docs_screenshots(registered, session_env, tmp_path):
    """Headless Chromium screenshots of the run page and both plots (PIPPRUNE_DOCS_DIR=docs writes them there)."""
    from infra.screenshots import ScreenshotError, chromium_binary, screenshot_run

    if chromium_binary() is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium)")
    out = Path(os.environ.get("PIPPRUNE_DOCS_DIR") or tmp_path)
    try:
        shots = screenshot_run(session_env["MLFLOW_TRACKING_URI"], registered["mlflow_run_id"], out)
    except ScreenshotError as exc:
        pytest.fail(str(exc))
    assert set(shots) == {"run_page", "quality_vs_params_removed", "unit_scores"}
    for path in shots.values():
        assert path.stat().st_size > 10_000, f"{path} looks blank"
