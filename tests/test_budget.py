"""Budgets and alignment without a stack: the planner's figures are what pruning reaches, aligned models
keep multiples of N channels and reload with the stock class, infeasible targets name the nearest feasible one."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from pip_core import io, schedule, units
from pip_core.alignment import allowed_cuts, effective_align
from pip_core.budget import BudgetError, Serving, Target, plan_budget
from pip_core.errors import PipCoreError
from pip_core.importance import CalibrationData
from pip_core.rules import Selection
from tests.helpers import bpe_tokenizer, tiny_family_model

TEXTS = ["The host said he would come later to the party at the house.",
         "A cat sat on the mat near the door and watched the bird."]


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(TEXTS)


def _prune(model, plan, kind, tokenizer):
    options = schedule.ScoringOptions("magnitude", kind, width_mode="uniform", align=plan.effective_align)
    return schedule.prune_iteratively(model, CalibrationData(tokenizer), options, plan.ratio, plan.iterations, progress=False)


@pytest.mark.parametrize("text, kind, value", [("params=3e9", "params", 3e9), ("params=350M", "params", 350e6),
                                               ("memory=24GiB", "memory", 24 * 2**30), ("memory=500MB", "memory", 5e8),
                                               ("ratio=0.2", "ratio", 0.2), ("layers=0.3", "layers", 0.3)])
def test_targets_parse(text, kind, value):
    target = Target.parse(text)
    assert (target.kind, target.value) == (kind, pytest.approx(value))


@pytest.mark.parametrize("text", ["params", "size=3", "params=lots", "memory=24GiBs", "ratio=0.95", "params=-1"])
def test_bad_targets_are_named(text):
    with pytest.raises(PipCoreError, match="target"):
        Target.parse(text)


def test_alignment_grid_and_clamp():
    assert allowed_cuts("mlp", 256, 64) == [0, 64, 128, 192]
    assert allowed_cuts("mlp", 11008, 64)[:3] == [0, 64, 128]
    assert allowed_cuts("mlp", 200, 64) == [0, 8, 72, 136]  # the first cut snaps an unaligned width to the grid
    assert effective_align(64, 256) == 64 and effective_align(64, 128) == 32 and effective_align(1, 128) == 1


@pytest.mark.parametrize("align", [64, 1])
@pytest.mark.parametrize("unit", ["width", "mlp", "block"])
def test_params_target_lands_within_one_unit_on_the_tiny_reference(tiny_reference_dir, unit, align):
    config = json.loads((tiny_reference_dir / "config.json").read_text())
    n = 600_000
    plan = plan_budget(config, f"params={n}", Selection(unit=unit, align=align), iterations=2)
    assert abs(plan.params_after - n) <= plan.granularity, plan
    model, tokenizer = io.load(tiny_reference_dir)
    assert units.param_count(model) == plan.params_before
    result = _prune(model, plan, unit, tokenizer)
    assert result.params_after == plan.params_after  # the planner simulates the selector's own rules
    assert abs(result.params_after - n) <= plan.granularity


@pytest.mark.parametrize("model_type", ["qwen2", "phi3", "gemma2"])
def test_params_target_through_the_planner_on_other_families(tok, model_type):
    model = tiny_family_model(model_type, len(tok), intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
    config = model.config.to_dict()
    total = units.param_count(model)
    n = int(total * 0.75)
    plan = plan_budget(config, f"params={n}", Selection(unit="width", align=64), iterations=2)
    assert plan.params_before == total and plan.effective_align == 64
    assert abs(plan.params_after - n) <= plan.granularity
    result = _prune(model, plan, "width", tok)
    assert result.params_after == plan.params_after
    assert all(layer.mlp.down_proj.in_features % 64 == 0 for layer in model.model.layers)


def test_memory_target_fits_and_counts_the_kv_cache(tiny_reference_dir):
    config = json.loads((tiny_reference_dir / "config.json").read_text())
    weights_only = plan_budget(config, "memory=2.9MiB", Selection(unit="width", align=1))
    with_cache = plan_budget(config, "memory=2.9MiB", Selection(unit="width", align=1),
                             serving=Serving(context=64, batch=2))
    assert weights_only.memory_after <= 2.9 * 2**20 and with_cache.memory_after <= 2.9 * 2**20
    assert with_cache.kv_cache_after > 0 and with_cache.params_after < weights_only.params_after
    last = with_cache.steps[-1]
    kv = 2 * last.layers * last.kv_heads * 24 * 64 * 2 * 4  # head_dim 24, float32
    assert with_cache.memory_after == last.num_params * 4 + kv


@pytest.mark.parametrize("target, nearest", [("params=1000", "params="), ("memory=100KiB", "memory="),
                                             ("params=5e9", "params=")])
def test_infeasible_targets_name_the_nearest_feasible_one(tiny_reference_dir, target, nearest):
    config = json.loads((tiny_reference_dir / "config.json").read_text())
    with pytest.raises(BudgetError) as err:
        plan_budget(config, target, Selection(unit="width"))
    assert err.value.nearest.startswith(nearest)
    if target != "params=5e9":  # the nearest feasible target is itself accepted
        plan_budget(config, err.value.nearest, Selection(unit="width"))


def test_aligned_model_saves_multiples_of_n_and_reloads_with_the_stock_class(tiny_reference_dir, tmp_path):
    config = json.loads((tiny_reference_dir / "config.json").read_text())
    plan = plan_budget(config, "ratio=0.3", Selection(unit="width", align=64), iterations=2)
    model, tokenizer = io.load(tiny_reference_dir)
    _prune(model, plan, "width", tokenizer)
    out = io.save_pruned(model, tokenizer, tmp_path / "aligned")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "llama" and "auto_map" not in saved
    assert saved["intermediate_size"] % 64 == 0 and saved["intermediate_size"] < config["intermediate_size"]
    assert saved["num_attention_heads"] % saved["num_key_value_heads"] == 0
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    assert all(layer.mlp.gate_proj.out_features % 64 == 0 for layer in reloaded.model.layers)
    x = torch.tensor([[5, 17, 42, 99, 3, 250, 77, 12]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)


def test_decode_speedup_gate_reads_the_logged_metric():
    from infra.promotion import PromotionGates, evaluate_gates

    metrics = {"serving.decode_speedup": 1.3, "serving.fraction_of_ideal": 0.4}
    (ok,) = evaluate_gates(PromotionGates(decode_speedup=">= 1.2"), metrics)
    (bad,) = evaluate_gates(PromotionGates(decode_speedup=">= 1.5"), metrics)
    (missing,) = evaluate_gates(PromotionGates(decode_speedup=">= 1.2"), {})
    (other,) = evaluate_gates(PromotionGates(metric_bounds={"serving.fraction_of_ideal": ">= 0.5"}), metrics)
    assert ok.passed and not bad.passed and not missing.passed and not other.passed
    with pytest.raises(ValueError, match="OP NUMBER"):
        PromotionGates(decode_speedup="fast")


def test_config_target_and_ratio_spellings():
    from infra.config import CompressConfig

    base = {"model": "m", "calibration": "c"}
    assert CompressConfig(**base, target="ratio=0.3").ratio == 0.3
    assert CompressConfig(**base, target="ratio=0.3").digest() == CompressConfig(**base, ratio=0.3).digest()
    assert CompressConfig(**base, target="memory=24GiB", serve_context=4096).budget_target() == "memory=24GiB"
    with pytest.raises(ValueError, match="not both"):
        CompressConfig(**base, ratio=0.2, target="params=3e9")
    with pytest.raises(ValueError, match="target"):
        CompressConfig(**base, target="params=many")


def test_serving_decode_is_greedy_generation_timed_step_by_step(tiny_reference_dir):
    """The timed loop decodes what `generate` decodes, and every figure is positive even when noisy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pip_core import serving

    model = AutoModelForCausalLM.from_pretrained(tiny_reference_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_reference_dir)
    ids = serving.prompt_ids(tokenizer, ["the host said that the ghost would alter the plan later"], 2, 12)
    prefill, decode, tokens = serving.greedy_timed(model, ids, 6, keep_one=True)
    with torch.inference_mode():
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                  min_new_tokens=6, do_sample=False, eos_token_id=None,
                                  pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(tokens, expected[:, ids.shape[1]:])
    assert prefill > 0 and decode > 0
    stats = serving.measure(model, tokenizer, ids, new_tokens=4, batch_sizes=(1, 3), repeats=2)
    assert all(b.decode_tokens_per_s > 0 and b.prefill_tokens_per_s > 0 and b.latency_p95_s >= b.latency_p50_s > 0
               for b in stats.batches)
    assert [b.batch for b in stats.batches] == [1, 3]


def test_a_model_with_nothing_prunable_is_refused_without_a_nonsense_suggestion():
    """Two layers, both protected: no target is feasible, and 'ratio=0' is not offered as one."""
    from pip_core.budget import BudgetError, Target, plan_budget

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    with pytest.raises(BudgetError, match="nothing can be removed.*2 layers with protect_first=1") as err:
        plan_budget(config, Target.parse("ratio=0.2"), Selection(unit="block", width_mode="uniform", align=1,
                                                                 protect_first=1, protect_last=1), iterations=2)
    assert err.value.nearest is None


@pytest.mark.parametrize("unit, ratio", [("block", "0.15"), ("attn", "0.08"), ("mlp", "0.25"), ("width", "0.25")])
def test_pipprune_plan_and_a_run_remove_the_same_amount_for_every_unit_kind(tiny_reference_dir, unit, ratio):
    """`pipprune plan` (its defaults: the config's) and a run of the same job (the flow's own mapping from config to
    scoring options, the planned ratio and alignment) end at the same parameter count, step by step."""
    import os

    from infra.budgeting import plan_for
    from infra.config import CompressConfig
    from tasks.scoring import scoring_options
    from tests.helpers import cli

    result = cli(dict(os.environ), "plan", "--model", str(tiny_reference_dir), "--unit", unit, "--ratio", ratio,
                 "--iterations", "2", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    planned = json.loads(result.stdout)["budget"]
    config = CompressConfig(model=str(tiny_reference_dir), calibration=str(tiny_reference_dir), ratio=float(ratio),
                            scoring={"unit": unit, "iterations": 2, "method": "magnitude"})
    budget = plan_for(config, io.read_config(tiny_reference_dir))
    assert budget.as_dict() == planned  # the CLI plans the job the flow plans
    options = scoring_options(config.scoring.model_copy(update={"align": budget.effective_align}), 64)
    model, tokenizer = io.load(tiny_reference_dir)
    run = schedule.prune_iteratively(model, CalibrationData(tokenizer), options, budget.ratio, budget.iterations,
                                     seed=config.seed, progress=False)
    assert [s.num_params for s in run.steps] == [s["num_params"] for s in planned["steps"]]
    assert run.params_after == planned["params_after"]


#: a model whose tied embedding is most of it (as a 262k vocabulary makes a 270M model's): 20% of it guts its layers
VOCAB_HEAVY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8000, "hidden_size": 32,
               "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4,
               "tie_word_embeddings": True}
WHOLE = {"align": 1, "protect_first": 0, "protect_last": 0}


@pytest.mark.parametrize("unit", ["width", "mlp", "block"])
def test_a_ratio_is_said_as_the_share_of_the_decoder_layers_it_takes(unit):
    plan = plan_budget(VOCAB_HEAVY, "ratio=0.2", Selection(unit=unit, width_mode="uniform", **WHOLE))
    body = plan.body
    embedding = 8000 * 32
    assert body.params_before == plan.params_before - embedding - 32  # the layers: all but embedding and final norm
    assert body.params_before - body.params_after == plan.params_before - plan.params_after  # the layers pay for all
    assert body.removed > 0.5 and body.deep and "of the decoder layers' parameters" in body.describe()
    assert plan.as_dict()["body"]["deep"] is True
    shallow = plan_budget(VOCAB_HEAVY, f"ratio={plan.largest_shallow_ratio()}", Selection(unit=unit, **WHOLE))
    assert shallow.body.removed <= 0.5


def test_a_target_over_the_layers_alone_takes_that_share_of_them():
    plan = plan_budget(VOCAB_HEAVY, "layers=0.2", Selection(unit="mlp", width_mode="uniform", **WHOLE))
    assert plan.target == "layers=0.2" and plan.body.removed == pytest.approx(0.2, abs=0.02) and not plan.body.deep
    assert plan.achieved_ratio < 0.1  # a fifth of the layers is well under a tenth of this model
    with pytest.raises(BudgetError) as err:
        plan_budget(VOCAB_HEAVY, "layers=0.9", Selection(unit="mlp", **WHOLE))
    assert err.value.nearest.startswith("layers=")


def test_a_target_that_guts_the_layers_stops_before_any_work_unless_confirmed(tmp_path):
    """The preflight (compress, its config file, each sweep point) refuses it naming the ways out; the config's
    `allow_deep_cut` confirms it."""
    from infra.config import CompressConfig
    from infra.preflight import PreflightError, check_budget

    config = CompressConfig(model="some/model", calibration="self", ratio=0.2,
                            scoring={"method": "magnitude", "unit": "mlp", **WHOLE})
    with pytest.raises(PreflightError) as err:
        check_budget(config, VOCAB_HEAVY)
    message = str(err.value)
    assert "of the decoder layers' parameters" in message and "embeddings" in message
    assert "--ratio 0." in message and "--target layers=" in message and "--allow-deep-cut" in message
    assert check_budget(config.model_copy(update={"allow_deep_cut": True}), VOCAB_HEAVY).body.deep
    assert not check_budget(config.model_copy(update={"ratio": 0.05}), VOCAB_HEAVY).body.deep


def test_plan_says_what_the_target_takes_from_the_layers(tmp_path):
    import os

    from tests.helpers import cli

    path = tmp_path / "config.json"
    path.write_text(json.dumps(VOCAB_HEAVY))
    result = cli(dict(os.environ), "plan", "--model", str(path), "--unit", "mlp", "--ratio", "0.2", "--align", "1",
                 "--protect-first", "0", "--protect-last", "0", timeout=300)
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "decoder layers: the target takes" in out and "compress stops before any work here" in out
    assert "--allow-deep-cut" in out


@pytest.mark.parametrize("unit", ["width", "mlp", "block"])
def test_a_trimmed_vocabulary_pays_first_and_the_layers_pay_only_the_rest(unit):
    """Vocabulary then units: the rows the trim drops count towards the target, so the layers lose less; the plan's
    ratio and steps are of the trimmed model (what the flow's schedule prunes), its figures of the model as given."""
    selection = Selection(unit=unit, width_mode="uniform", **WHOLE)
    whole = plan_budget(VOCAB_HEAVY, "ratio=0.2", selection)
    split = plan_budget(VOCAB_HEAVY, "ratio=0.2", selection, vocab_after=6000)
    trimmed_rows = 2000 * 32  # tied: one tensor
    assert split.vocab is not None and split.vocab.params_removed == trimmed_rows
    assert split.params_before == whole.params_before  # the ratio is of the model as given
    assert split.achieved_ratio == pytest.approx(0.2, abs=0.02)
    layers_paid = (split.params_before - trimmed_rows) - split.params_after
    assert layers_paid == split.body.params_before - split.body.params_after
    assert split.body.removed < whole.body.removed
    assert split.ratio == pytest.approx(layers_paid / (split.params_before - trimmed_rows), abs=0.02)
    assert split.steps[0].num_params < split.params_before - trimmed_rows
    assert "vocabulary 8,000 -> 6,000 tokens" in split.describe() and split.as_dict()["vocab"]["tokens_after"] == 6000


def test_a_vocabulary_that_takes_more_than_the_layers_could_gut_lets_the_cut_stay_shallow():
    """At 20% of a model whose embedding is most of it, the layers alone lose more than half; with the vocabulary
    trimmed first they do not (issue 49: vocabulary first, width next)."""
    selection = Selection(unit="mlp", width_mode="uniform", **WHOLE)
    assert plan_budget(VOCAB_HEAVY, "ratio=0.2", selection).body.deep
    plan = plan_budget(VOCAB_HEAVY, "ratio=0.2", selection, vocab_after=6500)
    assert not plan.body.deep and plan.achieved_ratio == pytest.approx(0.2, abs=0.02)


def test_a_vocabulary_trim_that_alone_meets_the_target_is_refused_with_the_ratio_that_is_not():
    with pytest.raises(BudgetError, match="already meets it") as err:
        plan_budget(VOCAB_HEAVY, "ratio=0.2", Selection(unit="mlp", **WHOLE), vocab_after=1000)
    nearest = float(err.value.nearest.removeprefix("ratio="))
    plan = plan_budget(VOCAB_HEAVY, f"ratio={nearest}", Selection(unit="mlp", **WHOLE), vocab_after=1000)
    assert plan.params_after < plan.params_before - 7000 * 32
    with pytest.raises(BudgetError, match="already meets it"):
        plan_budget(VOCAB_HEAVY, "memory=1MiB", Selection(unit="mlp", **WHOLE), vocab_after=1000, dtype="float32")
    with pytest.raises(PipCoreError, match="does not fit"):
        plan_budget(VOCAB_HEAVY, "ratio=0.2", Selection(unit="mlp", **WHOLE), vocab_after=9000)


def test_plan_and_the_preflight_count_the_tokens_a_vocabulary_corpus_keeps(tiny_reference_dir, tmp_path):
    """`plan --vocab-corpus` shows the split (the vocabulary first, then the layers) from the tokenizer and the corpus,
    no weights read; the compress preflight plans the same, and refuses a corpus file that is not there by name."""
    import os

    from infra.config import CompressConfig
    from infra.preflight import PreflightError, check_inputs
    from tests.helpers import cli

    rows = (tiny_reference_dir / "calibration" / "calibration.jsonl").read_text().splitlines()[:30]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(rows) + "\n")
    env = {**os.environ, "PIPPRUNE_HOME": str(tmp_path / "home")}
    result = cli(env, "plan", "--model", str(tiny_reference_dir), "--ratio", "0.2", "--vocab-corpus", str(corpus),
                 "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["budget"]
    assert plan["vocab"]["tokens_before"] == 2048 and plan["vocab"]["tokens_after"] < 2048
    assert plan["params_before"] == io.param_count_from_dir(tiny_reference_dir)
    text = cli(env, "plan", "--model", str(tiny_reference_dir), "--ratio", "0.2", "--vocab-corpus", str(corpus),
               timeout=300)
    assert "vocabulary first: vocabulary 2,048 ->" in " ".join(text.stdout.split())
    config = CompressConfig(model=str(tiny_reference_dir), calibration=str(tiny_reference_dir), ratio=0.2,
                            vocab_corpus=str(corpus))
    assert check_inputs(config).vocab.tokens_after == plan["vocab"]["tokens_after"]
    with pytest.raises(PreflightError, match="vocab corpus .*missing.txt.*not found"):
        check_inputs(config.model_copy(update={"vocab": config.vocab.model_copy(update={"corpus": str(tmp_path /
                                                                                              "missing.txt")})}))
    refused = cli(env, "plan", "--model", str(tiny_reference_dir), "--vocab-corpus", str(corpus), timeout=300)
    assert refused.returncode == 2 and "give --ratio or --target" in refused.stderr
