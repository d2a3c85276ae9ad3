"""pip_core on tiny models built here: exact pruning, scoring, schedule, HF round trip, errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pip_core import importance, io, prune, schedule, units
from pip_core.errors import CalibrationError, PipCoreError, UnsupportedArchitectureError
from pip_core.importance import CalibrationData
from tests.helpers import pair_gradients, unit_view_differences

SENTENCES = [
    "The host said he would come later to the party at the house.",
    "A cat sat on the mat near the door and watched the bird.",
    "Every guest brought bread and wine before the night was over.",
    "She wrote a long letter to her sister about the new neighbours.",
]
PAIRS = [
    ("The host said he would come later to the party.", "The ghost said he would come alter to the party."),
    ("A cat sat on the mat near the door.", "A bat sat on the map near the door."),
    ("Every guest brought bread and wine.", "Every guest brought broad and wind."),
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(SENTENCES * 20 + [p for pair in PAIRS for p in pair] * 5,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def llama(tok, layers: int = 4, seed: int = 0, kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                                        tie_word_embeddings=True)).eval()


def _train(model: LlamaForCausalLM, tok) -> LlamaForCausalLM:
    """A few dozen steps on the sentences, so importance is not noise."""
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = tok(SENTENCES, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for _ in range(40):
        loss = model(**batch, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained(tok) -> LlamaForCausalLM:
    return _train(llama(tok, seed=1), tok)


@pytest.fixture(scope="module")
def trained_fine_attn(tok) -> LlamaForCausalLM:
    """One query head per KV group: attention alone holds enough removable groups for 20%."""
    return _train(llama(tok, seed=1, kv_heads=4), tok)


X = torch.tensor([[5, 17, 42, 99, 3, 250, 77, 12]])


def _copy_linear(dst: torch.nn.Linear, src: torch.nn.Linear, rows=None, cols=None) -> None:
    w = src.weight.data
    w = w[rows] if rows is not None else w
    w = w[:, cols] if cols is not None else w
    dst.weight.data.copy_(w)


def test_removing_an_attention_group_equals_hand_built_model(tok):
    model = llama(tok)
    pruned = copy.deepcopy(model)
    unit = next(u for u in units.discover(pruned, "attn") if u.layer == 1 and u.index == 0)
    before = units.param_count(pruned)
    prune.apply(pruned, [unit])
    assert before - units.param_count(pruned) == unit.num_params

    # hand-built: a config with 2 query heads / 1 KV head everywhere, then layer-by-layer copies
    hand = copy.deepcopy(model)
    attn, src = hand.model.layers[1].self_attn, model.model.layers[1].self_attn
    hd = attn.head_dim
    keep_q = torch.arange(2 * hd, 4 * hd)  # query heads 2,3 belong to KV group 1
    keep_kv = torch.arange(hd, 2 * hd)
    attn.q_proj = torch.nn.Linear(64, 2 * hd, bias=False)
    attn.k_proj = torch.nn.Linear(64, hd, bias=False)
    attn.v_proj = torch.nn.Linear(64, hd, bias=False)
    attn.o_proj = torch.nn.Linear(2 * hd, 64, bias=False)
    _copy_linear(attn.q_proj, src.q_proj, rows=keep_q)
    _copy_linear(attn.k_proj, src.k_proj, rows=keep_kv)
    _copy_linear(attn.v_proj, src.v_proj, rows=keep_kv)
    _copy_linear(attn.o_proj, src.o_proj, cols=keep_q)
    torch.testing.assert_close(pruned(X).logits, hand(X).logits, atol=1e-5, rtol=0)
    assert not torch.allclose(pruned(X).logits, model(X).logits, atol=1e-4)


def test_removing_mlp_channels_equals_hand_built_model(tok):
    model = llama(tok)
    pruned = copy.deepcopy(model)
    drop = [u for u in units.discover(pruned, "mlp") if u.layer == 2 and u.index % 3 == 0]
    before = units.param_count(pruned)
    prune.apply(pruned, drop)
    assert before - units.param_count(pruned) == sum(u.num_params for u in drop)
    keep = torch.tensor([c for c in range(128) if c % 3])
    hand = copy.deepcopy(model)
    mlp, src = hand.model.layers[2].mlp, model.model.layers[2].mlp
    mlp.gate_proj = torch.nn.Linear(64, len(keep), bias=False)
    mlp.up_proj = torch.nn.Linear(64, len(keep), bias=False)
    mlp.down_proj = torch.nn.Linear(len(keep), 64, bias=False)
    _copy_linear(mlp.gate_proj, src.gate_proj, rows=keep)
    _copy_linear(mlp.up_proj, src.up_proj, rows=keep)
    _copy_linear(mlp.down_proj, src.down_proj, cols=keep)
    torch.testing.assert_close(pruned(X).logits, hand(X).logits, atol=1e-5, rtol=0)


def test_removing_a_block_equals_model_without_that_layer(tok):
    model = llama(tok)
    pruned = copy.deepcopy(model)
    block = units.discover(pruned, "block")[2]
    report = prune.apply(pruned, [block])
    assert report.params_removed == block.num_params
    assert pruned.config.num_hidden_layers == 3
    hand = llama(tok, layers=3)
    state = {k: v for k, v in model.state_dict().items() if ".layers.2." not in k}
    state = {k.replace(".layers.3.", ".layers.2."): v for k, v in state.items()}
    hand.load_state_dict(state)
    torch.testing.assert_close(pruned(X).logits, hand(X).logits, atol=1e-5, rtol=0)
    assert [layer.self_attn.layer_idx for layer in pruned.model.layers] == [0, 1, 2]
    assert pruned.generate(X, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape[1] == X.shape[1] + 3


CASES = [(m, k) for m in ("pip", "random", "magnitude", "taylor") for k in ("width", "attn", "mlp", "block")]
CASES.append(("block_influence", "block"))


@pytest.mark.parametrize("method,kind", CASES)
def test_ratio_02_hits_target_and_round_trips(tok, trained, trained_fine_attn, tmp_path, method, kind):
    model = copy.deepcopy(trained_fine_attn if kind == "attn" else trained)
    biggest = max(u.num_params for u in units.discover(model, kind))
    total = units.param_count(model)
    options = schedule.ScoringOptions(method, kind, protect_first=0, protect_last=0, width_mode="per_layer")
    result = schedule.prune_iteratively(model, CalibrationData(tok, PAIRS), options, 0.2, 2, seed=0, progress=False)
    assert abs(result.achieved_ratio - 0.2) <= biggest / total
    assert result.params_after == units.param_count(model)
    io.save_pruned(model, tok, tmp_path / "m")
    config = (tmp_path / "m" / "config.json").read_text()
    per_layer = (tmp_path / "m" / "modeling_pipprune.py").exists()
    assert ('"pipprune_llama"' in config) == per_layer
    reloaded, tok2 = io.load(tmp_path / "m")
    torch.testing.assert_close(reloaded(X).logits, model(X).logits, atol=1e-5, rtol=0)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=per_layer)
    torch.testing.assert_close(stock(X).logits, model(X).logits, atol=1e-5, rtol=0)
    assert reloaded.generate(X, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape[1] == X.shape[1] + 3
    assert tok2("the host")["input_ids"] == tok("the host")["input_ids"]


def test_qwen2_width_pruning_saves_and_reloads(tok, tmp_path):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    found = units.discover(model, "width")
    assert any(u.kind == "attn" and u.num_params > 0 for u in found)
    drop = [u for u in found if (u.kind == "attn" and u.layer == 0 and u.index == 1) or
            (u.kind == "mlp" and u.layer == 1 and u.index < 20)]
    before = units.param_count(model)
    prune.apply(model, drop)
    assert before - units.param_count(model) == sum(u.num_params for u in drop)  # q/k/v biases counted
    io.save_pruned(model, tok, tmp_path / "q")
    reloaded, _ = io.load(tmp_path / "q")
    torch.testing.assert_close(reloaded(X).logits, model(X).logits, atol=1e-5, rtol=0)


def test_pip_is_deterministic_and_not_random(tok, trained):
    found = units.discover(trained, "mlp")
    a = importance.score(trained, "pip", found, CalibrationData(tok, PAIRS), seed=0, progress=False)
    b = importance.score(trained, "pip", found, CalibrationData(tok, PAIRS), seed=0, progress=False)
    assert torch.equal(a, b)
    rand = importance.score(trained, "random", found, seed=0)
    rank_a, rank_r = a.argsort().argsort().double(), rand.argsort().argsort().double()
    correlation = torch.corrcoef(torch.stack([rank_a, rank_r]))[0, 1]
    assert abs(float(correlation)) < 0.5 and not torch.equal(a.argsort(), rand.argsort())


def test_lean_pip_equals_naive_two_backward_reference(tok, trained):
    model = copy.deepcopy(trained)
    found = units.discover(model, "width")
    fast = importance.score(model, "pip", found, CalibrationData(tok, PAIRS), progress=False)
    per_pair = [pair_gradients(model, tok, pair) for pair in PAIRS]
    naive = torch.tensor([[math.sqrt(sum(float(d.double().pow(2).sum()) for d, _ in unit_view_differences(model, unit, grads)))
                           for unit in found] for grads in per_pair], dtype=torch.float64).sum(0)
    naive /= len(PAIRS)
    torch.testing.assert_close(fast, naive, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.1, float("nan"), 0.95])
def test_ratio_out_of_range(ratio):
    with pytest.raises(PipCoreError, match="ratio"):
        schedule.plan(ratio, 2)


def test_unsupported_architecture_is_named():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        units.discover(gpt2, "block")


def test_calibration_errors(tok, trained):
    found = units.discover(trained, "block")
    with pytest.raises(CalibrationError, match="empty"):
        importance.score(trained, "pip", found, CalibrationData(tok, []), progress=False)
    with pytest.raises(CalibrationError, match="text 1 is shorter than 2 tokens"):
        importance.score(trained, "pip", found, CalibrationData(tok, [PAIRS[0], ("", "x")]), progress=False)
    with pytest.raises(PipCoreError, match="block"):
        importance.score(trained, "block_influence", units.discover(trained, "mlp"),
                         CalibrationData(tok, (), texts=SENTENCES), progress=False)


def test_meta_device_model_is_refused(tok):
    with torch.device("meta"):
        model = llama(tok)
    with pytest.raises(PipCoreError, match="meta"):
        units.discover(model, "block")


def test_unreachable_target_is_refused(tok):
    model = llama(tok, layers=3)
    with pytest.raises(PipCoreError, match="cannot remove"):
        schedule.prune_iteratively(model, CalibrationData(tok), schedule.ScoringOptions("magnitude", "block"), 0.9, 1,
                                   progress=False)


def test_lora_recovery_lowers_loss_and_merges_into_a_plain_directory(tok, trained, tmp_path):
    from pip_core.perplexity import perplexity
    from pip_core.recovery import RecoveryOptions, recover_lora

    model = copy.deepcopy(trained)
    schedule.prune_iteratively(model, CalibrationData(tok),
                               schedule.ScoringOptions("magnitude", "width", protect_first=0, protect_last=0), 0.3, 1,
                               progress=False)
    before = perplexity(model, tok, SENTENCES)["perplexity"]
    model, report = recover_lora(model, tok, SENTENCES, RecoveryOptions(steps=30, batch_size=4, progress=False))
    assert perplexity(model, tok, SENTENCES)["perplexity"] < before
    assert report.last_loss < report.first_loss
    io.save_pruned(model, tok, tmp_path / "r")
    assert not list((tmp_path / "r").glob("adapter*"))
    reloaded, _ = io.load(tmp_path / "r")
    torch.testing.assert_close(reloaded(X).logits, model(X).logits, atol=1e-5, rtol=0)


def test_gradient_checkpointing_gives_the_same_pip_scores(tok, trained):
    model = copy.deepcopy(trained)
    found = units.discover(model, "width")
    plain = importance.score(model, "pip", found, CalibrationData(tok, PAIRS), progress=False)
    ckpt = importance.score(model, "pip", found, CalibrationData(tok, PAIRS), progress=False, gradient_checkpointing=True)
    torch.testing.assert_close(plain, ckpt, rtol=1e-5, atol=1e-8)
    assert not model.training and not model.is_gradient_checkpointing
