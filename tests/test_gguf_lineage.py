"""GGUF child versions against the real local stack: the compress `export:` stage, `pipprune export`, lineage from
the GGUF file back to the dense source (every digest and both signatures), and gated promotion on its own figures."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.helpers import cli, s3_of

pytestmark = [pytest.mark.slow, pytest.mark.stack]

NAME = "tiny-gguf"
CHILD = f"{NAME}-gguf"
BUCKET = "gguf-tests"


def _doc(done) -> dict:
    return json.loads(done.stdout[done.stdout.index("{"):])


@pytest.fixture(scope="module")
def env(local_stack, tmp_path_factory):
    stack, _settings = local_stack
    return {**os.environ, **stack.client_env(), "PIPPRUNE_HOME": str(tmp_path_factory.mktemp("home")),
            "PIPPRUNE_S3_BUCKET": BUCKET}


@pytest.fixture(scope="module")
def compressed(env, tiny_reference_dir, tmp_path_factory):
    """A block-pruned tiny reference whose compress run ends with the export stage (f16)."""
    s3_of(env).create_bucket(Bucket=BUCKET)
    config = tmp_path_factory.mktemp("cfg") / "compress.yaml"
    config.write_text(yaml.safe_dump({"export": {"quant": "f16"}, "serving": {"measure": False}}))
    done = cli(env, "compress", "--model", str(tiny_reference_dir), "--calibration", str(tiny_reference_dir),
               "--config", str(config), "--ratio", "0.2", "--unit", "block", "--iterations", "1", "--n-samples", "6",
               "--tasks", "pipprune_wordnet_cloze", "--include-path", str(tiny_reference_dir / "tasks"),
               "--eval-limit", "10", "--name", NAME, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return _doc(done)


@pytest.fixture(scope="module")
def exported(env, compressed):
    done = cli(env, "export", NAME, "--version", compressed["model_version"], "--format", "gguf", "--quant", "q8_0",
               "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return _doc(done)["exports"][0]


def test_compress_export_stage_registers_a_measured_f16_child(compressed):
    (child,) = compressed["exports"]
    assert child["registered_model"] == CHILD and child["quant"] == "f16"
    assert child["s3_uri"] == compressed["s3_uri"].replace("/model/", "/gguf-f16/")
    m = child["metrics"]
    assert m["gguf.tokenizer_match"] == 1.0
    assert m["gguf.kl_to_parent"] < 1e-3 and m["gguf.top1_to_parent"] > 0.99  # f16 barely moves the parent
    assert abs(m["final.heldout_kl"] - m["parent.heldout_kl"]) < 1e-2
    assert child["quality"]["verdict"] == "usable"


def test_export_cli_writes_a_q8_0_child_beside_its_parent(env, compressed, exported):
    assert exported["quant"] == "q8_0" and exported["parent"] == f"{NAME} v{compressed['model_version']}"
    base = compressed["s3_uri"].split(f"s3://{BUCKET}/", 1)[1].removesuffix("model/")
    keys = {o["Key"] for o in s3_of(env).list_objects_v2(Bucket=BUCKET, Prefix=base)["Contents"]}
    assert {f"{base}gguf-q8_0/{exported['file']}", f"{base}gguf-q8_0.manifest.json", f"{base}gguf-q8_0.sig"} <= keys
    m = exported["metrics"]
    assert m["gguf.tokenizer_match"] == 1.0 and m["gguf.top1_to_parent"] > 0.9
    assert exported["tensor_types"].get("Q8_0", 0) > 0
    from mlflow import MlflowClient

    tags = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_model_version(CHILD, exported["model_version"]).tags
    assert tags["pipprune.parent_version"] == compressed["model_version"] and tags["pipprune.gguf.quant"] == "q8_0"
    assert tags["pipprune.gguf.sha256"] == exported["sha256"]
    again = cli(env, "export", NAME, "--version", compressed["model_version"], "--quant", "q8_0", "--json")
    assert again.returncode == 0 and _doc(again)["exports"][0]["model_version"] == exported["model_version"]


def test_lineage_walks_from_the_gguf_to_the_dense_source(env, compressed, exported, tiny_reference_dir):
    done = cli(env, "lineage", CHILD, "--version", exported["model_version"], "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    lineage = _doc(done)
    assert lineage["problems"] == []
    assert lineage["export"]["file_verified"] and lineage["export"]["parent_version"] == compressed["model_version"]
    assert lineage["signature"]["verified"] and lineage["parent_signature"]["verified"]
    assert lineage["source_model"] == str(tiny_reference_dir) and [i["iteration"] for i in lineage["iterations"]] == [1]
    table = cli(env, "lineage", CHILD, "--version", exported["model_version"])
    assert table.returncode == 0 and "GGUF file" in table.stdout and "lineage verified" in table.stdout


def test_lineage_of_the_gguf_fails_on_a_changed_file_or_parent(env, compressed, exported):
    s3 = s3_of(env)
    base = compressed["s3_uri"].split(f"s3://{BUCKET}/", 1)[1].removesuffix("model/")
    for key, expected in ((f"{base}gguf-q8_0/{exported['file']}", "GGUF file"), (f"{base}model/config.json", "parent")):
        original = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=key, Body=original + b"\0")
        try:
            done = cli(env, "lineage", CHILD, "--version", exported["model_version"])
            assert done.returncode == 1, done.stdout + done.stderr
            assert expected in done.stdout
        finally:
            s3.put_object(Bucket=BUCKET, Key=key, Body=original)


def test_promote_gates_the_gguf_on_its_own_measured_quality(env, exported, tmp_path):
    gates = tmp_path / "gates.yaml"
    gates.write_text(yaml.safe_dump({"perplexity_increase_max": 1.0, "param_reduction_min": 0.1,
                                     "metric_bounds": {"final.heldout_kl": "<= 1.0", "gguf.tokenizer_match": ">= 1"}}))
    done = cli(env, "promote", CHILD, "--version", exported["model_version"], "--alias", "champion", "--gates", str(gates))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS signature" in done.stdout and "PASS quality verdict" in done.stdout and "FAIL" not in done.stdout
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump({"metric_bounds": {"final.heldout_kl": "<= 0"}}))
    done = cli(env, "promote", CHILD, "--version", exported["model_version"], "--alias", "edge", "--gates", str(strict))
    assert done.returncode == 1 and "FAIL final.heldout_kl" in done.stdout


def test_export_refusals_are_bad_input(env, compressed, exported):
    cases = [(("export", CHILD, "--version", exported["model_version"]), "itself a GGUF export"),
             (("export", NAME, "--version", compressed["model_version"], "--quant", "q4_k"), "q4_0"),
             (("export", NAME, "--version", "99"), "not found"),
             (("export", NAME, "--version", compressed["model_version"], "--heldout", "/nonexistent.jsonl"), "heldout")]
    for args, message in cases:
        done = cli(env, *args)
        assert done.returncode == 2, (args, done.stdout + done.stderr)
        assert message in done.stderr, done.stderr
