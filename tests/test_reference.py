"""The tiny reference model: real text, GQA Llama, local lm-eval tasks that run offline."""

import json

import pytest

from infra.calibration import load_calibration

pytestmark = pytest.mark.slow


def test_manifest_records_sources_licenses_and_quality(tiny_reference_dir):
    manifest = json.loads((tiny_reference_dir / "manifest.json").read_text())
    assert manifest["sources"]["kjv"]["license"] == "public domain"
    assert manifest["sources"]["pydocs"]["license"] == "PSF-2.0"
    assert all(len(manifest["sources"][k]["sha256"]) == 64 for k in ("austen", "kjv", "pydocs", "fortunes"))
    config = manifest["config"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert manifest["heldout_perplexity"] < manifest["uniform_perplexity"] / 5
    assert manifest["training"]["final_train_loss"] < 6.0


def test_model_loads_with_stock_transformers(tiny_reference_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_reference_dir)
    tok = AutoTokenizer.from_pretrained(tiny_reference_dir)
    ids = tok("It is a truth universally acknowledged", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4


def test_calibration_is_training_text_only(tiny_reference_dir):
    persuasion = (tiny_reference_dir / "tasks" / "persuasion.jsonl").read_text().splitlines()
    heldout = [json.loads(line)["text"][:80] for line in persuasion[:10]]
    data = load_calibration(tiny_reference_dir / "calibration" / "calibration.jsonl", heldout_texts=heldout)
    assert len(data) > 500
    assert set(data["source"]) == {"austen", "kjv", "pydocs", "fortunes"}
    assert "alter" in (tiny_reference_dir / "calibration" / "wordlist.txt").read_text().split()


def test_local_tasks_run_through_lm_eval_offline(tiny_reference_dir):
    from infra.lmeval import run_lmeval

    results = run_lmeval(tiny_reference_dir, ["pipprune_wordnet_cloze", "pipprune_persuasion"],
                         include_path=tiny_reference_dir / "tasks", limit=120)
    assert results["pipprune_wordnet_cloze"]["acc"] > 0.3  # chance is 0.25
    assert 1.0 < results["pipprune_persuasion"]["byte_perplexity"] < 8.0
    with pytest.raises(ValueError, match="unknown lm-eval task"):
        run_lmeval(tiny_reference_dir, ["hellaswag_local"], include_path=tiny_reference_dir / "tasks")


@pytest.mark.parametrize("occupied", ["out", "partial"])
def test_build_never_replaces_a_folder_it_did_not_write(tmp_path, occupied):
    from typer.testing import CliRunner

    from pipprune.cli import app

    out = tmp_path / "models"
    target = out if occupied == "out" else tmp_path / "models.partial"
    target.mkdir()
    (target / "mine.bin").write_bytes(b"user data")
    result = CliRunner().invoke(app, ["reference", "build", "--size", "tiny", "--out", str(out),
                                      "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 2, result.output
    assert "refusing" in result.output or "move it away" in result.output
    assert (target / "mine.bin").read_bytes() == b"user data"
    assert not (tmp_path / "cache").exists()  # refused before the corpus or the tokenizer were touched


def test_training_in_a_log_reports_plain_lines(tiny_reference_dir, tmp_path, caplog, capsys):
    """Outside a terminal the build logs one line per 5% of its fixed step count, never carriage returns."""
    import logging

    import torch
    from transformers import AutoTokenizer

    from infra.reference.train import ReferenceSize, train

    size = ReferenceSize(vocab_size=2048, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, seq_len=16, batch_size=2, steps=40, lr=1e-3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_reference_dir)
    stream = torch.randint(0, len(tokenizer), (4096,), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="infra.reference.train"):
        _, stats = train(size, tokenizer, stream, tmp_path / "log.jsonl", progress=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training step")]
    assert stats["steps"] == 40 and len(lines) == 20 and lines[-1].startswith("training step 40/40")
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err
