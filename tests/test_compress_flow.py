"""The compress pipeline end to end against the real local stack (SeaweedFS S3, MLflow and Prefect servers).

One full run on the tiny reference model, then: the identical rerun is served without gradient
collection, a run killed with SIGKILL mid-iteration resumes and ends identical, and an S3
endpoint that fails its first requests is survived by retries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import NO_SERVING, FlakyS3Proxy, s3_of

pytestmark = [pytest.mark.slow, pytest.mark.stack]

ROOT = Path(__file__).resolve().parents[1]



def _apply(env: dict[str, str], monkeypatch) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def _config(ref_dir: Path, **overrides):
    from infra.config import CompressConfig

    fields = dict(model=str(ref_dir), calibration=str(ref_dir), ratio=0.2, unit="width", method="pip",
                  iterations=2, n_samples=8, heldout_samples=4, max_length=64,
                  eval_tasks=("pipprune_wordnet_cloze",), eval_include_path=str(ref_dir / "tasks"), eval_limit=40,
                  registered_model_name="tiny-pip", serving={"measure": False})
    fields.update(overrides)
    return CompressConfig(**fields)


def _run_flow(env: dict[str, str], config, **kwargs):
    """Run the flow in-process with Prefect and settings pointed at `env` (`kwargs`: the flow's out_dir, ...)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.compress import compress_flow

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"],
                                     PREFECT_HOME: str(Path(env["PIPPRUNE_HOME"]) / "prefect")}):
        return compress_flow(config, **kwargs)


def _task_run_names(flow_run_id: str) -> list[str]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def names():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return [(r.name, r.state.name if r.state else "") for r in runs]

    return asyncio.run(names())


@pytest.fixture(scope="module")
def first_run(stack_env, tiny_reference_dir):
    from pip_core import io as core_io

    mp = pytest.MonkeyPatch()
    _apply(stack_env, mp)
    loads: list[str] = []
    real_load = core_io.load
    mp.setattr(core_io, "load", lambda path, *a, **k: loads.append(str(path)) or real_load(path, *a, **k))
    started = time.perf_counter()
    summary = _run_flow(stack_env, _config(tiny_reference_dir, serving={"measure": True}))  # the whole flow
    elapsed = time.perf_counter() - started
    mp.setattr(core_io, "load", real_load)
    yield summary, elapsed, loads
    mp.undo()


def test_full_run_tracks_checkpoints_and_registers(first_run, stack_env, tiny_reference_dir, monkeypatch, tmp_path):
    _apply(stack_env, monkeypatch)
    summary, _, loads = first_run
    # the source is read once: it is measured (held-out log-probabilities to disk, lm-eval, serving, samples) while
    # it is the model in hand, then pruned in place; every other model is handed from task to task in memory
    assert [str(Path(p).resolve()) for p in loads] == [str(tiny_reference_dir.resolve())], loads
    assert abs(summary.achieved_ratio - 0.2) < 0.05
    assert summary.params_after < summary.params_before

    from mlflow import MlflowClient

    client = MlflowClient(stack_env["MLFLOW_TRACKING_URI"])
    history = client.get_metric_history(summary.mlflow_run_id, "num_params")
    assert sorted(m.step for m in history) == [1, 2]
    assert history[-1].value == summary.params_after
    assert [m.step for m in client.get_metric_history(summary.mlflow_run_id, "heldout_perplexity")] == [1, 2]
    kl = [m.value for m in sorted(client.get_metric_history(summary.mlflow_run_id, "heldout_kl"), key=lambda m: m.step)]
    assert len(kl) == 2 and 0 < kl[0] < kl[1] and summary.metrics_after["heldout_kl"] == kl[1]
    assert summary.metrics_before["heldout_kl"] == 0.0 and 0 < summary.metrics_after["heldout_top1_agreement"] < 1
    files = {a.path for a in client.list_artifacts(summary.mlflow_run_id, "iterations/iter-1")}
    assert {"iterations/iter-1/score_table.csv", "iterations/iter-1/unit_scores.png",
            "iterations/iter-1/units_removed.json"} <= files
    run = client.get_run(summary.mlflow_run_id)
    assert "final.pipprune_wordnet_cloze.acc" in run.data.metrics

    s3 = s3_of(stack_env)
    bucket = os.environ.get("PIPPRUNE_S3_BUCKET", "pipprune")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"runs/{summary.run_key}/")["Contents"]}
    for i in (1, 2):
        assert f"runs/{summary.run_key}/iter-{i}/manifest.json" in keys
        assert f"runs/{summary.run_key}/iter-{i}/model/model.safetensors" in keys
        assert f"runs/{summary.run_key}/iter-{i}/score_table.csv" in keys

    version = client.get_model_version("tiny-pip", summary.model_version)
    assert version.tags["pipprune.run_key"] == summary.run_key
    assert version.tags["pipprune.s3_uri"] == summary.s3_uri
    assert version.run_id == summary.mlflow_run_id

    # what produced the figures: eval_provenance.json on the run, its digest and key fields on run and version
    from infra import eval_provenance

    record = json.loads(Path(client.download_artifacts(summary.mlflow_run_id, eval_provenance.ARTIFACT,
                                                       str(tmp_path))).read_text())
    digest = eval_provenance.digest(record)
    assert version.tags["pipprune.eval.provenance_sha256"] == run.data.tags["pipprune.eval.provenance_sha256"] == digest
    assert version.tags["pipprune.eval.tasks"] == "pipprune_wordnet_cloze@v1.0:0-shot:acc,none/acc_norm,none"
    assert version.tags["pipprune.eval.limit"] == "40" and set(record["lm_eval"]) == {"final", "source"}
    assert record["heldout"]["documents"] == 4 and record["heldout"]["max_length"] == 64
    assert int(version.tags["pipprune.eval.heldout_tokens"]) == record["heldout"]["tokens"] > 0


def test_repair_runs_after_each_step_and_is_recorded(first_run, stack_env, tiny_reference_dir, monkeypatch):
    """repair: lstsq refits each step's pruned layers before its quick eval: the same units go at step 1 (scored
    before any repair) and the held-out KL to dense is lower than the unrepaired run's; every step's figures reach
    MLflow, the checkpoint manifest, the version's tags and the summary."""
    _apply(stack_env, monkeypatch)
    from mlflow import MlflowClient

    from infra.s3store import CheckpointStore
    from infra.settings import Settings

    plain, _, _ = first_run
    summary = _run_flow(stack_env, _config(tiny_reference_dir, repair="lstsq", registered_model_name="tiny-repair"))
    assert summary.params_after == plain.params_after
    assert summary.repair["form"] == "lstsq" and [s["iteration"] for s in summary.repair["steps"]] == [1, 2]
    for step in summary.repair["steps"]:
        assert step["consumers"] > 0 and 0 <= step["error_after"] < step["error_before"], step

    client = MlflowClient(stack_env["MLFLOW_TRACKING_URI"])

    def kl(run_id: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, "heldout_kl")}

    assert kl(summary.mlflow_run_id)[1] < kl(plain.mlflow_run_id)[1]
    assert [m.step for m in client.get_metric_history(summary.mlflow_run_id, "repair_error_after")] == [1, 2]
    stages = {ref.iteration: ref for ref in CheckpointStore.from_settings(Settings(), summary.run_key)
              .complete_checkpoints()}
    plain_stages = {ref.iteration: ref for ref in CheckpointStore.from_settings(Settings(), plain.run_key)
                    .complete_checkpoints()}
    assert stages[1].metadata["units_removed"] == plain_stages[1].metadata["units_removed"]
    assert stages[2].metadata["metrics"]["repair_error_after"] == summary.repair["steps"][1]["error_after"]
    version = client.get_model_version("tiny-repair", summary.model_version)
    assert version.tags["pipprune.repair"] == "lstsq"
    assert client.get_model_version("tiny-pip", plain.model_version).tags["pipprune.repair"] == "none"


def test_vocabulary_is_trimmed_first_counted_towards_the_target_and_recorded(first_run, stack_env, tiny_reference_dir,
                                                                             monkeypatch, tmp_path):
    """vocab: CORPUS trims the vocabulary before any unit is scored: the ratio is still of the model as given, the
    trimmed rows count towards it so the layers lose less than in the run without it (attention keeps both KV
    groups), the output keeps only the corpus's tokens and encodes it as before, KD's teacher is the trimmed dense
    model, and the version's lineage names the corpus and the kept ids' hash (and checks out)."""
    _apply(stack_env, monkeypatch)
    from mlflow import MlflowClient
    from transformers import AutoConfig, AutoTokenizer

    from infra.config import RecoverySettings
    from infra.lineage import trace
    from infra.s3store import CheckpointStore
    from infra.settings import Settings
    from infra.vocab_source import read_trim_record
    from pip_core.vocab_trim import VocabTrim

    plain, _, _ = first_run
    rows = (tiny_reference_dir / "calibration" / "calibration.jsonl").read_text().splitlines()[:30]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(rows) + "\n")
    config = _config(tiny_reference_dir, vocab_corpus=str(corpus), registered_model_name="tiny-vocab",
                     recovery=RecoverySettings(steps=4, batch_size=2, kind="kd"))
    summary = _run_flow(stack_env, config, out_dir=str(tmp_path / "out"))
    vocab = summary.vocab
    assert vocab is not None and vocab["vocab_before"] == 2048 and 1000 < vocab["vocab_after"] < 1500
    assert summary.params_before == plain.params_before  # the ratio is of the model as given
    # the same ratio reached (64-channel alignment makes both runs overshoot 0.2 alike), by other means
    assert abs(summary.achieved_ratio - plain.achieved_ratio) < 0.01
    out = tmp_path / "out"
    final, dense = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(tiny_reference_dir)
    plain_final = AutoConfig.from_pretrained(CheckpointStore.from_settings(Settings(), plain.run_key).download_uri(
        plain.s3_uri, tmp_path / "plain"))
    assert final.vocab_size == vocab["vocab_after"]
    assert final.num_key_value_heads == dense.num_key_value_heads > plain_final.num_key_value_heads  # layers lose less

    trimmed_dir = next(Path(stack_env["PIPPRUNE_HOME"], "cache", "vocab").iterdir())
    record = read_trim_record(trimmed_dir)
    trim = VocabTrim(tuple(record["kept_ids"]), record["vocab_before"])
    before, after = AutoTokenizer.from_pretrained(tiny_reference_dir), AutoTokenizer.from_pretrained(out)
    for row in rows[:5]:
        text = json.loads(row)["text"]
        assert after.encode(text, add_special_tokens=False) == trim.remap(before.encode(text, add_special_tokens=False))

    client = MlflowClient(stack_env["MLFLOW_TRACKING_URI"])
    tags = client.get_model_version("tiny-vocab", summary.model_version).tags
    plain_tags = client.get_model_version("tiny-pip", plain.model_version).tags
    assert tags["pipprune.vocab.kept_sha256"] == record["kept_sha256"] == trim.digest == vocab["kept_sha256"]
    assert tags["pipprune.vocab.tokens"] == f"2048->{vocab['vocab_after']}"
    assert tags["pipprune.vocab.corpus_sha256"] == record["corpus_sha256"]
    assert tags["pipprune.source_fingerprint"] == plain_tags["pipprune.source_fingerprint"]  # the model as given
    assert tags["pipprune.vocab.dense_fingerprint"] != tags["pipprune.source_fingerprint"]
    assert "pipprune.vocab.kept_sha256" not in plain_tags
    lineage = trace(client, lambda key: CheckpointStore.from_settings(Settings(), key), "tiny-vocab")
    assert lineage.ok, lineage.problems
    assert lineage.iterations[-1].teacher_fingerprint == tags["pipprune.vocab.dense_fingerprint"]
    assert lineage.vocab["checked"] and lineage.vocab["kept_sha256"] == record["kept_sha256"]
    from infra.lineage import LineageError
    from tasks.export import _trimmed_dense

    assert _trimmed_dense(tags, Settings()) == trimmed_dir  # what `pipprune export` of this version starts from
    record_path = trimmed_dir / "vocab_trim.json"
    original = record_path.read_text()
    record_path.write_text(json.dumps({**record, "kept_sha256": "0" * 64}))  # the cached copy no longer matches
    try:
        changed = trace(client, lambda key: CheckpointStore.from_settings(Settings(), key), "tiny-vocab")
        with pytest.raises(LineageError, match="kept ids sha256"):
            _trimmed_dense(tags, Settings())
    finally:
        record_path.write_text(original)
    assert not changed.ok and any("kept ids sha256" in p for p in changed.problems)

    import io as stdio

    from rich.console import Console

    from pipprune.commands.summary import _print_vocab

    printed = stdio.StringIO()
    _print_vocab(Console(file=printed, width=400), summary.vocab)
    assert f"vocabulary: 2,048 -> {vocab['vocab_after']:,} tokens" in printed.getvalue()
    assert record["kept_sha256"][:16] in printed.getvalue()


def test_flow_and_prune_iteratively_remove_the_same_units(first_run, stack_env, tiny_reference_dir):
    """The benchmarks' loop (pip_core.schedule.prune_iteratively) is the product's loop: same units, step by step."""
    from pip_core import io as core_io
    from pip_core import schedule
    from pip_core.importance import CalibrationData
    from tasks.scoring import scoring_options

    summary, *_ = first_run
    config = _config(tiny_reference_dir)
    bucket = os.environ.get("PIPPRUNE_S3_BUCKET", "pipprune")
    flow_units = []
    for i in (1, 2):
        body = s3_of(stack_env).get_object(Bucket=bucket, Key=f"runs/{summary.run_key}/iter-{i}/manifest.json")["Body"]
        flow_units.append([(u["kind"], u["layer"], u["index"]) for u in json.loads(body.read())["metadata"]["units_removed"]])
    [pairs_file] = [p for p in Path(stack_env["PIPPRUNE_HOME"], "work", "calibration").rglob("pairs.jsonl")
                    if "-t0-" in p.parent.name]  # the first run's: no recovery texts (other tests' runs draw some)
    pairs = [(row["original"], row["perturbed"]) for row in map(json.loads, pairs_file.read_text().splitlines())]
    model, tokenizer = core_io.load(tiny_reference_dir)
    options = scoring_options(config.scoring, config.calibration.max_length)  # the flow's own mapping (align too)
    result = schedule.prune_iteratively(model, CalibrationData(tokenizer, pairs), options, config.ratio,
                                        config.scoring.iterations, seed=config.seed, progress=False)
    loop_units = [[(u.kind, u.layer, u.index) for u in step.removed] for step in result.steps]
    assert loop_units == flow_units
    assert result.params_after == summary.params_after


def test_identical_rerun_is_served_without_gradient_collection(first_run, stack_env, tiny_reference_dir,
                                                               monkeypatch):
    _apply(stack_env, monkeypatch)
    summary, *_ = first_run
    again = _run_flow(stack_env, _config(tiny_reference_dir))
    assert again.run_key == summary.run_key
    assert again.model_version == summary.model_version  # idempotent registration
    assert again.params_after == summary.params_after
    from mlflow import MlflowClient

    flow_run_id = MlflowClient(stack_env["MLFLOW_TRACKING_URI"]).get_run(again.mlflow_run_id).data.tags[
        "pipprune.prefect_flow_run_id"]
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: stack_env["PREFECT_API_URL"]}):
        names = _task_run_names(flow_run_id)
    assert names, "the rerun's task runs were not recorded"
    assert not [n for n, _ in names if n.startswith("score-units")], names
    assert not [n for n, _ in names if n.startswith("prune-step")], names
    # how much faster that is belongs to benchmarks/overhead.py (rerun speedup), not to a timed test


def _cli(env: dict[str, str], *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipprune.cli", *args], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=ROOT, **kwargs)


def _cli_args(ref: Path, seed: int) -> list[str]:
    return ["compress", "--model", str(ref), "--calibration", str(ref), "--ratio", "0.2", "--unit", "mlp", "--method", "pip",
            "--iterations", "3", "--n-samples", "6", "--seed", str(seed), "--tasks", "pipprune_wordnet_cloze",
            "--include-path", str(ref / "tasks"), "--eval-limit", "10", "--name", "tiny-resume", "--json",
            *NO_SERVING]


def _manifest_exists(env: dict[str, str], bucket: str, iteration: int) -> bool:
    s3 = s3_of(env)
    listing = s3.list_objects_v2(Bucket=bucket, Prefix="runs/")
    return any(o["Key"].endswith(f"/iter-{iteration}/manifest.json") for o in listing.get("Contents", []))


def test_killed_run_resumes_and_matches_uninterrupted(stack_env, tiny_reference_dir, tmp_path):
    s3 = s3_of(stack_env)
    for bucket in ("resume-clean", "resume-killed"):
        s3.create_bucket(Bucket=bucket)
    clean_env = {**stack_env, "PIPPRUNE_S3_BUCKET": "resume-clean", "PIPPRUNE_HOME": str(tmp_path / "clean")}
    killed_env = {**stack_env, "PIPPRUNE_S3_BUCKET": "resume-killed", "PIPPRUNE_HOME": str(tmp_path / "killed")}
    clean = _cli(clean_env, *_cli_args(tiny_reference_dir, seed=3))
    out, _ = clean.communicate(timeout=600)
    assert clean.returncode == 0, out
    reference = json.loads(out[out.index("{"):])

    victim = _cli(killed_env, *_cli_args(tiny_reference_dir, seed=3))
    deadline = time.time() + 300
    while not _manifest_exists(killed_env, "resume-killed", 1):
        assert victim.poll() is None, victim.stdout.read()
        assert time.time() < deadline, "iteration 1 never completed"
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not _manifest_exists(killed_env, "resume-killed", 3)

    resumed = _cli(killed_env, *_cli_args(tiny_reference_dir, seed=3))
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    summary = json.loads(out[out.index("{"):])
    assert summary["iterations_resumed"] >= 1
    assert summary["run_key"] == reference["run_key"]

    def manifest_files(bucket: str) -> dict:
        key = f"runs/{reference['run_key']}/iter-3/manifest.json"
        manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        return {path: entry["sha256"] for path, entry in manifest["files"].items() if path.startswith("model/")}

    assert manifest_files("resume-killed") == manifest_files("resume-clean")


def test_s3_failing_first_attempts_is_survived_by_retries(stack_env, tiny_reference_dir, tmp_path,
                                                          monkeypatch):
    s3_of(stack_env).create_bucket(Bucket="flaky")
    proxy = FlakyS3Proxy(stack_env["PIPPRUNE_S3_ENDPOINT_URL"], failures=6)
    try:
        env = {**stack_env, "PIPPRUNE_S3_ENDPOINT_URL": proxy.url, "PIPPRUNE_S3_BUCKET": "flaky",
               "PIPPRUNE_HOME": str(tmp_path / "home")}
        _apply(env, monkeypatch)
        summary = _run_flow(env, _config(tiny_reference_dir, unit="mlp", iterations=1, eval_tasks=(),
                                         registered_model_name="tiny-flaky"))
    finally:
        proxy.close()
    assert proxy.failed == 6 and proxy.forwarded > 0
    listing = s3_of(stack_env).list_objects_v2(Bucket="flaky", Prefix=f"runs/{summary.run_key}/iter-1/")
    assert any(o["Key"].endswith("manifest.json") for o in listing["Contents"])


@pytest.mark.parametrize("kind", ["lora", "kd"])
def test_recovery_stage_is_checkpointed_tracked_traced_and_resumed(stack_env, tiny_reference_dir,
                                                                    monkeypatch, tmp_path, kind):
    """Recovery (off by default; LoRA on the LM loss, or KD from the dense model) runs after the last pruning
    step as checkpoint stage N+1."""
    _apply(stack_env, monkeypatch)
    from mlflow import MlflowClient

    from infra.config import RecoverySettings
    from infra.lineage import trace
    from infra.s3store import CheckpointStore
    from infra.settings import Settings
    from pip_core import io as core_io

    assert not _config(tiny_reference_dir).recovery.enabled  # off unless asked for
    config = _config(tiny_reference_dir, iterations=1, ratio=0.3, eval_limit=10, registered_model_name=f"tiny-{kind}",
                     recovery=RecoverySettings(steps=25, batch_size=4, kind=kind, temperature=2.0))
    summary = _run_flow(stack_env, config)
    assert summary.metrics_before_recovery and "heldout_perplexity" in summary.metrics_before_recovery
    assert summary.s3_uri.endswith("/iter-2/model/")

    store = CheckpointStore.from_settings(Settings(), summary.run_key)
    stages = {ref.iteration: ref for ref in store.complete_checkpoints()}
    assert sorted(stages) == [1, 2]
    assert stages[2].metadata["stage"] == "recovery"
    assert "score_table.csv" not in stages[2].files
    assert stages[2].metadata["pruned_model_fingerprint"] == stages[1].metadata["model_fingerprint"]
    assert stages[2].metadata["model_fingerprint"] != stages[1].metadata["model_fingerprint"]

    client = MlflowClient(stack_env["MLFLOW_TRACKING_URI"])
    losses = [m.value for m in sorted(client.get_metric_history(summary.mlflow_run_id, "recovery_train_loss"),
                                      key=lambda m: m.step)]
    assert len(losses) == 25 and sum(losses[-5:]) < sum(losses[:5])
    ppl = {m.step: m.value for m in client.get_metric_history(summary.mlflow_run_id, "heldout_perplexity")}
    assert set(ppl) == {1, 2} and ppl[2] == summary.metrics_after["heldout_perplexity"]
    assert ppl[1] == summary.metrics_before_recovery["heldout_perplexity"]

    lineage = trace(client, lambda key: CheckpointStore.from_settings(Settings(), key), f"tiny-{kind}")
    assert lineage.ok, lineage.problems
    assert [(it.iteration, it.stage) for it in lineage.iterations] == [(1, "prune"), (2, "recovery")]
    assert stages[2].metadata["recovery"]["kind"] == kind
    assert stages[2].metadata["metrics"]["recovery_tokens"] > 25 * 4  # 25 batches of 4 texts
    version = client.get_model_version(f"tiny-{kind}", summary.model_version)
    assert version.tags["pipprune.recovery_kind"] == kind
    if kind == "kd":  # the dense source taught it, and lineage says so
        assert lineage.iterations[1].teacher_fingerprint == lineage.source_fingerprint
        assert version.tags["pipprune.recovery_temperature"] == "2.0"
        # distillation brings the model's distribution closer to the dense one, on texts it never trained on
        kl = {m.step: m.value for m in client.get_metric_history(summary.mlflow_run_id, "heldout_kl")}
        assert kl[2] < kl[1], kl
    else:
        assert lineage.iterations[1].teacher_fingerprint is None

    # the merged model is a plain HF directory with the pruned parameter count
    local = store.download_uri(summary.s3_uri, tmp_path / "recovered")
    net, _ = core_io.load(local)
    assert core_io.param_count(net) == summary.params_after
    assert not any("lora" in name for name, _ in net.named_parameters())

    # a fresh machine (new state dir, empty task cache) resumes both stages from S3: no training again
    monkeypatch.setenv("PIPPRUNE_HOME", str(tmp_path / "fresh-home"))
    again = _run_flow({**stack_env, "PIPPRUNE_HOME": str(tmp_path / "fresh-home")}, config)
    assert again.iterations_resumed == 2 and again.s3_uri == summary.s3_uri
    flow_run_id = client.get_run(again.mlflow_run_id).data.tags["pipprune.prefect_flow_run_id"]
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: stack_env["PREFECT_API_URL"]}):
        names = [n for n, _ in _task_run_names(flow_run_id)]
    assert names and not [n for n in names if n.startswith(("recover", "prune-step"))], names
