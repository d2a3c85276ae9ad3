"""Job config validation and promotion gate logic (pure, no servers)."""

import math

import pytest
from pydantic import ValidationError

from infra.config import CompressConfig, load_config_file
from infra.promotion import PromotionError, PromotionGates, check_alias, evaluate_gates

BASE = dict(model="m", calibration="c.jsonl")


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.1, math.nan, 0.95])
def test_ratio_out_of_range_is_rejected(ratio):
    with pytest.raises(ValidationError, match="ratio"):
        CompressConfig(**BASE, ratio=ratio)


def test_iterations_zero_and_unknown_unit_rejected():
    with pytest.raises(ValidationError, match="iterations"):
        CompressConfig(**BASE, iterations=0)
    with pytest.raises(ValidationError, match="unit"):
        CompressConfig(**BASE, unit="neurons")


def test_block_influence_alias_and_unit_check():
    assert CompressConfig(**BASE, method="block-influence").scoring.method == "block_influence"
    # the default unit is width; a block-only method named without a unit prunes blocks
    assert CompressConfig(**BASE).scoring.unit == "width"
    assert CompressConfig(**BASE, method="block-influence").scoring.unit == "block"
    assert CompressConfig(**BASE, method="pip_removal").scoring.unit == "block"
    with pytest.raises(ValidationError, match="block"):
        CompressConfig(**BASE, method="block-influence", unit="mlp")


def test_digest_changes_with_result_defining_fields():
    a = CompressConfig(**BASE)
    assert a.digest() == CompressConfig(**BASE).digest()
    assert a.digest() != CompressConfig(**BASE, seed=1).digest()


def test_config_file_unknown_key_is_named(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: m\ncalibration: c\nratoi: 0.3\n")
    with pytest.raises(ValidationError, match="ratoi"):
        load_config_file(path)


def test_config_file_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: m\ncalibration: c\nratio: 0.3\n")
    assert load_config_file(path, ratio=0.1, unit=None).ratio == 0.1


def test_flat_and_grouped_spellings_give_the_same_config(tmp_path):
    flat = CompressConfig(**BASE, n_samples=8, max_length=64, unit="width", iterations=3, eval_tasks="a, b")
    grouped = CompressConfig(model="m", calibration={"source": "c.jsonl", "n_samples": 8, "max_length": 64},
                             scoring={"unit": "width", "iterations": 3}, evaluation={"tasks": ["a", "b"]})
    assert flat == grouped
    assert (flat.calibration.n_samples, flat.scoring.unit, flat.evaluation.tasks) == (8, "width", ("a", "b"))
    path = tmp_path / "job.yaml"
    path.write_text("model: m\ncalibration: {source: c.jsonl, n_samples: 8}\nscoring: {unit: mlp, iterations: 2}\n")
    merged = load_config_file(path, iterations=5, max_length=32, calibration="d.jsonl")
    assert (merged.scoring.unit, merged.scoring.iterations) == ("mlp", 5)
    assert (merged.calibration.source, merged.calibration.n_samples, merged.calibration.max_length) == ("d.jsonl", 8, 32)


def test_run_key_ignores_where_inputs_live_but_not_what_decides_the_weights():
    from flows.records import run_key_for

    a = CompressConfig(**BASE)
    moved = CompressConfig(model="elsewhere", calibration="other/c.jsonl", eval_tasks="x", registered_model_name="n")
    assert run_key_for(a, "f", "c", "w") == run_key_for(moved, "f", "c", "w")
    for changed in (dict(max_length=64), dict(unit="mlp"), dict(seed=3), dict(ratio=0.3), dict(n_samples=4)):
        assert run_key_for(a, "f", "c", "w") != run_key_for(CompressConfig(**BASE, **changed), "f", "c", "w"), changed


def test_recovery_is_off_by_default_keyed_and_merged_from_file_and_cli(tmp_path):
    from flows.compress import run_key_for

    plain = CompressConfig(**BASE)
    assert not plain.recovery.enabled
    path = tmp_path / "job.yaml"
    path.write_text("model: m\ncalibration: c\nrecovery: {steps: 40, rank: 4}\n")
    merged = load_config_file(path, recovery={"steps": 80})  # --recovery-steps keeps the file's rank
    assert (merged.recovery.steps, merged.recovery.rank) == (80, 4)
    assert run_key_for(plain, "f", "c", "w") != run_key_for(CompressConfig(**BASE, recovery={"steps": 80}), "f", "c", "w")
    with pytest.raises(ValidationError, match="recovery.steps"):
        CompressConfig(**BASE, recovery={"steps": -1})
    with pytest.raises(ValidationError, match="recovery.ranq"):
        CompressConfig(**BASE, recovery={"ranq": 4})


METRICS = {"source.cloze.acc": 0.5, "final.cloze.acc": 0.45, "source.heldout_perplexity": 20.0,
           "final.heldout_perplexity": 26.0, "final.achieved_ratio": 0.2}


def test_gates_pass_and_fail_on_the_right_gate():
    ok = evaluate_gates(PromotionGates(retained_min={"cloze.acc": 0.85}, perplexity_increase_max=0.5,
                                       param_reduction_min=0.15), METRICS)
    assert all(g.passed for g in ok) and len(ok) == 3
    bad = evaluate_gates(PromotionGates(retained_min={"cloze.acc": 0.95}, perplexity_increase_max=0.2,
                                        param_reduction_min=0.15), METRICS)
    assert [g.gate for g in bad if not g.passed] == ["retained cloze.acc", "perplexity increase"]


def test_missing_metric_fails_its_gate():
    (gate,) = evaluate_gates(PromotionGates(retained_min={"hellaswag.acc": 0.8}), METRICS)
    assert not gate.passed and "not logged" in gate.detail


def test_gate_file_unknown_key(tmp_path):
    path = tmp_path / "gates.yaml"
    path.write_text("gates:\n  retained_minimum: {a: 1}\n")
    with pytest.raises(ValidationError, match="retained_minimum"):
        PromotionGates.from_file(path)


@pytest.mark.parametrize("alias", ["", "latest", "v3", "has space", "a/b"])
def test_invalid_alias(alias):
    with pytest.raises(PromotionError, match="alias"):
        check_alias(alias)


def test_cli_help_and_defaults_come_from_the_config_model():
    from typer.testing import CliRunner

    from infra.config import CompressConfig, ScoringSettings
    from pipprune.cli import app
    from pipprune.commands.common import config_help

    assert config_help("scoring.iterations") == (f"{ScoringSettings.model_fields['iterations'].description} "
                                                 f"(default: {ScoringSettings().iterations})")
    assert str(CompressConfig.model_fields["ratio"].default) in config_help("ratio")
    shown = " ".join(CliRunner().invoke(app, ["compress", "--help"]).output.replace("│", " ").split())
    assert config_help("scoring.iterations") in shown and config_help("calibration.n_samples") in shown


def test_recovery_kind_defaults_to_lora_and_kd_settings_are_keyed(tmp_path):
    from flows.records import run_key_for

    plain = CompressConfig(**BASE, recovery={"steps": 10})
    assert (plain.recovery.kind, plain.recovery.kd_params, plain.recovery.temperature) == ("lora", "lora", 1.0)
    kd = CompressConfig(**BASE, recovery={"steps": 10, "kind": "kd"})
    warm = CompressConfig(**BASE, recovery={"steps": 10, "kind": "kd", "temperature": 2.0})
    keys = {run_key_for(c, "f", "c", "w") for c in (plain, kd, warm)}
    assert len(keys) == 3
    path = tmp_path / "job.yaml"
    path.write_text("model: m\ncalibration: c\nrecovery: {steps: 40, kind: kd, kd_params: full, temperature: 2}\n")
    merged = load_config_file(path, recovery={"kind": "lora"})  # --recovery lora keeps the file's steps
    assert (merged.recovery.steps, merged.recovery.kind, merged.recovery.kd_params) == (40, "lora", "full")
    with pytest.raises(ValidationError, match="recovery.kind"):
        CompressConfig(**BASE, recovery={"steps": 10, "kind": "distill"})
    with pytest.raises(ValidationError, match="recovery.kd_params"):
        CompressConfig(**BASE, recovery={"steps": 10, "kind": "kd", "kd_params": "half"})
