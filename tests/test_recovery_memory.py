"""Recovery memory (issue 47): the training plan of the real recovery batch decides how many layers are
checkpointed, and a partly checkpointed model trains to the same gradients."""

from __future__ import annotations

import pytest
import torch

from pip_core.memory_plan import layer_activations, plan_training, training_layer_activations

GIB = 2**30


def smollm2_135m() -> dict:
    return dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, dtype="float32")


def test_smollm2_at_batch_8_x_128_fits_without_checkpointing_while_a_huge_batch_needs_all_layers():
    """SmolLM2-135M's KD-LoRA recovery (LoRA on 7 linears, 2.4M parameters) at 8 x 128 tokens needs about 1.4 GiB over
    its weights with nothing checkpointed (45 MB of activations per layer, a 176 MB loss slice): given that room it
    is not checkpointed, given less it checkpoints the fewest layers that fit. 16 x 1024 tokens in 2.5 GiB needs
    every layer but the last checkpointed (the last one's backward comes first: rebuilding it saves nothing), and in
    2 GiB does not fit even so (the caller then checkpoints all and says so)."""
    plan = plan_training(smollm2_135m(), "float32", batch=8, seq_len=128, trained_params=2_400_000)
    assert 1.3 * GIB < plan.peak(0) < 1.5 * GIB
    assert plan.layers_to_checkpoint(int(1.5 * GIB)) == 0
    some = plan.layers_to_checkpoint(1 * GIB)
    assert 0 < some < 30 and plan.peak(some) <= 1 * GIB < plan.peak(some - 1)
    huge = plan_training(smollm2_135m(), "float32", batch=16, seq_len=1024, trained_params=2_400_000)
    assert huge.layers_to_checkpoint(int(2.5 * GIB)) == 29 and huge.peak(29) < huge.peak(30)
    assert huge.layers_to_checkpoint(2 * GIB) is None


def test_the_plan_grows_with_batch_length_slice_and_trained_parameters():
    base = plan_training(smollm2_135m(), "float32", 8, 128, 1000, chunk_tokens=16)
    assert plan_training(smollm2_135m(), "float32", 16, 128, 1000, chunk_tokens=16).layer == 2 * base.layer
    assert plan_training(smollm2_135m(), "float32", 8, 128, 1000, chunk_tokens=32).loss_slice == 2 * base.loss_slice
    assert plan_training(smollm2_135m(), "float32", 8, 128, 2000, chunk_tokens=16).optimizer == 2 * base.optimizer
    assert plan_training(smollm2_135m(), "bfloat16", 8, 128, 1000, chunk_tokens=16).layer == base.layer // 2
    assert base.checkpointed_layer == 8 * 128 * 576 * 4
    with pytest.raises(ValueError, match="unknown dtype"):
        plan_training(smollm2_135m(), "int3")


def test_layer_estimate_is_within_a_tenth_of_what_a_lora_layer_saves_for_backward():
    """The per-layer count against the tensors autograd actually keeps (LoRA on every linear, SDPA attention, a
    padded batch), parameters excluded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pip_core.recovery import _lora

    config = LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = _lora(LlamaForCausalLM(config), 4)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 256, (4, 96))
    mask = torch.ones_like(ids)
    mask[0, -20:] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.base_model.model.model(input_ids=ids, attention_mask=mask)
    per_layer = sum(saved.values()) / config.num_hidden_layers
    estimate = training_layer_activations(config.to_dict(), "float32", batch=4, seq_len=96)
    assert 0.9 < estimate / per_layer < 1.1, (estimate, per_layer)
    assert layer_activations(config.to_dict(), "float32", batch=4, seq_len=96) > 1.2 * per_layer  # scoring's estimate


def test_partial_checkpointing_checkpoints_the_first_layers_and_keeps_gradients():
    from transformers import LlamaConfig, LlamaForCausalLM

    from pip_core.errors import PipCoreError
    from pip_core.recompute import activation_checkpointing

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    ids = torch.randint(0, 64, (2, 16))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    with activation_checkpointing(model, True, layers=3):
        assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, True, True, False]
        partial = grads()
    assert not any(layer.gradient_checkpointing for layer in model.model.layers) and not model.training
    for name, g in plain.items():
        torch.testing.assert_close(partial[name], g, msg=name)
    with pytest.raises(PipCoreError, match="cannot checkpoint 5 layers"), activation_checkpointing(model, True, layers=5):
        pass
