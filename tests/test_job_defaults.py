"""The job's one defaults rule (infra.config.job_defaults): each combination of CLI options and config-file fields
resolves to the same job whichever way it is given, and only what the user left out is filled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from infra.config import (
    BUILTIN_CLOZE_TASK,
    DEFAULT_RECOVERY_STEPS,
    OWN_TEXT_COUNTS,
    OWN_TEXT_WIDTH_ITERATIONS,
    CompressConfig,
    load_config_file,
)

#: the job a model with no calibration data of its own gets: its own texts, wanda_sp, KD recovery, the built-in cloze
OWN = {"source": "self", "unit": "width", "method": "wanda_sp", "iterations": OWN_TEXT_WIDTH_ITERATIONS,
       "steps": DEFAULT_RECOVERY_STEPS, "kind": "kd", "tasks": (BUILTIN_CLOZE_TASK,)}
#: what a reference build gets: its own corpus and tasks, the config's plain defaults (PIP, no recovery)
REF = {"source": "REF", "unit": "width", "method": "pip", "iterations": 4, "steps": 0, "kind": "lora",
       "tasks": ("pipprune_persuasion", "pipprune_wordnet_cloze")}

#: name -> (model, options as the CLI passes them, the same as config-file fields, expected job)
MATRIX: dict[str, tuple[str, dict, dict, dict]] = {
    "gguf, nothing else": ("x.gguf", {}, {}, OWN),
    "plain dir, nothing else": ("PLAIN", {}, {}, OWN),
    "hub id, nothing else": ("org/model", {}, {}, OWN),
    "self given explicitly": ("PLAIN", {"calibration": "self"}, {"calibration": "self"}, OWN),
    "self by weight alone": ("PLAIN", {"calibration": "self:1"}, {"calibration": {"source": "self:1"}}, OWN),
    "block unit": ("PLAIN", {"unit": "block"}, {"scoring": {"unit": "block"}},
                   {**OWN, "unit": "block", "method": "block_influence", "iterations": 4}),
    "method given": ("PLAIN", {"method": "pip"}, {"scoring": {"method": "pip"}}, {**OWN, "method": "pip"}),
    "block method without unit": ("PLAIN", {"method": "block-influence"}, {"scoring": {"method": "block-influence"}},
                                  {**OWN, "unit": "block", "method": "block_influence", "iterations": 4}),
    "iterations given": ("PLAIN", {"iterations": 2}, {"scoring": {"iterations": 2}},
                         {**OWN, "iterations": 2}),
    "steps alone keep kd": ("PLAIN", {"recovery": {"steps": 80}}, {"recovery": {"steps": 80}}, {**OWN, "steps": 80}),
    "kind alone keeps the default steps": ("PLAIN", {"recovery": {"kind": "lora"}}, {"recovery": {"kind": "lora"}},
                                           {**OWN, "kind": "lora"}),
    "recovery off": ("PLAIN", {"recovery": {"steps": 0}}, {"recovery": {"steps": 0}}, {**OWN, "steps": 0}),
    "a file": ("PLAIN", {"calibration": "FILE"}, {"calibration": "FILE"},
               {**REF, "source": "FILE", "tasks": (BUILTIN_CLOZE_TASK,)}),
    "a mix is not only the model's own": ("PLAIN", {"calibration": "self:0.5,FILE:0.5"},
                                          {"calibration": {"source": "self:0.5,FILE:0.5"}},
                                          {**REF, "source": "self:0.5,FILE:0.5", "tasks": (BUILTIN_CLOZE_TASK,)}),
    "reference build": ("REF", {}, {}, REF),
    "reference build, self asked": ("REF", {"calibration": "self"}, {"calibration": "self"},
                                    {**OWN, "tasks": REF["tasks"]}),
    "reference build, kind alone": ("REF", {"recovery": {"kind": "kd"}}, {"recovery": {"kind": "kd"}},
                                    {**REF, "steps": DEFAULT_RECOVERY_STEPS, "kind": "kd"}),
    "tasks given": ("PLAIN", {"eval_tasks": "hellaswag"}, {"evaluation": {"tasks": "hellaswag"}},
                    {**OWN, "tasks": ("hellaswag",)}),
    "no tasks asked": ("PLAIN", {"eval_tasks": ""}, {"evaluation": {"tasks": ""}}, {**OWN, "tasks": ()}),
}


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("defaults")
    (root / "plain").mkdir()
    (root / "plain" / "config.json").write_text("{}")
    ref = root / "ref"
    (ref / "calibration").mkdir(parents=True)
    (ref / "tasks").mkdir()
    (ref / "config.json").write_text("{}")
    (ref / "calibration" / "calibration.jsonl").write_text(json.dumps({"text": "a reference build's own text"}) + "\n")
    for name in REF["tasks"]:
        (ref / "tasks" / f"{name}.yaml").write_text("task: " + name + "\n")
    (root / "calib.jsonl").write_text(json.dumps({"text": "a user's own calibration text"}) + "\n")
    return {"PLAIN": str(root / "plain"), "REF": str(ref), "FILE": str(root / "calib.jsonl")}


def _fill(value: object, places: dict[str, str]) -> object:
    if isinstance(value, str):
        for name, path in places.items():
            value = value.replace(name, path) if name in value else value
        return value
    if isinstance(value, dict):
        return {k: _fill(v, places) for k, v in value.items()}
    return value


def _job(cfg: CompressConfig) -> dict:
    return {"source": cfg.calibration.source, "unit": cfg.scoring.unit, "method": cfg.scoring.method,
            "iterations": cfg.scoring.iterations, "steps": cfg.recovery.steps, "kind": cfg.recovery.kind,
            "tasks": cfg.evaluation.tasks}


def _cli(model: str, options: dict) -> CompressConfig:
    from pipprune.commands.compress import _compress_config, _recovery_options

    options = dict(options)
    calibration, tasks = options.pop("calibration", None), options.pop("eval_tasks", None)
    recovery = options.pop("recovery", {})
    options["recovery"] = _recovery_options(recovery.get("steps"), recovery.get("kind"))
    return _compress_config(model, None, calibration, None, tasks, options)


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_cli_options_and_config_files_resolve_to_the_same_job(name, places, tmp_path):
    model, options, fields, expected = (_fill(v, places) for v in MATRIX[name])
    by_cli = _cli(model, options)
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump({"model": model, **fields}))
    by_file = load_config_file(config_file)
    by_both = _compress_config_with_file(config_file)
    expected = {**expected, "source": _fill(expected["source"], places)}
    assert _job(by_cli) == expected
    own = expected["source"] == "self"
    own_counts = (OWN_TEXT_COUNTS["n_samples"], OWN_TEXT_COUNTS["recovery_samples"])
    assert (by_cli.calibration.n_samples, by_cli.calibration.recovery_samples) == (own_counts if own else (128, 128))
    assert _job(by_file) == expected
    assert _job(by_both) == expected


def _compress_config_with_file(config_file: Path) -> CompressConfig:
    from pipprune.commands.compress import _compress_config

    return _compress_config(None, config_file, None, None, None, {})


def test_cli_options_override_a_config_file_and_merge_into_its_recovery_group(places, tmp_path):
    from pipprune.commands.compress import _compress_config

    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump({"model": places["PLAIN"], "recovery": {"rank": 4, "kind": "lora"}}))
    cfg = _compress_config(None, config_file, None, None, None, {"recovery": {"steps": 12}})
    assert (cfg.recovery.steps, cfg.recovery.kind, cfg.recovery.rank) == (12, "lora", 4)
    assert cfg.scoring.method == "wanda_sp"  # the own-text default still fills what neither gave


def test_a_resolved_job_survives_a_round_trip_unchanged(places):
    """Prefect hands the flow its config as JSON: every field is then given, and the rule must change nothing."""
    for model in (places["PLAIN"], places["REF"], "x.gguf"):
        cfg = CompressConfig(model=model)
        assert CompressConfig.model_validate(cfg.model_dump(mode="json")) == cfg
        assert CompressConfig.model_validate(json.loads(cfg.model_dump_json())).digest() == cfg.digest()


def test_a_user_value_always_wins_over_a_default(places):
    cfg = CompressConfig(model=places["PLAIN"], evaluation={"limit": 7, "max_kl": 0.5}, recovery={"kind": "kd",
                                                                                                 "kd_params": "full"})
    assert (cfg.evaluation.limit, cfg.evaluation.max_kl) == (7, 0.5)
    assert (cfg.recovery.steps, cfg.recovery.kd_params) == (DEFAULT_RECOVERY_STEPS, "full")
    assert cfg.evaluation.tasks == (BUILTIN_CLOZE_TASK,)


def test_the_calibration_spec_is_parsed_once_into_its_parts(places):
    cfg = CompressConfig(model=places["PLAIN"], calibration=f"self:1,{places['FILE']}:3")
    spec = cfg.calibration.spec
    assert spec.parts == (("self", 0.25), (places["FILE"], 0.75)) and spec.kind == "mix"
    assert spec.files == [places["FILE"]] and not spec.is_self and spec.single_file is None
    assert cfg.calibration.source == f"self:0.25,{places['FILE']}:0.75"  # one canonical spelling


def test_sources_parse_into_weights_that_sum_to_one():
    from infra.calibration_spec import CalibrationSpec
    from pip_core.errors import CalibrationError

    assert CalibrationSpec.parse("self").parts == (("self", 1.0),)
    assert CalibrationSpec.parse("calib.jsonl").parts == (("calib.jsonl", 1.0),)
    assert CalibrationSpec.parse("self:1,calib.jsonl:3").parts == (("self", 0.25), ("calib.jsonl", 0.75))
    assert CalibrationSpec.parse("/data/v1:2024/calib.jsonl").parts == (("/data/v1:2024/calib.jsonl", 1.0),)
    for bad in ("self:0", "calib.jsonl:-1", "self,", "self:nan"):
        with pytest.raises(CalibrationError, match="SOURCE:WEIGHT"):
            CalibrationSpec.parse(bad)
