"""Data-parallel scoring: shards of the calibration pairs on 2 Dask workers give the single-process scores."""

from __future__ import annotations

import pytest
import torch

from infra.config import CalibrationSettings, RuntimeSettings, ScoringSettings
from pip_core import importance, io, schedule
from pip_core.errors import PipCoreError
from pip_core.importance import CalibrationData
from pip_core.schedule import StepSpec
from tasks import parallel_scoring
from tasks.refs import ModelRef
from tasks.scoring import scoring_options


def test_shards_are_contiguous_balanced_and_complete() -> None:
    items = list(range(11))
    parts = parallel_scoring.shards(items, 3)
    assert [len(p) for p in parts] == [4, 4, 3]
    assert sum(parts, []) == items
    assert parallel_scoring.shards(items[:1], 4) == [[0]]


def test_reduce_refuses_mismatched_shards() -> None:
    with pytest.raises(PipCoreError, match="different units"):
        importance.reduce_sums([(torch.zeros(3), 1), (torch.zeros(4), 1)])
    with pytest.raises(PipCoreError, match="does not split"):
        importance.score_sums(torch.nn.Linear(1, 1), "taylor", [], CalibrationData())


def test_runtime_workers_do_not_change_the_run_key() -> None:
    from infra.config import CompressConfig

    base = CompressConfig(model="m", calibration=CalibrationSettings(source="c"))
    spread = base.model_copy(update={"runtime": RuntimeSettings(scoring_workers=2)})
    assert base.result_defining() == spread.result_defining()


@pytest.fixture(scope="module")
def calibration_pairs(tiny_reference_dir, tmp_path_factory):
    import os

    os.environ.setdefault("PIPPRUNE_HOME", str(tmp_path_factory.mktemp("home")))
    from tasks.calibration import prepare_calibration, read_pairs

    settings = CalibrationSettings(source=str(tiny_reference_dir), n_samples=12, heldout_samples=2)
    ref = prepare_calibration.fn(settings, 0)
    return read_pairs(ref)


@pytest.mark.parametrize("unit", ["block", "width"])
def test_two_dask_workers_give_the_single_process_scores(tiny_reference_dir, calibration_pairs, unit) -> None:
    """The tiny reference, PIP, 2 local Dask workers: scores equal to float tolerance, same units chosen."""
    net, tokenizer = io.load(tiny_reference_dir, dtype=torch.float32, device="cpu")
    total = sum(p.numel() for p in net.parameters())
    spec = StepSpec(step=1, target_ratio=0.2, params_to_remove=int(0.2 * total), seed=0)
    options = scoring_options(ScoringSettings(unit=unit, method="pip"), max_length=64)
    units, single = schedule.score_step(net, CalibrationData(tokenizer, calibration_pairs), spec, options,
                                         progress=False)

    ref = ModelRef(local_dir=str(tiny_reference_dir), fingerprint=io.model_fingerprint(tiny_reference_dir),
                   num_params=total)
    runtime = RuntimeSettings(device="cpu", dtype="float32", scoring_workers=2)
    with parallel_scoring.dask_client(runtime) as client:
        assert len(client.scheduler_info()["workers"]) == 2
        found, spread = parallel_scoring.score_on_cluster(ref, calibration_pairs, spec, options, runtime, client)
        per_worker = client.run(lambda: __import__("tasks.models").models.HANDOFF.holds("working"))
    assert all(per_worker.values()), "each worker holds its loaded model"
    assert found == units
    assert spread == pytest.approx(single, rel=1e-9, abs=1e-12)
    chosen = schedule.select_step(units, single, spec, options)
    assert schedule.select_step(found, spread, spec, options) == chosen and chosen


def test_score_units_task_spreads_over_workers_when_the_runtime_asks(tiny_reference_dir, calibration_pairs) -> None:
    """The flow's own task: `runtime.scoring_workers: 2` writes the same stats as one process."""
    import json
    from pathlib import Path

    from pip_core.schedule import StepSpec
    from tasks.calibration import prepare_calibration
    from tasks.scoring import score_units

    settings = CalibrationSettings(source=str(tiny_reference_dir), n_samples=12, heldout_samples=2, max_length=64)
    calib = prepare_calibration.fn(settings, 0)
    ref = ModelRef(local_dir=str(tiny_reference_dir), fingerprint=io.model_fingerprint(tiny_reference_dir),
                   num_params=io.param_count_from_dir(tiny_reference_dir))
    spec = StepSpec(step=1, target_ratio=0.2, params_to_remove=int(0.2 * ref.num_params), seed=0)
    scoring = ScoringSettings(unit="block", method="pip")
    one = score_units.fn(ref, calib, scoring, spec, RuntimeSettings(device="cpu", dtype="float32"))
    rows_one = json.loads(Path(one.path).read_text())  # columns: unit_id, kind, layer, index, num_params, score
    two = score_units.fn(ref, calib, scoring, spec, RuntimeSettings(device="cpu", dtype="float32",
                                                                     scoring_workers=2))
    rows_two = json.loads(Path(two.path).read_text())
    assert rows_two["unit_id"] == rows_one["unit_id"]
    assert rows_two["score"] == pytest.approx(rows_one["score"], rel=1e-9)
