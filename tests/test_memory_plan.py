"""`plan_memory` from a config alone, checked against real parameter byte counts."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pip_core.memory_plan import param_count_from_config, plan_memory


def _real_params(model_cls, config) -> int:
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


def llama3_8b() -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)


def test_llama3_8b_shape_bytes_within_10_percent():
    config = llama3_8b()
    real = _real_params(LlamaForCausalLM, config)
    plan = plan_memory(config.to_dict(), dtype="bfloat16")
    assert abs(plan.weights - real * 2) / (real * 2) < 0.10
    assert 7.9e9 < real < 8.1e9


@pytest.mark.parametrize("cls,cfg", [
    (LlamaForCausalLM, LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    (Qwen2ForCausalLM, Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
])
def test_param_count_exact_for_small_configs(cls, cfg):
    assert param_count_from_config(cfg) == _real_params(cls, cfg)


def test_checkpointing_reduces_activations_and_dtype_is_checked():
    config = llama3_8b().to_dict()
    full = plan_memory(config, dtype="bf16", seq_len=2048)
    ckpt = plan_memory(config, dtype="bf16", seq_len=2048, gradient_checkpointing=True)
    assert ckpt.activations < full.activations / 5
    assert full.peak_scoring > full.weights
    with pytest.raises(ValueError, match="dtype"):
        plan_memory(config, dtype="int3")


def test_lmeval_batch_keeps_its_logits_within_an_eighth_of_the_weights():
    """SmolLM2-135M's shape (49k vocabulary, 538 MB fp32) gets 2 items a batch, an 8B-shaped model 8."""
    from infra.lmeval import batch_size_for

    def on_meta(dtype: torch.dtype, **shape: int) -> LlamaForCausalLM:
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(**shape)).to(dtype)

    small = on_meta(torch.float32, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    large = on_meta(torch.bfloat16, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8)
    assert batch_size_for(small) == 2 and batch_size_for(large) == 8
