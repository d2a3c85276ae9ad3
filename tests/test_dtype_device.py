"""dtype and device through the product, and the causal-LM loss computed in slices of the sequence.

Real tiny reference model throughout; the bf16 compress run goes through the real flow and stack.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from pip_core.importance import CalibrationData
from tests.helpers import cli

CUDA = torch.cuda.is_available()


def _texts(ref: Path, n: int) -> list[str]:
    lines = (ref / "calibration" / "calibration.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines[:n]]


def _pairs(ref: Path, n: int) -> list[tuple[str, str]]:
    from pip_core.perturb import Perturber
    from pip_core.wordlist import WordList

    words = WordList.from_file(ref / "calibration" / "wordlist.txt")
    return [(p.original, p.perturbed) for p in Perturber(words, seed=0).perturb_many(_texts(ref, n)).pairs]


@pytest.fixture(scope="module")
def tiny(tiny_reference_dir):
    from pip_core import io as core_io

    model, tok = core_io.load(tiny_reference_dir)
    assert model.dtype == torch.float32
    return model, tok


# ---------------------------------------------------------------- chunked loss


def test_chunked_pip_scores_equal_full_logits_scores(tiny, tiny_reference_dir, monkeypatch):
    from pip_core import chunked_loss, importance, units

    model, tok = tiny
    found = units.discover(model, "width")
    pairs = _pairs(tiny_reference_dir, 4)
    monkeypatch.setattr(chunked_loss, "DEFAULT_CHUNK_TOKENS", 7)  # many slices per 64-token window
    chunked = importance.score(model, "pip", found, CalibrationData(tok, pairs), max_length=64, progress=False)
    monkeypatch.setattr(importance, "per_sequence_loss", chunked_loss.full_logits_per_sequence_loss)
    full = importance.score(model, "pip", found, CalibrationData(tok, pairs), max_length=64, progress=False)
    assert torch.all(full > 0)
    torch.testing.assert_close(chunked, full, rtol=1e-4, atol=0)


def test_chunked_perplexity_equals_the_models_own_loss(tiny, tiny_reference_dir, monkeypatch):
    from pip_core import chunked_loss
    from pip_core.perplexity import perplexity

    model, tok = tiny
    texts = _texts(tiny_reference_dir, 3)
    monkeypatch.setattr(chunked_loss, "DEFAULT_CHUNK_TOKENS", 5)
    got = perplexity(model, tok, texts, max_length=48)
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt", truncation=True, max_length=48)["input_ids"]
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    assert got["tokens"] == count
    assert got["nll"] == pytest.approx(total / count, rel=1e-5)


def test_chunked_loss_applies_logit_soft_capping(tiny):
    from pip_core.chunked_loss import per_sequence_loss

    model, _ = tiny
    capped = copy.deepcopy(model)
    capped.config.final_logit_softcapping = 3.0
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logits = torch.tanh(logits / 3.0) * 3.0
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        valid = mask[:, 1:].float()
        expected = (nll * valid).sum(1) / valid.sum(1)
        got = per_sequence_loss(capped, ids, mask, chunk_tokens=6)
        uncapped = per_sequence_loss(model, ids, mask, chunk_tokens=6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, uncapped)


# ---------------------------------------------------------------- bf16 scoring


def test_bf16_and_float32_scoring_pick_the_same_units(tiny, tiny_reference_dir):
    """Measured on the tiny reference: blocks identical; width 371 of 372 units shared (Spearman 0.99999)."""
    from scipy.stats import spearmanr

    from pip_core import importance, prune, units

    model, tok = tiny
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    pairs = _pairs(tiny_reference_dir, 16)
    budget = int(0.2 * units.param_count(model))
    figures = {}
    for kind in ("block", "width"):
        found = units.discover(model, kind)
        s32 = importance.score(model, "pip", found, CalibrationData(tok, pairs), max_length=64, progress=False)
        s16 = importance.score(bf16, "pip", found, CalibrationData(tok, pairs), max_length=64, progress=False)
        assert s16.dtype == torch.float64  # accumulated in float64 whatever the weights' dtype
        picked32 = {(u.kind, u.layer, u.index) for u in prune.select(found, s32.tolist(), budget)}
        picked16 = {(u.kind, u.layer, u.index) for u in prune.select(found, s16.tolist(), budget)}
        figures[kind] = (len(picked32 & picked16) / len(picked32), spearmanr(s32, s16).correlation)
    print("bf16 vs float32 (shared fraction of chosen units, Spearman of scores):", figures)
    assert figures["block"][0] == 1.0
    assert figures["width"][0] >= 0.99 and figures["width"][1] >= 0.999


# ---------------------------------------------------------------- placement


def _llama3_8b() -> dict:
    return dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, dtype="bfloat16")


def test_placement_whole_checkpointed_spread_or_refused():
    from pip_core.placement import decide

    gib = 2**30
    whole = decide(_llama3_8b(), "cuda:0", "bfloat16", 128, free=80 * gib)
    assert (whole.device_map, whole.gradient_checkpointing, whole.fits) == (None, False, True)
    ckpt = decide(_llama3_8b(), "cuda:0", "bfloat16", 4096, free=40 * gib)
    assert (ckpt.device_map, ckpt.gradient_checkpointing, ckpt.fits) == (None, True, True)
    assert "gradient checkpointing on" in ckpt.describe()
    spread = decide(_llama3_8b(), "cuda:0", "bfloat16", 128, free=12 * gib, offload_bytes=100 * gib)
    assert (spread.device_map, spread.fits) == ("auto", True)
    assert "device_map='auto'" in spread.describe()
    cpu = decide(_llama3_8b(), "cpu", "bfloat16", 128, free=8 * gib)
    assert not cpu.fits and "does not fit" in cpu.describe()
    assert decide(_llama3_8b(), "cpu", "float32", 128, free=80 * gib).plan.weights == 2 * whole.plan.weights


def _smollm2_135m() -> dict:
    return dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, dtype="float32")


def test_activation_budget_checkpoints_a_small_model_whose_activations_outweigh_its_budget():
    """SmolLM2-135M at 128 tokens: every layer's activations are ~0.7x its fp32 weights, so a 0.5 budget checkpoints
    it although memory is plentiful; without a budget, or with a larger one, it runs whole; an 8B model never needs it."""
    from pip_core.placement import decide

    gib = 2**30
    lean = decide(_smollm2_135m(), "cpu", "float32", 128, free=20 * gib, activation_budget=0.5)
    assert lean.plan.activations < decide(_smollm2_135m(), "cpu", "float32", 128, free=20 * gib).plan.activations
    assert (lean.gradient_checkpointing, lean.lean, lean.fits) == (True, True, True)
    assert "activation budget" in lean.describe()
    for budget in (None, 1.0):
        whole = decide(_smollm2_135m(), "cpu", "float32", 128, free=20 * gib, activation_budget=budget)
        assert (whole.gradient_checkpointing, whole.lean) == (False, False)
    big = decide(_llama3_8b(), "cuda:0", "bfloat16", 128, free=80 * gib, activation_budget=0.5)
    assert big.gradient_checkpointing is False
    short = decide(_llama3_8b(), "cuda:0", "bfloat16", 4096, free=40 * gib, activation_budget=0.5)
    assert short.gradient_checkpointing and "do not fit" in short.describe()  # the reason stays memory, not budget


def test_activation_checkpointing_context_restores_the_model():
    """On inside the block (train mode, HF flag set), off and back in the caller's mode after, even on error."""
    import pytest as _pytest
    from transformers import LlamaConfig, LlamaForCausalLM

    from pip_core.recompute import activation_checkpointing

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    with activation_checkpointing(model, True):
        assert model.training and model.is_gradient_checkpointing
    assert not model.training and not model.is_gradient_checkpointing
    with _pytest.raises(RuntimeError), activation_checkpointing(model, True):
        raise RuntimeError("boom")
    assert not model.training and not model.is_gradient_checkpointing
    with activation_checkpointing(model, False):
        assert not model.training and not model.is_gradient_checkpointing


def test_logits_term_does_not_grow_with_sequence_length():
    from pip_core.memory_plan import plan_memory

    short, long = plan_memory(_llama3_8b(), "bfloat16", seq_len=512), plan_memory(_llama3_8b(), "bfloat16",
                                                                                  seq_len=8192)
    assert short.logits == long.logits
    assert long.logits < 2 * 2 * 512 * 128256 * 4  # far below one view's whole logits at seq 512


def test_auto_dtype_is_the_checkpoints_own_and_bad_specs_are_named():
    from pip_core.placement import check_device_spec, resolve_dtype

    assert resolve_dtype("auto", {"dtype": "bfloat16"}) == "bfloat16"
    assert resolve_dtype("auto", {"torch_dtype": "float16"}) == "float16"
    assert resolve_dtype("auto", {}) == "float32"
    assert resolve_dtype("bf16", {"dtype": "float32"}) == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        resolve_dtype("int4", {})
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        check_device_spec("tpu")


def test_config_file_takes_runtime_group_and_flat_keys(tmp_path):
    from pydantic import ValidationError

    from infra.config import CompressConfig, load_config_file

    path = tmp_path / "c.yaml"
    path.write_text("model: m\ncalibration: c.jsonl\nruntime: {device: cpu, dtype: bfloat16}\n")
    cfg = load_config_file(path)
    assert (cfg.runtime.device, cfg.runtime.dtype) == ("cpu", "bfloat16")
    assert load_config_file(path, dtype="float32").runtime.dtype == "float32"
    assert CompressConfig(model="m", calibration="c", device="cuda:1").runtime.device == "cuda:1"
    with pytest.raises(ValidationError, match="unknown dtype"):
        CompressConfig(model="m", calibration="c", dtype="fp8")


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_device_cuda_without_gpu_is_refused_before_any_work(tiny_reference_dir, tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "PIPPRUNE_HOME": str(home)}
    result = cli(env, "compress", "--model", str(tiny_reference_dir), "--device", "cuda", "--ratio", "0.2",
                 timeout=300)
    assert result.returncode == 2, result.stderr
    assert "--device cuda: CUDA is not available on this machine" in result.stderr
    assert not (home / "stack").exists() and not (home / "models").exists()  # nothing started, nothing written
    result = cli(env, "eval", "--model", str(tiny_reference_dir), "--tasks", "x", "--device", "cuda:0", timeout=300)
    assert result.returncode == 2 and "CUDA is not available" in result.stderr


# ---------------------------------------------------------------- bf16 through the flow


@pytest.fixture()
def bf16_source(tiny, tiny_reference_dir, tmp_path) -> Path:
    """The tiny reference converted to a bf16 checkpoint (tokenizer and calibration files copied)."""
    model, tok = tiny
    out = tmp_path / "tiny-bf16"
    shutil.copytree(tiny_reference_dir / "calibration", out / "calibration")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    return out


def _safetensors_dtypes(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    found = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            found |= {str(fh.get_slice(k).get_dtype()) for k in fh.keys()}
    return found


@pytest.mark.slow
@pytest.mark.stack
def test_bf16_checkpoint_compresses_to_a_smaller_bf16_checkpoint(local_stack, bf16_source, tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.compress import compress_flow
    from infra.config import CompressConfig
    from pip_core import io as core_io

    stack, _ = local_stack
    env = {**stack.client_env(), "PIPPRUNE_HOME": str(tmp_path / "home")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = CompressConfig(model=str(bf16_source), calibration=str(bf16_source), ratio=0.2, unit="width",
                            iterations=1, n_samples=4, heldout_samples=2, max_length=32, device="cpu",
                            registered_model_name="tiny-bf16")
    out = tmp_path / "out"
    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"],
                                     PREFECT_HOME: str(tmp_path / "home" / "prefect")}):
        summary = compress_flow(config, out_dir=str(out))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert _safetensors_dtypes(out) == {"BF16"} == _safetensors_dtypes(bf16_source)
    src_bytes = sum(p.stat().st_size for p in bf16_source.glob("*.safetensors"))
    out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    params_ratio = core_io.param_count_from_dir(out) / core_io.param_count_from_dir(bf16_source)
    print(f"bf16 source {src_bytes} B -> {out_bytes} B ({out_bytes / src_bytes:.3f}); params x{params_ratio:.3f}")
    assert summary.params_after < summary.params_before
    assert out_bytes < src_bytes
    assert out_bytes / src_bytes == pytest.approx(params_ratio, abs=0.01)  # bytes shrink with the parameters
