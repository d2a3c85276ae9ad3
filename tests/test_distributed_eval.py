"""Evaluation fan-out on a 2-worker Dask LocalCluster gives the sequential run's metrics."""

from __future__ import annotations

import shutil

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.stack]


def test_dask_fan_out_matches_sequential(local_stack, tiny_reference_dir, tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.evaluate import dask_runner, evaluate_models_flow
    from pip_core import io, schedule
    from pip_core.importance import CalibrationData

    stack, _ = local_stack
    for key, value in stack.client_env().items():
        monkeypatch.setenv(key, value)
    model, tok = io.load(tiny_reference_dir)
    schedule.prune_iteratively(model, CalibrationData(tok), schedule.ScoringOptions("magnitude", "block"), 0.2, 1, progress=False)
    pruned = tmp_path / "pruned"
    io.save_pruned(model, tok, pruned)
    dense = tmp_path / "dense"
    shutil.copytree(tiny_reference_dir, dense, ignore=shutil.ignore_patterns("tasks", "calibration"))
    dirs = [str(dense), str(pruned)]
    args = (("pipprune_wordnet_cloze", "pipprune_persuasion"), str(tiny_reference_dir / "tasks"), 20)
    with temporary_settings(updates={PREFECT_API_URL: stack.client_env()["PREFECT_API_URL"]}):
        sequential = evaluate_models_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=1))(dirs, *args)
        parallel = evaluate_models_flow.with_options(task_runner=dask_runner(n_workers=2))(dirs, *args)
    for d in dirs:
        assert parallel[d]["results"] == sequential[d]["results"]
        # the same evaluation records the same provenance, wherever it ran (content digests, no worker paths)
        assert parallel[d]["provenance"] == sequential[d]["provenance"]
        assert parallel[d]["provenance"]["limit"] == 20
        assert sequential[d]["worker"] is None and parallel[d]["worker"].startswith("tcp://127.0.0.1")
    dense_ppl = sequential[str(dense)]["results"]["pipprune_persuasion"]["word_perplexity"]
    assert sequential[str(pruned)]["results"]["pipprune_persuasion"]["word_perplexity"] != dense_ppl
