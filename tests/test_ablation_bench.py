"""The ablation benchmark's bookkeeping: which runs it plans and which documents each verdict is paired with."""

from __future__ import annotations

import pytest
import torch

from benchmarks.ablation import Setting, edited_words, plan, summarise
from pip_core.divergence import DocStats

DEFAULT = Setting("default", "pip_l2", 0.15, 2, 32)
N_DOCS = 40


def _docs(kl_per_token: torch.Tensor) -> dict:
    tokens = torch.full((N_DOCS,), 100.0, dtype=torch.float64)
    nll = torch.full((N_DOCS,), 300.0, dtype=torch.float64)
    return DocStats(kl_per_token * tokens, tokens * 0.8, nll, nll + kl_per_token * tokens, tokens).to_json()


def _run(unit: str, setting: Setting, kl: torch.Tensor) -> dict:
    return {"unit": unit, "ratio": 0.2, "seed": 0, "axis": setting.axis, "method": setting.method, "rate": setting.rate,
            "iterations": setting.iterations, "pairs": setting.pairs, "docs": _docs(kl)}


def test_plan_varies_one_setting_at_a_time_and_reuses_the_default_run():
    settings = plan(DEFAULT, {"rate": [0.05, 0.15, 0.3], "iterations": [1, 2, 5], "pairs": [32, 128]}, "taylor")
    assert settings[0] == DEFAULT
    assert settings[1] == Setting("baseline", "taylor", 0.15, 2, 32)
    ablated = [(s.axis, s.rate, s.iterations, s.pairs) for s in settings[2:]]
    assert ablated == [("rate", 0.05, 2, 32), ("rate", 0.3, 2, 32), ("iterations", 0.15, 1, 32),
                       ("iterations", 0.15, 5, 32), ("pairs", 0.15, 2, 128)]
    with pytest.raises(SystemExit, match="unknown ablation axis 'ratio'"):
        plan(DEFAULT, {"ratio": [0.1]}, None)


def test_each_ablated_value_is_paired_with_the_default_of_its_own_unit():
    gen = torch.Generator().manual_seed(0)
    block = 0.10 + 0.05 * torch.rand(N_DOCS, generator=gen, dtype=torch.float64)
    width = 0.02 + 0.01 * torch.rand(N_DOCS, generator=gen, dtype=torch.float64)
    runs = [
        _run("block", DEFAULT, block),
        _run("width", DEFAULT, width),
        _run("block", Setting("baseline", "taylor", 0.15, 2, 32), block * 1.2),
        # the same documents' KL as block's default: a difference of exactly 0 only if paired with block's default
        _run("block", Setting("rate", "pip_l2", 0.3, 2, 32), block.clone()),
        _run("block", Setting("pairs", "pip_l2", 0.15, 2, 128), block * 0.9),
        _run("width", Setting("iterations", "pip_l2", 0.15, 5, 32), width * 1.1),
    ]
    summary, verdicts = summarise(runs, n_boot=200)
    assert [(s["unit"], s["axis"]) for s in summary] == [
        ("block", "default"), ("block", "baseline"), ("block", "rate"), ("block", "pairs"),
        ("width", "default"), ("width", "iterations")]
    vs_default = {(v["unit"], v["axis"], v["value"]): v for v in verdicts if v["vs"] == "default"}
    assert set(vs_default) == {("block", "rate", 0.3), ("block", "pairs", 128), ("width", "iterations", 5)}
    same = vs_default[("block", "rate", 0.3)]
    assert same["kl_diff"] == {"point": 0.0, "low": 0.0, "high": 0.0} and same["verdict"] == "indistinguishable"
    assert vs_default[("block", "pairs", 128)]["verdict"] == "better"
    assert vs_default[("block", "pairs", 128)]["relative"] == pytest.approx(-0.1)
    assert vs_default[("width", "iterations", 5)]["verdict"] == "worse"
    vs_taylor = {(v["axis"], v["value"]): v["verdict"] for v in verdicts if v["vs"] == "taylor"}
    # every block PIP run (default included) against Taylor; width has no baseline run, so no such verdict
    assert vs_taylor == {("default", None): "better", ("rate", 0.3): "better", ("pairs", 128): "better"}


def test_several_seeds_add_verdicts_pooled_over_seeds():
    gen = torch.Generator().manual_seed(1)
    runs = []
    for seed in (0, 1):
        kl = 0.02 + 0.01 * torch.rand(N_DOCS, generator=gen, dtype=torch.float64)
        for setting, factor in ((DEFAULT, 1.0), (Setting("pairs", "pip_l2", 0.15, 2, 128), 1.0 + 0.2 * seed)):
            runs.append({**_run("width", setting, kl * factor), "seed": seed})
    runs.append({**_run("width", Setting("rate", "pip_l2", 0.3, 2, 32), torch.full((N_DOCS,), 0.02)), "seed": 0})
    summary, verdicts = summarise(runs, n_boot=200)
    pooled = [v for v in verdicts if v["seed"] == "mean of 0,1"]
    # seed 0: identical, seed 1: +20%: the pooled difference is the mean over seeds; rate 0.3 (seed 0 only) is not pooled
    assert [(v["axis"], v["value"]) for v in pooled] == [("pairs", 128)]
    assert pooled[0]["verdict"] == "worse" and pooled[0]["relative"] == pytest.approx(0.1, rel=0.05)
    assert [s["axis"] for s in summary if s["seed"] == "mean of 0,1"] == ["default", "pairs"]


def test_a_cell_without_its_default_run_is_refused():
    runs = [_run("width", Setting("rate", "pip_l2", 0.3, 2, 32), torch.full((N_DOCS,), 0.02, dtype=torch.float64))]
    with pytest.raises(ValueError, match="need exactly one default run"):
        summarise(runs, n_boot=50)


def test_edited_words_counts_changed_words_per_pair():
    pairs = [("the cat sat later", "the bat sat alter"), ("a host", "a ghost")]
    assert edited_words(pairs) == pytest.approx((2 + 1) / 2)


def test_divergence_pools_a_partial_grid_over_the_seeds_both_methods_ran():
    """A resumable grid is tabulated part-way: PIP with seeds 0,1,2 and Taylor with 0,1 pool over 0,1 only, each
    seed's PIP run against the same seed's Taylor run (not PIP's seed 2 against nothing or another seed)."""
    from benchmarks.divergence import summarise as divergence_summary

    gen = torch.Generator().manual_seed(1)
    kl = {s: 0.1 + 0.02 * s + 0.01 * torch.rand(N_DOCS, generator=gen, dtype=torch.float64) for s in (0, 1, 2)}
    runs = [{"unit": "block", "ratio": 0.2, "seed": s, "method": "pip_l2", "docs": _docs(kl[s])} for s in (0, 1, 2)]
    runs += [{"unit": "block", "ratio": 0.2, "seed": s, "method": "taylor", "docs": _docs(kl[s] * 2)} for s in (0, 1)]
    _, verdicts = divergence_summary(runs, n_boot=200)
    pooled = [v for v in verdicts if str(v["seed"]).startswith("mean")]
    assert [(v["seed"], v["pip"], v["baseline"]) for v in pooled] == [("mean of 0,1", "pip_l2", "taylor")]
    assert pooled[0]["relative"] == pytest.approx(-0.5) and pooled[0]["verdict"] == "better"
    assert len([v for v in verdicts if v["seed"] in (0, 1, 2)]) == 2  # one per seed both ran


def test_divergence_runs_file_is_reused_from_another_checkout_path_but_not_for_other_weights(tmp_path):
    """A committed --resume file names the reference build by its manifest digests, not its path."""
    import json

    from benchmarks.divergence import load_done, model_identity

    def build(folder, weights: str):
        folder.mkdir(parents=True)
        files = {"config.json": "c", "model.safetensors": weights, "calibration/calibration.jsonl": "k",
                 "calibration/wordlist.txt": "w", "tokenizer.json": str(folder)}
        (folder / "manifest.json").write_text(json.dumps({"files": files}))
        return folder

    here, clone, other = build(tmp_path / "a" / "ref", "w1"), build(tmp_path / "b" / "ref", "w1"), build(
        tmp_path / "c" / "ref", "w2")
    runs = tmp_path / "runs.jsonl"
    record = {"key": "block|0.2|0|pip_l2", "model": str(here), "model_id": model_identity(here),
              "runs": {"persuasion": {"kl": 1.0}}, "digests": {"persuasion": "d1"}}
    runs.write_text(json.dumps(record) + "\n")
    assert model_identity(here) == model_identity(clone) != model_identity(other)
    assert load_done(runs, clone, {"persuasion": "d1"}) == {"block|0.2|0|pip_l2": {"persuasion": {"kl": 1.0}}}
    assert load_done(runs, other, {"persuasion": "d1"}) == {}
    assert load_done(runs, clone, {"persuasion": "d2"}) == {}  # another held-out text: not the same run


def test_recovery_curve_pairs_each_budget_with_its_own_lora_run_and_old_results_still_render():
    from benchmarks.recovery import budgets, compare_table, curve
    from benchmarks.recovery import summarise as recovery_summary

    assert budgets("40,10,20,10") == [10, 20, 40]
    with pytest.raises(SystemExit, match="positive step counts"):
        budgets("0")
    gen = torch.Generator().manual_seed(2)
    base = 0.2 + 0.01 * torch.rand(N_DOCS, generator=gen, dtype=torch.float64)

    def run(variant: str, steps: int, factor: float) -> dict:
        return {"variant": variant, "seed": 0, "steps": steps, "tokens": 100 * steps, "train_seconds": 1.0,
                "cloze_acc": 0.4, "heldout": {"persuasion": {"sha256": "d", "docs": _docs(base * factor)}}}

    runs = [run("none", 0, 1.0)] + [run(v, s, f / s) for s in (10, 20) for v, f in (("lora_lm", 9), ("kd_lora", 5))]
    summary = recovery_summary(runs, ["persuasion"], n_boot=200)
    pairs = {(v["a"], v["b"]) for v in summary["persuasion"]["verdicts"]}
    assert ("kd_lora@20", "lora_lm@20") in pairs and ("kd_lora@20", "lora_lm@10") not in pairs
    args = {"model": "m/smollm2-135m", "unit": "block", "ratio": 0.2, "iterations": 2, "steps": "10,20",
            "batch_size": 8, "max_length": 128, "seeds": "0", "lr": 2e-3, "full_lr": 2e-4, "temperature": 1.0,
            "method": "block_influence", "cloze_limit": 100, "name": "curve"}
    payload = {"args": args, "params_dense": 10, "params_pruned": 8, "dense_cloze_acc": 0.5, "runs": runs,
               "summary": summary}
    payload["curve"] = curve(payload)
    kd = sorted((r["steps"], r["kl"]) for r in payload["curve"] if r["variant"] == "kd_lora")
    assert [s for s, _ in kd] == [10, 20] and kd[1][1] < kd[0][1]
    assert [r["cloze_retained"] for r in payload["curve"]] == pytest.approx([0.8] * 5)
    table = "\n".join(compare_table(payload))
    assert "Recovery curve" in table and "| KD, LoRA | 20 | 2,000 |" in table
    old = [{k: v for k, v in r.items() if k != "steps"} for r in runs[:3]]  # results written before budgets
    old_payload = {"args": {**args, "steps": 10}, "params_dense": 10, "params_pruned": 8, "runs": old,
                   "summary": recovery_summary(old, ["persuasion"], n_boot=200)}
    assert "| KD, LoRA |" in "\n".join(compare_table(old_payload))
