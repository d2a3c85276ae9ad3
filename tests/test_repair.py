"""Closed-form repair of width-pruned layers (issue 48): the streaming ridge refit against a naive one, held-out
reconstruction, save/reload with the stock class, FLAP's bias compensation, and layers that lost nothing."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers

from pip_core import families, io, prune, units
from pip_core.repair import (
    RepairError,
    RepairOptions,
    consumer_errors,
    flap_compensation,
    kept_columns,
    lost_inputs,
    repair,
)
from tests.helpers import FAMILY_CONFIGS, bpe_tokenizer, tiny_family_model

WORDS = ("the a her his cat dog house garden letter sister brother night bread wine guest door bird sat wrote "
         "brought watched near over before after long new old quiet early late came went").split()


def _texts(n: int, seed: int) -> list[str]:
    """Word strings of very different lengths (8 to 40 words): padded batches pad most rows."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "." for _ in range(n)]


CALIBRATION, HELD_OUT = _texts(48, seed=0), _texts(24, seed=1)


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(CALIBRATION + HELD_OUT)


def _pruned(dense: torch.nn.Module, choose) -> torch.nn.Module:
    """A copy of `dense` with the width units `choose(unit)` picks removed."""
    model = copy.deepcopy(dense)
    prune.apply(model, [u for u in units.discover(model, "width") if choose(u)])
    return model


def _scattered(u: units.Unit) -> bool:
    """Attention groups in layers 1 and 2, a quarter of the MLP channels in layers 0 and 2: layer 3 keeps all."""
    return (u.kind == "attn" and u.index == 0 and u.layer in (1, 2)) or (u.kind == "mlp" and u.index % 4 == 0
                                                                         and u.layer in (0, 2))


def _uniform(u: units.Unit) -> bool:
    """The same units of every layer: the stock config still describes the model."""
    return (u.kind == "attn" and u.index == 1) or (u.kind == "mlp" and u.index % 4 == 1)


def _per_text(model: torch.nn.Module, tok, modules: list[tuple[int, str]], texts: list[str], inputs: bool):
    """Each module's inputs (or outputs), one text at a time with no padding, stacked over the texts' tokens."""
    family = units.family_of(model)
    layers = families.decoder_layers(model, family)
    got: dict[tuple[int, str], list[torch.Tensor]] = {m: [] for m in modules}
    handles = []
    for key in modules:
        def hook(module, args, output, key=key):
            got[key].append((args[0] if inputs else output)[0].double())
        handles.append(families.get_module(layers[key[0]], key[1]).register_forward_hook(hook))
    with torch.no_grad():
        for text in texts:
            ids = tok(text, truncation=True, max_length=128, return_tensors="pt")["input_ids"]
            model(input_ids=ids)
    for h in handles:
        h.remove()
    return {m: torch.cat(v) for m, v in got.items()}


def _naive_ridge(x: torch.Tensor, y: torch.Tensor, ridge: float, with_bias: bool,
                 prior: torch.Tensor | None = None, relative: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """min sum_t w_t ||W x_t + b - y_t||^2 + lam ||W - prior||^2 by lstsq on the stacked rows [X 1; sqrt(lam) I 0]
    against [Y; sqrt(lam) prior^T], each token's row scaled by sqrt(w_t) = 1 / ||y_t|| when `relative` (else 1);
    b unpenalised, prior None: 0, lam = ridge x the mean diagonal of the weighted inputs' Gram matrix."""
    n = x.shape[1]
    w = (1 / y.norm(dim=1))[:, None] if relative else torch.ones(x.shape[0], 1, dtype=x.dtype)
    design = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1) if with_bias else x
    design, y = design * w, y * w
    lam = ridge * float(design[:, :n].pow(2).sum(0).mean())
    prior_rows = torch.cat([lam ** 0.5 * torch.eye(n, dtype=x.dtype), torch.zeros(n, design.shape[1] - n, dtype=x.dtype)], 1)
    target = torch.zeros(n, y.shape[1], dtype=y.dtype) if prior is None else lam ** 0.5 * prior.T.to(y.dtype)
    solution = torch.linalg.lstsq(torch.cat([design, prior_rows]), torch.cat([y, target])).solution
    return solution[:n].T, (solution[n] if with_bias else torch.zeros(y.shape[1], dtype=y.dtype))


@pytest.mark.parametrize("fit_bias,relative", [(False, True), (True, True), (False, False)])
def test_streaming_refit_equals_the_naive_ridge_least_squares(tok, fit_bias, relative):
    """Padded batches of 5 (most rows padded), Gram matrices summed in float64, layer after layer: each repaired
    consumer equals lstsq on its stacked unpadded inputs in the repaired model (its inputs do not depend on it) against
    the dense outputs, with the same ridge; with fit_bias the bias is the ones row's coefficient, unpenalised."""
    dense = tiny_family_model("llama", len(tok), seed=1)
    model = _pruned(dense, _scattered)
    pruned_weights = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    options = RepairOptions(form="lstsq", ridge=1e-2, fit_bias=fit_bias, relative=relative, batch_size=5)
    report = repair(model, dense, tok, CALIBRATION, options)
    keys = [(c.layer, c.module) for c in report.consumers]
    assert keys == [(0, "mlp.down_proj"), (1, "self_attn.o_proj"), (2, "self_attn.o_proj"), (2, "mlp.down_proj")]
    assert report.bias_switches == (["attention_bias", "mlp_bias"] if fit_bias else [])
    xs = _per_text(model, tok, keys, CALIBRATION, inputs=True)
    ys = _per_text(dense, tok, keys, CALIBRATION, inputs=False)
    assert report.tokens == next(iter(xs.values())).shape[0]
    layers = families.decoder_layers(model, families.FAMILIES["llama"])
    for key in keys:  # the ridge pulls towards the weights as pruning left them
        prior = pruned_weights[f"model.layers.{key[0]}.{key[1]}.weight"]
        weight, bias = _naive_ridge(xs[key], ys[key], options.ridge, fit_bias, prior, relative)
        module = families.get_module(layers[key[0]], key[1])
        torch.testing.assert_close(module.weight.double(), weight, rtol=1e-3, atol=1e-5)
        assert (module.bias is not None) == fit_bias
        if fit_bias:
            torch.testing.assert_close(module.bias.double(), bias, rtol=1e-3, atol=1e-5)
    for c in report.consumers:
        assert c.error_after < c.error_before, c


def test_a_strong_ridge_keeps_the_pruned_weights(tok):
    """The ridge pulls towards the layer as pruning left it: a huge one changes (almost) nothing, no shrinking."""
    dense = tiny_family_model("llama", len(tok), seed=1)
    model = _pruned(dense, _scattered)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    repair(model, dense, tok, CALIBRATION, RepairOptions(form="lstsq", ridge=1e6))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3"])
def test_held_out_reconstruction_improves_in_every_repaired_layer(tok, model_type):
    """On texts the repair never saw, every repaired consumer's output (models run whole) is nearer the dense one;
    gemma3 mixes sliding and full layers (per-layer masks), phi3 fuses its projections."""
    dense = tiny_family_model(model_type, len(tok), seed=2)
    model = _pruned(dense, _scattered)
    before = consumer_errors(model, dense, tok, HELD_OUT)
    report = repair(model, dense, tok, CALIBRATION, RepairOptions(form="lstsq"))
    after = consumer_errors(model, dense, tok, HELD_OUT)
    assert len(report.consumers) == 4
    for c in report.consumers:
        key = (c.layer, c.module)
        assert after[key] < 0.8 * before[key], (key, before[key], after[key])


@pytest.mark.parametrize("options", [RepairOptions(form="lstsq", fit_bias=True), RepairOptions(form="bias")],
                         ids=["lstsq_bias", "flap"])
def test_repaired_model_saves_and_reloads_with_the_stock_class(tok, tmp_path, options):
    """Biases switched on by the config flag, zeros where nothing was fitted: the stock LlamaForCausalLM loads the
    directory and gives the same logits."""
    dense = tiny_family_model("llama", len(tok), seed=3)
    model = _pruned(dense, _uniform)
    repair(model, dense, tok, CALIBRATION, options)
    ids = tok(HELD_OUT[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    io.save_pruned(model, tok, tmp_path / "repaired")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "repaired").eval()
    assert type(reloaded) is transformers.LlamaForCausalLM
    assert reloaded.config.attention_bias and reloaded.config.mlp_bias
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)
    layer = reloaded.model.layers[1]
    assert not layer.self_attn.q_proj.bias.any() and not layer.mlp.up_proj.bias.any()
    assert layer.self_attn.o_proj.bias.any() and layer.mlp.down_proj.bias.any()


def test_lstsq_repaired_model_survives_the_gguf_read_back(tok, tmp_path):
    """The default form keeps the stock config (no bias switched on): its GGUF file, read back by transformers'
    loader, gives the directory's logits and token ids. The bias forms are refused for export before any work."""
    from pydantic import ValidationError

    from infra.config import CompressConfig
    from infra.gguf_write import write_gguf
    from tests.test_gguf_export import _compare

    dense = tiny_family_model("llama", len(tok), seed=3)
    model = _pruned(dense, _uniform)
    report = repair(model, dense, tok, CALIBRATION, RepairOptions(form="lstsq"))
    assert report.consumers and not report.bias_switches
    out = io.save_pruned(model, tok, tmp_path / "repaired")
    write_gguf(out, out / "m.gguf", "f32")
    diff, agree = _compare(out, "m.gguf", "f32", text=HELD_OUT[0])
    assert diff <= 1e-5 and agree == 1.0
    for repair_group in ({"form": "bias"}, {"form": "lstsq", "fit_bias": True}):
        with pytest.raises(ValidationError, match="GGUF metadata cannot state"):
            CompressConfig(model="m.gguf", repair=repair_group, export={"quant": ("q8_0",)})


def test_flap_compensation_hand_checked():
    """Columns 0 and 2 kept, column 1 removed: the bias gains column 1 times its input's mean (20)."""
    weight = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    kept = kept_columns(weight[:, [0, 2]], weight)
    assert kept.tolist() == [0, 2]
    assert flap_compensation(weight, kept, torch.tensor([10.0, 20.0, 30.0])).tolist() == [40.0, 100.0]


def test_kept_columns_hands_equal_columns_out_once_and_refuses_changed_weights():
    dense = torch.tensor([[1.0, 7.0, 1.0, 2.0], [3.0, 8.0, 3.0, 4.0]])
    assert kept_columns(dense[:, [0, 2, 3]], dense).tolist() == [0, 2, 3]
    with pytest.raises(RepairError, match="column 1 is no column of the dense weight"):
        kept_columns(dense[:, [0, 3]] + torch.tensor([[0.0, 1e-6], [0.0, 0.0]]), dense)


def test_bias_form_adds_flap_term_on_the_model(tok):
    """The bias form leaves the weights as pruned and sets each consumer's bias to W_d[:, removed] times the mean of
    the dense model's inputs to it over the calibration tokens (read here one text at a time)."""
    dense = tiny_family_model("llama", len(tok), seed=4)
    model = _pruned(dense, _scattered)
    weights = {n: p.clone() for n, p in model.named_parameters()}
    report = repair(model, dense, tok, CALIBRATION, RepairOptions(form="bias", batch_size=7))
    keys = [(c.layer, c.module) for c in report.consumers]
    means = {k: x.mean(0) for k, x in _per_text(dense, tok, keys, CALIBRATION, inputs=True).items()}
    p_layers, d_layers = model.model.layers, dense.model.layers
    for layer, name in keys:
        d_weight = families.get_module(d_layers[layer], name).weight
        p_module = families.get_module(p_layers[layer], name)
        removed = sorted(set(range(d_weight.shape[1])) - set(kept_columns(p_module.weight, d_weight).tolist()))
        expected = d_weight.double()[:, removed] @ means[(layer, name)][removed]
        torch.testing.assert_close(p_module.bias.double(), expected, rtol=1e-4, atol=1e-6)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters() if n in weights)
    others = [p for n, p in model.named_parameters() if n.endswith(".bias") and n not in weights
              and not any(n.endswith(f"{layer}.{name}.bias") for layer, name in keys)]
    assert others and all(not p.any() for p in others)  # q/k/v/gate/up, and consumers that lost nothing: zeros


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "phi3"])
def test_bias_form_is_refused_where_the_family_has_no_switch(tok, model_type):
    """No config flag gives o_proj a bias: refused naming the family, the model untouched; lstsq still repairs."""
    dense = tiny_family_model(model_type, len(tok), seed=5)
    model = _pruned(dense, _scattered)
    saved = copy.deepcopy(model.state_dict())
    for options in (RepairOptions(form="bias"), RepairOptions(form="lstsq", fit_bias=True)):
        with pytest.raises(RepairError, match=f"the {model_type} family has no config switch giving self_attn.o_proj"):
            repair(model, dense, tok, CALIBRATION, options)
    assert model.state_dict().keys() == saved.keys()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert len(repair(model, dense, tok, CALIBRATION, RepairOptions(form="lstsq")).consumers) == 4


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_bias_switches_are_what_the_stock_classes_build(model_type):
    """A switch in the family row gives every Linear slot of its kind a bias in the stock class; a kind without one
    has an unbiased consumer (what the bias form refuses)."""
    family = families.FAMILIES[model_type]
    switched = {flag: True for _, flag in family.bias_switches}
    layer = families.decoder_layers(tiny_family_model(model_type, 300, **switched), family)[0]
    for kind in ("attn", "mlp"):
        linear = [families.get_module(layer, s.module) for s in family.slots(kind)]
        linear = [m for m in linear if isinstance(m, torch.nn.Linear)]
        consumer = next(families.get_module(layer, s.module) for s in family.slots(kind) if s.dim == 1)
        if family.bias_switch(kind):
            assert all(m.bias is not None for m in linear), kind
        else:
            assert consumer.bias is None, kind


def test_layers_that_lost_nothing_are_untouched(tok):
    """Only the consumers that lost columns change: the MLP of layer 1, the attention of layer 2; every other
    tensor (layers 0 and 3, the other half of layers 1 and 2, embeddings) is bit for bit as pruned."""
    dense = tiny_family_model("llama", len(tok), seed=6)
    model = _pruned(dense, lambda u: (u.kind == "mlp" and u.layer == 1 and u.index < 32)
                    or (u.kind == "attn" and u.layer == 2 and u.index == 1))
    assert [(c.layer, c.module) for c in lost_inputs(model, dense)] == [(1, "mlp.down_proj"), (2, "self_attn.o_proj")]
    saved = {n: p.clone() for n, p in model.named_parameters()}
    report = repair(model, dense, tok, CALIBRATION, RepairOptions(form="lstsq"))
    assert [(c.layer, c.module, c.columns, c.dense_columns) for c in report.consumers] == \
        [(1, "mlp.down_proj", 96, 128), (2, "self_attn.o_proj", 32, 64)]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, saved[n])}
    assert changed == {"model.layers.1.mlp.down_proj.weight", "model.layers.2.self_attn.o_proj.weight"}


def test_refuses_models_that_do_not_correspond(tok):
    dense = tiny_family_model("llama", len(tok), seed=7)
    blocks = copy.deepcopy(dense)
    prune.apply(blocks, [u for u in units.discover(blocks, "block") if u.layer == 2])
    with pytest.raises(RepairError, match="4 decoder layers, the dense one 3"):  # fewer blocks: patched (below)
        repair(dense, blocks, tok, CALIBRATION)
    with pytest.raises(RepairError, match="not its pruned copy"):
        repair(dense, _pruned(dense, _scattered), tok, CALIBRATION)
    with pytest.raises(RepairError, match="unknown repair form 'ols'"):
        repair(_pruned(dense, _scattered), dense, tok, CALIBRATION, RepairOptions(form="ols"))


# ---------------------------------------------------------------- removed blocks: the linear patch

def _without_blocks(dense: torch.nn.Module, drop: set[int]) -> torch.nn.Module:
    model = copy.deepcopy(dense)
    prune.apply(model, [u for u in units.discover(model, "block") if u.layer in drop])
    return model


def test_block_patch_equals_the_naive_ridge_fit_folded_into_down_proj(tok):
    """Blocks 2 and 3 of 6 removed: block 1's MLP output m gets T, the ridge lstsq of (dense output of block 3 less
    the rest of block 1's output) on m, over the unpadded tokens; down_proj becomes T @ W_down. The held-out KL to
    the dense model falls; the blocks after the gap are untouched."""
    from pip_core.divergence import divergence

    dense = tiny_family_model("llama", len(tok), seed=4, layers=6)
    model = _without_blocks(dense, {2, 3})
    old_down = model.model.layers[1].mlp.down_proj.weight.detach().double().clone()
    after_gap = {n: p.detach().clone() for n, p in model.model.layers[2].named_parameters()}
    kl_before = divergence(dense, model, tok, HELD_OUT, max_length=128)["kl"]
    options = RepairOptions(form="lstsq", ridge=1e-2, batch_size=5)
    report = repair(model, dense, tok, CALIBRATION, options)
    assert [(c.layer, c.module) for c in report.consumers] == [(1, "mlp (patch)")]
    assert report.consumers[0].error_after < report.consumers[0].error_before

    ms, rs = [], []
    for text in CALIBRATION:  # one text at a time, no padding: the dense model's states (blocks 0-1 are shared)
        ids = tok(text, truncation=True, max_length=128, return_tensors="pt")["input_ids"]
        seen = []
        handle = dense.model.layers[1].mlp.register_forward_hook(lambda m, a, out, seen=seen: seen.append(out[0].double()))
        with torch.no_grad():
            states = dense(input_ids=ids, output_hidden_states=True).hidden_states
        handle.remove()
        m = seen[0]
        ms.append(m)
        rs.append(states[4][0].double() - (states[2][0].double() - m))
    t, _ = _naive_ridge(torch.cat(ms), torch.cat(rs), options.ridge, with_bias=False,
                        prior=torch.eye(ms[0].shape[1], dtype=torch.float64), relative=options.relative)  # towards no patch
    torch.testing.assert_close(model.model.layers[1].mlp.down_proj.weight.double(), t @ old_down, rtol=1e-3, atol=1e-5)
    for n, p in model.model.layers[2].named_parameters():
        assert torch.equal(p, after_gap[n]), n
    assert divergence(dense, model, tok, HELD_OUT, max_length=128)["kl"] < kl_before


def test_block_patch_leaves_a_leading_gap_and_refuses_what_it_cannot_patch(tok):
    from infra.config import CompressConfig
    from pip_core.block_patch import dense_indices, gaps

    dense = tiny_family_model("llama", len(tok), seed=5, layers=6)
    model = _without_blocks(dense, {0, 4})
    indices = dense_indices(model, dense, families.FAMILIES["llama"])
    assert indices == [1, 2, 3, 5] and gaps(indices, 6) == {2: 4}  # block 0's gap has no block before it
    assert [c.layer for c in repair(model, dense, tok, CALIBRATION).consumers] == [2]
    with pytest.raises(RepairError, match="repairs width units"):
        repair(_without_blocks(dense, {2}), dense, tok, CALIBRATION, RepairOptions(form="bias"))
    gemma = tiny_family_model("gemma2", len(tok), seed=5, layers=4)
    with pytest.raises(RepairError, match="post_feedforward_layernorm"):
        repair(_without_blocks(gemma, {2}), gemma, tok, CALIBRATION)
    with pytest.raises(RepairError, match="no block of the dense model"):
        repair(_without_blocks(dense, {2}), tiny_family_model("llama", len(tok), seed=6, layers=6), tok, CALIBRATION)
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="patched by repair lstsq"):
        CompressConfig(model="m.gguf", unit="block", repair="bias")
    assert CompressConfig(model="m.gguf", unit="block", repair="lstsq").repair.form == "lstsq"


def test_the_summary_says_what_the_repair_did_or_that_none_ran():
    import io as stdio

    from rich.console import Console

    from pipprune.commands.summary import _print_repair

    out = stdio.StringIO()
    console = Console(file=out, width=200)
    _print_repair(console, {"form": "none", "steps": []})
    _print_repair(console, {"form": "lstsq", "steps": [
        {"iteration": 1, "consumers": 30.0, "error_before": 0.214, "error_after": 0.102, "seconds": 4.0},
        {"iteration": 2, "consumers": 30.0, "error_before": 0.301, "error_after": 0.155, "seconds": 5.0}]})
    text = out.getvalue()
    assert "repair: none" in text and "--repair lstsq" in text
    assert "repair: lstsq after each pruning step, 9 s" in text
    assert "step 1: 0.214 -> 0.102; step 2: 0.301 -> 0.155" in text
