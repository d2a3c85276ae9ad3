"""GGUF files as a model input (infra.gguf_source): read back by transformers, refused by architecture.

The files are written from the tiny reference with the same writer the export uses
(infra.gguf_write), so no 93 MB wheel is needed here; the real reference has its own test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from infra.gguf_source import GgufError, dequantize_to_dir, inspect_gguf, is_gguf, read_source_record
from infra.gguf_write import write_gguf
from pip_core import io

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune."
#: max |logit difference| of the dequantized directory against the source (tiny reference logits reach ~10)
TOLERANCE = {"f32": 1e-5, "q8_0": 0.3}


@pytest.fixture(scope="module")
def gguf_files(tiny_reference_dir, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf-in")
    return {quant: write_gguf(tiny_reference_dir, folder / f"tiny.{quant}.gguf", quant=quant).path
            for quant in TOLERANCE}


@pytest.mark.parametrize("quant", sorted(TOLERANCE))
def test_a_gguf_file_dequantizes_to_the_source_model(tiny_reference_dir, gguf_files, tmp_path, quant):
    source = inspect_gguf(gguf_files[quant])
    assert is_gguf(str(gguf_files[quant])) and source.model_type == "llama" and source.architecture == "llama"
    assert quant.upper() in source.tensor_types and source.quant_types.split(",")[0] in ("F32", "Q8_0")
    out = dequantize_to_dir(source, tmp_path / "dequantized")
    record = read_source_record(out)
    assert record["sha256"] == source.sha256 and record["file"] == gguf_files[quant].name and "path" not in record
    dense, tok = io.load(tiny_reference_dir, dtype=torch.float32)
    back, back_tok = io.load(out)
    assert next(back.parameters()).dtype == torch.float32  # every GGUF type dequantizes exactly into f32
    ids = tok(TEXT, return_tensors="pt").input_ids
    assert back_tok(TEXT, return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():
        diff = (dense(ids).logits - back(ids).logits).abs().max().item()
    assert diff <= TOLERANCE[quant], (quant, diff)
    again = dequantize_to_dir(source, out)  # content-addressed: a second call reuses the directory
    assert again == out and io.model_fingerprint(out) == io.model_fingerprint(again)


def test_the_dequantized_directory_does_not_depend_on_where_the_file_lies(gguf_files, tmp_path):
    moved = tmp_path / "elsewhere" / gguf_files["f32"].name
    moved.parent.mkdir()
    shutil.copyfile(gguf_files["f32"], moved)
    a = dequantize_to_dir(inspect_gguf(gguf_files["f32"]), tmp_path / "a")
    b = dequantize_to_dir(inspect_gguf(moved), tmp_path / "b")
    assert io.model_fingerprint(a) == io.model_fingerprint(b)


def test_architectures_that_cannot_be_read_or_pruned_are_refused_naming_them(tmp_path):
    import gguf

    def header_only(arch: str) -> Path:
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_block_count(2)
        writer.add_context_length(64)
        writer.add_embedding_length(8)
        writer.add_head_count(2)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    with pytest.raises(GgufError, match="'rwkv6'.*cannot be read by transformers"):
        inspect_gguf(header_only("rwkv6"))
    with pytest.raises(GgufError, match="'gpt2'.*not a family pipprune prunes"):
        inspect_gguf(header_only("gpt2"))
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(GgufError, match="not a GGUF file"):
        inspect_gguf(not_gguf)


def test_plan_reads_only_a_gguf_header_and_refuses_a_missing_file(gguf_files, tmp_path):
    import os

    from tests.helpers import cli

    env = {**os.environ, "PIPPRUNE_HOME": str(tmp_path / "home")}
    plan = cli(env, "plan", "--model", str(gguf_files["q8_0"]), "--ratio", "0.2", "--json", timeout=300)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert json.loads(plan.stdout)["budget"]["params_after"] > 0
    assert not (tmp_path / "home" / "cache" / "gguf").exists()  # planning read the header only
    bad = cli(env, "plan", "--model", str(tmp_path / "missing.gguf"), timeout=300)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
