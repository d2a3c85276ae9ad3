"""GGUF export (infra.gguf_write): files written with the `gguf` package, read back by someone else's code.

Every check reads the file through transformers' GGUF loader (`from_pretrained(dir, gguf_file=...)`), not
through pipprune: the logits of the model rebuilt from the file must match the model directory's, and the
tokenizer rebuilt from the file must encode text to the same ids.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra.gguf_write import GgufExportError, check_exportable, producible_quants, write_gguf
from pip_core import io, prune, schedule, units
from pip_core.importance import CalibrationData
from tests.helpers import bpe_tokenizer, tiny_family_model

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. 1811, 42 pounds!")
#: max |logit difference| against the model directory, per type (tiny reference logits reach about 10)
TOLERANCE = {"f32": 1e-5, "f16": 0.02, "q8_0": 0.3}


def _read_back(model_dir, name):
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir, gguf_file=name)


def _compare(model_dir, gguf_name, quant, text=TEXT) -> tuple[float, float]:
    """(max |logit diff|, top-1 agreement) of the file read back by transformers against the directory."""
    model, tok = io.load(model_dir, dtype=torch.float32)
    back, back_tok = _read_back(model_dir, gguf_name)
    ids = tok(text, return_tensors="pt").input_ids
    assert back_tok(text, return_tensors="pt").input_ids.tolist() == ids.tolist(), "tokenizer read back differs"
    with torch.no_grad():
        a, b = model(ids).logits, back(ids).logits
    return (a - b).abs().max().item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@pytest.fixture(scope="module")
def reference_copy(tiny_reference_dir, tmp_path_factory):
    """The tiny reference's model files in a scratch directory (GGUF files are written beside them)."""
    out = tmp_path_factory.mktemp("ref") / "tiny"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_reference_dir / name, out / name)
    return out


@pytest.mark.parametrize("quant", ["f32", "f16", "q8_0"])
def test_tiny_reference_reads_back_with_its_logits_and_token_ids(reference_copy, quant):
    info = write_gguf(reference_copy, reference_copy / f"tiny-{quant}.gguf", quant)
    assert info.quant == quant and info.arch == "llama" and info.n_vocab == 2048
    assert info.n_tensors == 56 and not info.fallbacks  # a tied head is not written
    if quant != "f32":  # the 13 1-D norms stay F32 whatever the type
        assert info.tensor_types == {"F32": 13, quant.upper(): 43}
    diff, top1 = _compare(reference_copy, info.path.name, quant)
    assert diff <= TOLERANCE[quant], diff
    assert top1 >= (1.0 if quant != "q8_0" else 0.95)
    again = write_gguf(reference_copy, reference_copy / f"again-{quant}.gguf", quant)
    assert again.sha256 == info.sha256, "same directory and type, same bytes"


@pytest.fixture(scope="module")
def pruned_dirs(tiny_reference_dir, tmp_path_factory):
    """The tiny reference with one block removed, and with uniform widths (one KV group, 64 MLP channels fewer
    in every layer): both keep the stock LlamaConfig."""
    base = tmp_path_factory.mktemp("pruned")
    model, tok = io.load(tiny_reference_dir, dtype=torch.float32)
    prune.apply(model, [units.discover(model, "block")[2]])
    block = io.save_pruned(model, tok, base / "block")
    model, tok = io.load(tiny_reference_dir, dtype=torch.float32)
    prune.apply(model, [u for u in units.discover(model, "attn") if u.index == 0]
                + [u for u in units.discover(model, "mlp") if u.index < 64])
    width = io.save_pruned(model, tok, base / "width")
    return {"block": block, "width": width}


@pytest.mark.parametrize("kind", ["block", "width"])
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_block_and_uniform_width_outputs_read_back(pruned_dirs, kind, quant):
    model_dir = pruned_dirs[kind]
    config = json.loads((model_dir / "config.json").read_text())
    info = write_gguf(model_dir, model_dir / f"{kind}-{quant}.gguf", quant)
    diff, top1 = _compare(model_dir, info.path.name, quant)
    assert diff <= TOLERANCE[quant] and top1 >= 0.95, (diff, top1)
    back, _ = _read_back(model_dir, info.path.name)
    assert back.config.num_hidden_layers == config["num_hidden_layers"]
    assert back.config.num_attention_heads == config["num_attention_heads"]
    assert back.config.intermediate_size == config["intermediate_size"]
    if kind == "width" and quant == "q8_0":
        # 2 heads x head_dim 24 = 48 input columns of attn_output: not whole Q8_0 blocks of 32, so F16 (as llama.cpp)
        assert sorted(info.fallbacks) == [f"blk.{i}.attn_output.weight" for i in range(6)]


# ------------------------------------------------------------------------------------ every family
#: llama.cpp's llama architecture has no window; transformers' loader takes qwen3's head_dim from the class default
FAMILY_OVERRIDES = {"mistral": {"sliding_window": None}, "qwen3": {"head_dim": 128}}


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer([TEXT, "The host said he would come later to the party at the house."])


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"])
def test_each_exportable_family_reads_back_exactly_in_f32(tok, tmp_path, model_type):
    model = tiny_family_model(model_type, len(tok), **FAMILY_OVERRIDES.get(model_type, {}))
    out = io.save_pruned(model, tok, tmp_path / model_type)
    info = write_gguf(out, out / "m.gguf", "f32")
    back, back_tok = _read_back(out, "m.gguf")
    ids = tok(TEXT, return_tensors="pt").input_ids
    assert back_tok(TEXT, return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():
        assert (model(ids).logits - back(ids).logits).abs().max().item() <= 1e-5, info.arch


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_block_pruned_families_read_back(tok, tmp_path, model_type):
    """Block removal in families with per-layer lists (layer_types): removing two neighbours keeps gemma2's
    sliding/full alternation, which is all GGUF can state (llama.cpp alternates by layer index)."""
    model = tiny_family_model(model_type, len(tok))
    prune.apply(model, [units.discover(model, "block")[1], units.discover(model, "block")[2]])
    out = io.save_pruned(model, tok, tmp_path / model_type)
    info = write_gguf(out, out / "m.gguf", "f32")
    back, _ = _read_back(out, "m.gguf")
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert (model(ids).logits - back(ids).logits).abs().max().item() <= 1e-5, info.arch


# ------------------------------------------------------------------------------------ refusals
def _no_gguf_written(path) -> bool:
    return not any(path.glob("*.gguf*"))


def test_per_layer_widths_are_refused_before_any_work(tok, tmp_path):
    model = tiny_family_model("llama", len(tok), seed=1)
    options = schedule.ScoringOptions("magnitude", "width", protect_first=1, protect_last=1, width_mode="per_layer")
    schedule.prune_iteratively(model, CalibrationData(tok), options, 0.2, 1, progress=False)
    out = io.save_pruned(model, tok, tmp_path / "per-layer")
    with pytest.raises(GgufExportError, match="per-layer widths"):
        write_gguf(out, out / "m.gguf", "f16")
    assert _no_gguf_written(out)


@pytest.mark.parametrize(("model_type", "overrides", "why"), [
    ("olmo2", {}, "cannot read olmo2"),
    ("gemma3_text", {}, "two RoPE bases"),
    ("mistral", {"sliding_window": 4}, "no sliding window"),
    ("qwen3", {"head_dim": 32}, "head_dim: model 32, as read back 128"),
])
def test_families_gguf_cannot_express_are_refused_naming_why(tok, tmp_path, model_type, overrides, why):
    model = tiny_family_model(model_type, len(tok), **overrides)
    out = io.save_pruned(model, tok, tmp_path / model_type)
    with pytest.raises(GgufExportError, match=why):
        check_exportable(out, "f16")
    with pytest.raises(GgufExportError, match=why):
        write_gguf(out, out / "m.gguf", "f16")
    assert _no_gguf_written(out)


def test_a_shape_the_reader_would_rebuild_differently_is_refused(tok, tmp_path):
    """Qwen2 with a KV group removed: head_dim is no longer hidden/heads, and transformers' GGUF loader derives it
    from those for qwen2; the metadata read-back check names the field."""
    model = tiny_family_model("qwen2", len(tok))
    prune.apply(model, [u for u in units.discover(model, "attn") if u.index == 0])
    out = io.save_pruned(model, tok, tmp_path / "qwen2-width")
    with pytest.raises(GgufExportError, match="head_dim"):
        write_gguf(out, out / "m.gguf", "f16")
    assert _no_gguf_written(out)


def test_quant_types_are_those_the_gguf_package_produces(reference_copy):
    assert {"f32", "f16", "bf16", "q8_0", "q4_0"} <= set(producible_quants())
    with pytest.raises(GgufExportError, match="q8_0"):
        write_gguf(reference_copy, reference_copy / "k.gguf", "q4_k")


def test_the_file_states_what_llama_cpp_reads(reference_copy):
    """The keys llama.cpp's loader requires for a llama model and a byte-level BPE vocabulary, read with gguf's reader."""
    import gguf

    info = write_gguf(reference_copy, reference_copy / "keys.gguf", "q8_0")
    reader = gguf.GGUFReader(info.path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    config = json.loads((reference_copy / "config.json").read_text())
    assert fields["general.architecture"] == "llama" and fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    expected = {"block_count": config["num_hidden_layers"], "embedding_length": config["hidden_size"],
                "feed_forward_length": config["intermediate_size"],
                "attention.head_count": config["num_attention_heads"],
                "attention.head_count_kv": config["num_key_value_heads"],
                "rope.dimension_count": config["hidden_size"] // config["num_attention_heads"]}
    assert {k: fields[f"llama.{k}"] for k in expected} == expected
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert len(fields["tokenizer.ggml.tokens"]) == config["vocab_size"] and fields["tokenizer.ggml.merges"]
    assert fields["tokenizer.ggml.bos_token_id"] == config["bos_token_id"] and fields["tokenizer.ggml.add_bos_token"]
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied to token_embd
