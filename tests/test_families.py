"""Every supported family, each a small random-init model built from its stock config: pruned in every
unit kind, saved, reloaded with the stock class (no remote code) and compared logit for logit.

The naive reference here writes each family's unit layout by hand from the module names, not from
`pip_core.families`, so a wrong slot in the table fails the comparison.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

from pip_core import families, importance, io, prune, schedule, units
from pip_core.errors import PruneError, UnsupportedArchitectureError
from pip_core.importance import CalibrationData
from pip_core.memory_plan import param_count_from_config, plan_memory
from tests.helpers import FAMILY_CONFIGS, bpe_tokenizer, tiny_family_model, view_gradients

FAMILIES = list(FAMILY_CONFIGS)
TEXTS = ["The host said he would come later to the party at the house.",
         "A cat sat on the mat near the door and watched the bird.",
         "Every guest brought bread and wine before the night was over."]
PAIRS = [("The host said he would come later to the party.", "The ghost said he would come alter to the party."),
         ("A cat sat on the mat near the door.", "A bat sat on the map near the door.")]
X = torch.tensor([[5, 17, 42, 99, 3, 250, 77, 12, 8, 31, 64, 90]])  # longer than the sliding window (4)


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(TEXTS + [t for p in PAIRS for t in p])


def test_the_table_has_the_eight_rows():
    assert set(families.FAMILIES) == set(FAMILIES)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("kind", ["block", "width"])
def test_uniform_compress_saves_the_stock_class(tok, tmp_path, model_type, kind):
    model = tiny_family_model(model_type, len(tok))
    original_types = getattr(model.config, "layer_types", None)
    total = units.param_count(model)
    found = units.discover(model, kind)
    result = schedule.prune_iteratively(model, CalibrationData(tok, PAIRS),
                                        schedule.ScoringOptions("pip", kind, width_mode="uniform"), 0.2, 1, progress=False)
    if kind == "block":
        share = max(u.num_params for u in found)
    else:  # uniform: one unit in every layer is the finest step
        layers = 1 + max(u.layer for u in found)
        share = layers * min(u.num_params for u in found)
    assert abs(result.achieved_ratio - 0.2) <= share / total, (result.achieved_ratio, share / total)

    out = io.save_pruned(model, tok, tmp_path / model_type)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type
    assert "auto_map" not in config and not (out / "modeling_pipprune.py").exists()
    io.check_weights(out, config)
    stock = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False).eval()
    assert type(stock).__name__ == families.FAMILIES[model_type].model_class
    with torch.no_grad():
        diff = (stock(X).logits - model(X).logits).abs().max().item()
    assert diff <= 1e-5
    assert units.param_count(stock) == result.params_after
    if kind == "block":
        removed = {u.layer for u in result.steps[0].removed}
        assert stock.config.num_hidden_layers == 4 - len(removed) == len(stock.model.layers)
        if original_types is not None:
            assert stock.config.layer_types == [t for i, t in enumerate(original_types) if i not in removed]
    else:
        shapes = {families.layer_shape(layer, families.FAMILIES[model_type]) for layer in stock.model.layers}
        assert len(shapes) == 1, "uniform widths"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_per_layer_widths_round_trip(tok, tmp_path, model_type):
    model = tiny_family_model(model_type, len(tok), seed=1)
    options = schedule.ScoringOptions("magnitude", "width", protect_first=1, protect_last=1, width_mode="per_layer")
    schedule.prune_iteratively(model, CalibrationData(tok), options, 0.2, 1, progress=False)
    out = io.save_pruned(model, tok, tmp_path / model_type)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == families.PRUNED_PREFIX + model_type
    assert config["layer_widths"][0] != config["layer_widths"][1]  # the protected first layer kept its width
    io.check_weights(out, config)
    reloaded, _ = io.load(out)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()  # what other tools do
    with torch.no_grad():
        expected = model(X).logits
        assert (reloaded(X).logits - expected).abs().max().item() <= 1e-5
        assert (remote(X).logits - expected).abs().max().item() <= 1e-5
    assert param_count_from_config(config) == units.param_count(model)


def _hand_owned(model, unit) -> dict[str, tuple[int, list[int]]]:
    """Parameter name -> (dim, positions) a unit owns, written out per module name (not via the table)."""
    layer = model.model.layers[unit.layer]
    attn, mlp, j = layer.self_attn, layer.mlp, unit.index
    prefix = f"model.layers.{unit.layer}."
    owned: dict[str, tuple[int, list[int]]] = {}
    if unit.kind == "attn":
        hd, gs = attn.head_dim, attn.num_key_value_groups
        q = list(range(j * gs * hd, (j + 1) * gs * hd))
        kv = list(range(j * hd, (j + 1) * hd))
        q_size = attn.o_proj.in_features
        if hasattr(attn, "qkv_proj"):  # Phi-3: rows are [all q | all k | all v]
            kv_size = (attn.qkv_proj.out_features - q_size) // 2
            owned["self_attn.qkv_proj.weight"] = (0, q + [q_size + i for i in kv] + [q_size + kv_size + i for i in kv])
        else:
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                owned[f"self_attn.{name}.weight"] = (0, rows)
                if getattr(attn, name).bias is not None:
                    owned[f"self_attn.{name}.bias"] = (0, rows)
        owned["self_attn.o_proj.weight"] = (1, q)
        if hasattr(attn, "q_norm") and attn.q_norm.weight.numel() == q_size:  # OLMo 2: whole-projection norms
            owned["self_attn.q_norm.weight"] = (0, q)
            owned["self_attn.k_norm.weight"] = (0, kv)
    else:
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: rows are [all gate | all up]
            owned["mlp.gate_up_proj.weight"] = (0, [j, mlp.gate_up_proj.out_features // 2 + j])
        else:
            owned["mlp.gate_proj.weight"] = (0, [j])
            owned["mlp.up_proj.weight"] = (0, [j])
        owned["mlp.down_proj.weight"] = (1, [j])
    return {prefix + name: value for name, value in owned.items()}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_pip_equals_naive_two_backward_reference(tok, model_type):
    model = tiny_family_model(model_type, len(tok), seed=2)
    found = units.discover(model, "width")
    fast = importance.score(model, "pip", found, CalibrationData(tok, PAIRS), progress=False)
    naive = torch.zeros(len(found), dtype=torch.float64)
    for original, perturbed in PAIRS:
        grads = [view_gradients(model, tok, text) for text in (original, perturbed)]
        for row, unit in enumerate(found):
            sq = 0.0
            for name, (dim, positions) in _hand_owned(model, unit).items():
                d = (grads[0][name] - grads[1][name]).index_select(dim, torch.tensor(positions))
                sq += float(d.double().pow(2).sum())
            naive[row] += math.sqrt(sq)
    naive /= len(PAIRS)
    torch.testing.assert_close(fast, naive, rtol=1e-4, atol=1e-7)
    owned = sum(t.numel() for t in _hand_owned_all(model, found))
    assert owned == sum(u.num_params for u in found)  # counting agrees with the hand layout


@pytest.mark.parametrize("model_type", FAMILIES)
def test_removing_units_equals_zeroing_their_hand_written_weights(model_type):
    """Independent of the slot table: the pruned model computes what the original does with the removed
    units' rows/columns zeroed (OLMo 2's attention is left out: its norm spans the whole projection)."""
    model = tiny_family_model(model_type, 300, seed=4)
    found = units.discover(model, "width")
    kinds = ("mlp",) if model_type == "olmo2" else ("attn", "mlp")
    drop = [u for u in found if u.kind in kinds and (u.layer, u.index) in {(1, 1), (2, 0), (2, 7)}]
    zeroed = copy.deepcopy(model)
    params = dict(zeroed.named_parameters())
    with torch.no_grad():
        for unit in drop:
            for name, (dim, positions) in _hand_owned(zeroed, unit).items():
                params[name].index_fill_(dim, torch.tensor(positions), 0.0)
        prune.apply(model, drop)
        torch.testing.assert_close(model(X).logits, zeroed(X).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_magnitude_scores_equal_the_hand_layout(model_type):
    model = tiny_family_model(model_type, 300, seed=5)
    found = units.discover(model, "width")
    fast = importance.score(model, "magnitude", found)
    params = dict(model.named_parameters())
    hand = [math.sqrt(sum(float(params[n].detach().double().index_select(d, torch.tensor(pos)).pow(2).sum())
                          for n, (d, pos) in _hand_owned(model, u).items())) for u in found]
    torch.testing.assert_close(fast, torch.tensor(hand, dtype=torch.float64), rtol=1e-5, atol=0)


def _hand_owned_all(model, found):
    params = dict(model.named_parameters())
    for unit in found:
        for name, (dim, positions) in _hand_owned(model, unit).items():
            yield params[name].detach().index_select(dim, torch.tensor(positions))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_untouched_unit_scores_do_not_change_when_another_is_removed(model_type):
    """Weight-local (magnitude) scores: removing units must move exactly the right rows and columns."""
    model = tiny_family_model(model_type, 300, seed=3)
    before = units.discover(model, "width")
    scores = dict(zip(before, importance.score(model, "magnitude", before).tolist(), strict=True))
    drop = [u for u in before if (u.kind, u.layer, u.index) in {("attn", 1, 0), ("mlp", 2, 5), ("mlp", 2, 6)}]
    prune.apply(model, drop)
    after = units.discover(model, "width")
    rescored = importance.score(model, "magnitude", after).tolist()
    survivors = [u for u in before if u not in drop]
    assert len(after) == len(survivors)
    for old, new, value in zip(survivors, after, rescored, strict=True):
        assert (old.kind, old.layer) == (new.kind, new.layer)
        assert value == pytest.approx(scores[old], rel=1e-6, abs=0)  # float32 sums


def test_uniform_selection_cuts_each_layer_by_its_own_scores():
    found = [units.Unit("mlp", layer, j, 10) for layer in range(3) for j in range(4)]
    scores = [float((j * 7 + layer * 3) % 4) for layer in range(3) for j in range(4)]
    chosen = prune.select(found, scores, 60, width_mode="uniform")
    assert len(chosen) == 6 and {u.layer for u in chosen} == {0, 1, 2}
    for layer in range(3):
        mine = [s for u, s in zip(found, scores, strict=True) if u.layer == layer]
        cut = sorted(s for u, s in zip(found, scores, strict=True) if u in chosen and u.layer == layer)
        assert cut == sorted(mine)[:2]
    with pytest.raises(PruneError, match="width mode"):
        prune.select(found, scores, 60, width_mode="sideways")
    uneven = found[:-1]
    with pytest.raises(PruneError, match="per_layer"):
        prune.select(uneven, scores[:-1], 30, width_mode="uniform")



def test_score_split_takes_the_kind_whose_units_matter_least():
    """width_split scores: attention groups (2 per layer, 40 parameters each) against MLP channels (8 per layer,
    10 each), 3 layers, 120 parameters to remove. The parameter split takes 2 channels and half a group's worth of
    rounding; the score split takes whichever kind the standardised scores say matters least, as a whole."""
    attn = [units.Unit("attn", layer, j, 40) for layer in range(3) for j in range(2)]
    mlp = [units.Unit("mlp", layer, j, 10) for layer in range(3) for j in range(8)]
    found = attn + mlp

    def chosen_kinds(attn_scores: list[float], mlp_scores: list[float], split: str) -> dict[str, int]:
        chosen = prune.select(found, attn_scores + mlp_scores, 120, width_mode="uniform", width_split=split)
        assert sum(u.num_params for u in chosen) == 120
        return {k: sum(u.kind == k for u in chosen) // 3 for k in ("attn", "mlp")}

    # one group per layer far below the other, the MLP channels all alike: the groups go
    groups_low = ([0.0, 10.0] * 3, [5.0] * 24)
    assert chosen_kinds(*groups_low, "scores") == {"attn": 1, "mlp": 0}
    # half of each layer's channels far below the rest, the groups alike: the channels go
    channels_low = ([5.0] * 6, ([0.0] * 4 + [10.0] * 4) * 3)
    assert chosen_kinds(*channels_low, "scores") == {"attn": 0, "mlp": 4}
    # the parameter split does not read the scores
    assert chosen_kinds(*groups_low, "params") == chosen_kinds(*channels_low, "params")
    with pytest.raises(PruneError, match="width split"):
        prune.select(found, [0.0] * len(found), 120, width_mode="uniform", width_split="halves")

@pytest.mark.parametrize("model_type", FAMILIES)
def test_memory_plan_counts_the_meta_model(model_type):
    model = tiny_family_model(model_type, 300)
    config = model.config.to_dict()
    assert param_count_from_config(config) == units.param_count(model)
    plan = plan_memory(config)
    assert plan.gradients_peak == max(p.numel() for p in model.parameters()) * 4


def test_unsupported_family_is_refused_with_the_supported_list(tmp_path):
    moe = AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=2))
    with pytest.raises(UnsupportedArchitectureError, match="mixtral.*llama, mistral, qwen2, qwen3, gemma2"):
        units.discover(moe, "width")
    moe.save_pretrained(tmp_path / "moe")
    with pytest.raises(UnsupportedArchitectureError, match="olmo2"):
        io.check_loadable(tmp_path / "moe")
    with pytest.raises(UnsupportedArchitectureError, match="qwen3_moe"):
        plan_memory({"model_type": "qwen3_moe"})


def test_unknown_layer_layout_is_refused():
    model = tiny_family_model("llama", 300)
    broken = copy.deepcopy(model)
    broken.model.layers[2].mlp.gate_proj = torch.nn.Identity()
    with pytest.raises(UnsupportedArchitectureError, match="layer 2.*gate_proj.*unknown layer layout"):
        units.discover(broken, "width")
    narrow = copy.deepcopy(model)
    narrow.model.layers[1].self_attn.k_proj = torch.nn.Linear(64, 24, bias=False)
    with pytest.raises(UnsupportedArchitectureError, match="layer 1.*k_proj.*unknown layer layout"):
        units.discover(narrow, "attn")


def test_weights_that_do_not_fit_the_layout_are_refused_from_headers(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_family_model("phi3", 300)
    model.save_pretrained(tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    io.check_weights(tmp_path / "ok", config)
    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    tensors["model.layers.1.self_attn.qkv.weight"] = tensors.pop("model.layers.1.self_attn.qkv_proj.weight")
    save_file(tensors, tmp_path / "ok" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedArchitectureError, match="unknown layer layout.*layers.1.self_attn.qkv_proj"):
        io.check_weights(tmp_path / "ok", config)


# ---------------------------------------------------------------- the CLI, end to end on the local stack

def _family_dir(model_type: str, reference, out):
    """A random-init `model_type` directory with the reference tokenizer copied in."""
    import shutil

    ref_config = json.loads((reference / "config.json").read_text())
    model = tiny_family_model(model_type, ref_config["vocab_size"], pad_token_id=ref_config["pad_token_id"],
                              bos_token_id=ref_config["bos_token_id"], eos_token_id=ref_config["eos_token_id"])
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(reference / name, out / name)
    return out


def _registered_versions(env: dict[str, str], name: str) -> int:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    return len(client.search_model_versions(f"name='{name}'"))


#: the CLI end to end for the families whose layout differs most from the tiny reference's own llama (every other
#: CLI test runs llama): phi3's fused qkv/gate_up slots, gemma3_text's layer_types and independent head size.
#: Every family's compress, save and stock-class reload runs in process above (test_uniform_compress_saves_...);
#: the flow around it (tracking, S3, registration) does not depend on the family.
CLI_FAMILIES = ("phi3", "gemma3_text")


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("model_type", CLI_FAMILIES)
def test_cli_compress_width_uniform_on_the_most_distinct_families(stack_env, tiny_reference_dir, tmp_path, model_type):
    from tests.helpers import cli

    source = _family_dir(model_type, tiny_reference_dir, tmp_path / "src")
    out = tmp_path / "out"
    result = cli({**os.environ, **stack_env}, "compress", "--model", str(source), "--calibration", str(tiny_reference_dir),
                 "--ratio", "0.2", "--unit", "width", "--width-mode", "uniform", "--method", "pip",
                 "--iterations", "1", "--n-samples", "4", "--eval-limit", "5", "--out", str(out),
                 "--name", f"fam-{model_type}", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert abs(summary["achieved_ratio"] - 0.2) < 0.05
    # no --tasks: the calibration source is a reference build, so its local tasks run (5 items each here)
    assert summary["tasks"] == ["pipprune_persuasion", "pipprune_wordnet_cloze"], summary["tasks"]
    assert "calibration source is a pipprune reference build" in summary["tasks_origin"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and "auto_map" not in config
    stock = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
    assert type(stock).__name__ == families.FAMILIES[model_type].model_class
    assert units.param_count(stock) == summary["params_after"]


@pytest.mark.slow
@pytest.mark.stack
def test_cli_refuses_unsupported_family_and_unknown_layout(stack_env, tiny_reference_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.helpers import cli

    moe = tmp_path / "moe"
    AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=2048, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=2)).save_pretrained(moe)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tiny_reference_dir / name, moe / name)
    odd = _family_dir("qwen3", tiny_reference_dir, tmp_path / "odd")
    tensors = load_file(odd / "model.safetensors")
    tensors["model.layers.0.mlp.fc_in.weight"] = tensors.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(tensors, odd / "model.safetensors", metadata={"format": "pt"})
    for model, expected in ((moe, "mixtral.*llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, olmo2"),
                            (odd, "unknown layer layout.*model.layers.0.mlp.gate_proj")):
        result = cli({**os.environ, **stack_env}, "compress", "--model", str(model), "--calibration", str(tiny_reference_dir),
                     "--unit", "width", "--iterations", "1", "--name", "fam-refused")
        assert result.returncode != 0
        assert re.search(expected, result.stderr.replace("\n", " ")), result.stderr[-2000:]
    assert _registered_versions(stack_env, "fam-refused") == 0
