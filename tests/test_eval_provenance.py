"""Every evaluation figure records what produced it (issue 22, point 2): lm-eval version, task
versions, few-shot count, metric variant, sequence length, limit and the data's digest; the record
(and its digest on the registered version) changes when any of them changes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

CLOZE = "pipprune_wordnet_cloze"


def _tasks_copy(ref: Path, dest: Path, fewshot: int | None = None, drop_rows: int = 0) -> Path:
    """A private copy of the reference's cloze task (data file beside it), optionally with few-shot or fewer rows."""
    dest.mkdir()
    data = dest / "wordnet_cloze.jsonl"
    rows = (ref / "tasks" / "wordnet_cloze.jsonl").read_text().splitlines(keepends=True)
    data.write_text("".join(rows[drop_rows:]))
    text = (ref / "tasks" / f"{CLOZE}.yaml").read_text()
    text = "\n".join(f"    test: {data}" if line.strip().startswith("test:") else line for line in text.splitlines())
    if fewshot is not None:
        text += f"\nnum_fewshot: {fewshot}\n"
    (dest / f"{CLOZE}.yaml").write_text(text + "\n")
    return dest


@pytest.fixture(scope="module")
def loaded(tiny_reference_dir):
    from pip_core import io as core_io

    return core_io.load(tiny_reference_dir)


def _record(ref: Path, tasks_dir: Path, loaded, limit: int = 4) -> tuple[dict, dict]:
    from infra.lmeval import run_lmeval_recorded

    return run_lmeval_recorded(ref, [CLOZE], include_path=tasks_dir, limit=limit, loaded=loaded, device="cpu")


def test_lmeval_record_names_version_tasks_shots_metrics_length_limit_and_data(tiny_reference_dir, loaded, tmp_path):
    from importlib.metadata import version

    from infra import eval_provenance

    tasks_dir = _tasks_copy(tiny_reference_dir, tmp_path / "tasks")
    results, record = _record(tiny_reference_dir, tasks_dir, loaded)
    assert set(results[CLOZE]) >= {"acc", "acc_norm"}
    assert record["version"] == version("lm_eval") and record["limit"] == 4
    assert record["max_length"] == loaded[0].config.max_position_embeddings  # what HFLM truncates to
    task = record["tasks"][CLOZE]
    assert task["num_fewshot"] == 0 and task["version"] == 1.0 and task["documents"] == 4
    assert task["metrics"] == ["acc", "acc_norm"] and task["reported"] == ["acc,none", "acc_norm,none"]
    data = (tasks_dir / "wordnet_cloze.jsonl").read_bytes()
    assert task["dataset"]["files"] == {"test": {"name": "wordnet_cloze.jsonl", "sha256": hashlib.sha256(data).hexdigest()}}
    assert str(tmp_path) not in json.dumps(record)  # content digests, no machine paths

    # the same evaluation of a copy elsewhere records the same thing (the digest is reproducible)
    other = _tasks_copy(tiny_reference_dir, tmp_path / "elsewhere")
    assert eval_provenance.digest(_record(tiny_reference_dir, other, loaded)[1]) == eval_provenance.digest(record)

    tags = eval_provenance.tags(eval_provenance.build({"final": record}, None))
    assert tags["pipprune.eval.tasks"] == f"{CLOZE}@v1.0:0-shot:acc,none/acc_norm,none"
    assert tags["pipprune.eval.limit"] == "4" and tags["pipprune.eval.lm_eval_version"] == version("lm_eval")
    assert all(len(v) <= 5000 for v in tags.values())


def test_record_and_its_digest_change_with_the_fewshot_count_and_the_data(tiny_reference_dir, loaded, tmp_path):
    from infra import eval_provenance

    def digest_and_task(tasks_dir: Path, limit: int = 4) -> tuple[str, dict]:
        _, record = _record(tiny_reference_dir, tasks_dir, loaded, limit)
        full = eval_provenance.build({"final": record}, None)
        return eval_provenance.tags(full)["pipprune.eval.provenance_sha256"], record["tasks"][CLOZE]

    base, task = digest_and_task(_tasks_copy(tiny_reference_dir, tmp_path / "base"))
    shots, task_shots = digest_and_task(_tasks_copy(tiny_reference_dir, tmp_path / "shots", fewshot=2))
    data, task_data = digest_and_task(_tasks_copy(tiny_reference_dir, tmp_path / "data", drop_rows=1))
    fewer, _ = digest_and_task(_tasks_copy(tiny_reference_dir, tmp_path / "limit"), limit=3)
    assert task_shots["num_fewshot"] == 2 and task["num_fewshot"] == 0
    assert task_data["dataset"]["files"] != task["dataset"]["files"]
    assert len({base, shots, data, fewer}) == 4


def test_heldout_record_counts_the_tokens_the_divergence_metric_scores(tiny_reference_dir, loaded):
    from infra import eval_provenance
    from pip_core.divergence import divergence, read_texts

    model, tokenizer = loaded
    texts = read_texts(tiny_reference_dir / "tasks" / "persuasion.jsonl")[:6]
    held = eval_provenance.heldout_record(tokenizer, texts, 64, "test")
    assert held["tokens"] == divergence(model, model, tokenizer, texts, max_length=64)["tokens"]
    assert held["documents"] == 6 and held["max_length"] == 64
    changed = eval_provenance.heldout_record(tokenizer, texts[:5], 64, "test")
    longer = eval_provenance.heldout_record(tokenizer, texts, 128, "test")
    assert changed["sha256"] != held["sha256"] and longer["tokens"] > held["tokens"]
    digests = {eval_provenance.digest(eval_provenance.build({}, h)) for h in (held, changed, longer)}
    assert len(digests) == 3
    tags = eval_provenance.tags(eval_provenance.build({}, held))
    assert tags["pipprune.eval.heldout_tokens"] == str(held["tokens"])
    assert tags["pipprune.eval.heldout_sha256"] == held["sha256"]


def test_eval_cli_prints_the_provenance(tiny_reference_dir, tmp_path):
    import os

    from tests.helpers import cli

    tasks_dir = _tasks_copy(tiny_reference_dir, tmp_path / "tasks")
    out = cli(dict(os.environ), "eval", "--model", str(tiny_reference_dir), "--tasks", CLOZE, "--include-path",
              str(tasks_dir), "--limit", "3", "--device", "cpu", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    prov = doc["provenance"]
    assert prov["lm_eval"]["model"]["tasks"][CLOZE]["num_fewshot"] == 0
    assert prov["lm_eval"]["model"]["limit"] == 3
    from infra import eval_provenance

    assert prov["sha256"] == eval_provenance.digest({k: v for k, v in prov.items() if k != "sha256"})
