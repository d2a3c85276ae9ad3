"""Sweeps: the grid as compress configs, the Pareto front, and a sweep end to end on the real local stack
(points as subflows here, and as deployment runs on a process work pool with 2 workers), rerun reusing points."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from infra.sweep import SweepConfig, apply_settings, markdown_table, pareto_front
from tests.helpers import cli

ROOT = Path(__file__).resolve().parents[1]


def _base(ref: str = "m") -> dict:
    return {"model": ref, "calibration": ref, "scoring": {"method": "pip", "iterations": 1}}


def test_grid_expands_flat_and_dotted_keys_into_compress_configs() -> None:
    sweep = SweepConfig(base=_base(), grid={"ratio": [0.1, 0.2], "scoring.unit": ["block", "width"],
                                            "n_samples": [8]})
    points = sweep.points()
    assert len(points) == 4
    assert {(p.config.ratio, p.config.scoring.unit) for p in points} == {
        (0.1, "block"), (0.1, "width"), (0.2, "block"), (0.2, "width")}
    assert all(p.config.calibration.n_samples == 8 and p.config.scoring.method == "pip" for p in points)
    assert points[0].label == "ratio=0.1,unit=block,n_samples=8"


def test_identical_points_collapse_and_keys_follow_config_source_and_code() -> None:
    sweep = SweepConfig(base=_base(), grid={"unit": ["block", "block"], "scoring.unit": ["block"]})
    points = sweep.points()
    assert len(points) == 1
    key = points[0].key("fp", "code")
    assert key == points[0].key("fp", "code") and key != points[0].key("fp2", "code") != points[0].key("fp", "c2")


def test_bad_sweep_files_are_named(tmp_path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="grid.ratio must be a non-empty list"):
        SweepConfig(base=_base(), grid={"ratio": []})
    with pytest.raises(ValidationError, match="ratio must be in"):
        SweepConfig(base=_base(), grid={"ratio": [1.5]}).points()
    assert apply_settings({"calibration": "c"}, {"calibration.n_samples": 4}) == {
        "calibration": {"source": "c", "n_samples": 4}}


def test_pareto_front_keeps_only_undominated_points() -> None:
    rows = [{"point": "a", "achieved_ratio": 0.1, "kl": 0.1}, {"point": "b", "achieved_ratio": 0.2, "kl": 0.3},
            {"point": "c", "achieved_ratio": 0.1, "kl": 0.4}, {"point": "d", "achieved_ratio": 0.3, "kl": 0.2},
            {"point": "e", "achieved_ratio": math.nan, "kl": math.nan}]
    assert [rows[i]["point"] for i in pareto_front(rows)] == ["a", "d"]
    table = markdown_table([{**r, "status": "ran"} for r in rows])
    assert table.count("\n") == 2 + len(rows) and "| e | ran |" in table


# ---------------------------------------------------------------- end to end on the local stack

def _sweep_file(tmp: Path, ref: Path, **extra) -> Path:
    base = {"model": str(ref), "calibration": str(ref), "n_samples": 6, "heldout_samples": 4, "max_length": 48,
            "eval_tasks": ["pipprune_wordnet_cloze"], "eval_include_path": str(ref / "tasks"), "eval_limit": 20,
            "registered_model_name": "tiny-sweep", "serving": {"measure": False},
            "scoring": {"method": "pip", "iterations": 1}}
    data = {"name": extra.pop("name", "t"), "base": base, **extra}
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(env: dict[str, str], *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    return cli({**os.environ, **env}, *args, timeout=timeout)


def _parent_artifacts(env: dict[str, str], run_id: str) -> tuple[list[str], dict, list]:
    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    names = [a.path for a in client.list_artifacts(run_id, "sweep")]
    children = client.search_runs([client.get_run(run_id).info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{run_id}'")
    return names, client.get_run(run_id).data.metrics, children


def test_local_sweep_reruns_reuse_points_and_a_failed_point_is_reported(stack_env, tiny_reference_dir, tmp_path):
    """2 points as subflows here; the rerun reuses both (same MLflow runs); a sweep with one infeasible point runs
    the rest and exits 1 with the failure in its table."""
    import json

    gates = tmp_path / "gates.yaml"
    gates.write_text(yaml.safe_dump({"param_reduction_min": 0.3, "require_signature": False}))
    path = _sweep_file(tmp_path, tiny_reference_dir, grid={"ratio": [0.2, 0.3], "scoring.unit": ["block"]},
                       gates=str(gates), alias="sweep-best")
    started = time.perf_counter()
    first = _cli(stack_env, "sweep", "--config", str(path), "--json")
    first_s = time.perf_counter() - started
    assert first.returncode == 0, first.stderr[-3000:]
    doc = json.loads(first.stdout)
    assert [r["status"] for r in doc["rows"]] == ["ran", "ran"]
    assert all(r["achieved_ratio"] > 0.1 and math.isfinite(r["kl"]) for r in doc["rows"])
    names, metrics, children = _parent_artifacts(stack_env, doc["parent_run_id"])
    assert {"sweep/sweep.csv", "sweep/sweep.md", "sweep/pareto.png", "sweep/sweep.json"} <= set(names)
    assert metrics["points.ran"] == 2 and len(children) == 2
    # the best point passing the gates (>= 30% removed): ratio 0.3, whose version now has the alias
    assert doc["promoted"]["point"] == "ratio=0.3,unit=block", doc["promoted"]
    from mlflow import MlflowClient

    best = MlflowClient(stack_env["MLFLOW_TRACKING_URI"]).get_model_version_by_alias("tiny-sweep", "sweep-best")
    assert best.version == doc["rows"][1]["model_version"] and doc["rows"][0]["achieved_ratio"] < 0.3

    started = time.perf_counter()
    again = _cli(stack_env, "sweep", "--config", str(path), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    redo = json.loads(again.stdout)
    assert [r["status"] for r in redo["rows"]] == ["reused", "reused"]
    assert [r["mlflow_run_id"] for r in redo["rows"]] == [r["mlflow_run_id"] for r in doc["rows"]]
    assert time.perf_counter() - started < first_s  # nothing recomputed (the machine's load sets the figures)

    # a point the budget planner refuses (90% of a 6-block model in whole blocks) fails alone; the other is reused
    mixed = _sweep_file(tmp_path, tiny_reference_dir, grid={"ratio": [0.2, 0.9], "scoring.unit": ["block"]})
    failed = _cli(stack_env, "sweep", "--config", str(mixed), "--json")
    assert failed.returncode == 1, failed.stderr[-3000:]
    rows = json.loads(failed.stdout)["rows"]
    assert [r["status"] for r in rows] == ["reused", "failed"], rows
    assert "0.9" in rows[1]["error"] or "remove" in rows[1]["error"], rows[1]["error"]


def test_sweep_on_a_process_work_pool_with_two_workers(stack_env, tiny_reference_dir, tmp_path):
    """2 points as deployment runs on a process work pool served by 2 workers (one run at a time each): both
    workers take a point, and the parent run has the table and the Pareto plot. (A rerun's reuse is decided
    before a point is dispatched, the same for a pool and for subflows: the local sweep test covers it.)"""
    import json

    # the workers ask for runs every 2 s instead of Prefect's 10 (both pytest workers sat idle in such polls)
    env = {**os.environ, **stack_env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PREFECT_WORKER_QUERY_SECONDS": "2"}
    prefect = [sys.executable, "-m", "prefect"]
    made = subprocess.run([*prefect, "work-pool", "create", "sweep-pool", "--type", "process"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert made.returncode == 0, made.stderr[-2000:]
    logs = [tmp_path / f"worker-{i}.log" for i in (1, 2)]
    workers = [subprocess.Popen([*prefect, "worker", "start", "--pool", "sweep-pool", "--name", f"w{i}", "--limit", "1"],
                                env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
               for i, log in zip((1, 2), logs, strict=True)]
    try:
        path = _sweep_file(tmp_path, tiny_reference_dir, name="pool", work_pool="sweep-pool", concurrency=2,
                           grid={"ratio": [0.2], "scoring.unit": ["block", "width"], "seed": [3]})  # own points
        first = _cli(stack_env, "sweep", "--config", str(path), "--json")
        assert first.returncode == 0, first.stderr[-3000:]
        doc = json.loads(first.stdout)
        rows = doc["rows"]
        assert [r["status"] for r in rows] == ["ran"] * 2, rows
        took = {r["worker"].split()[1] for r in rows}
        assert took == {"w1", "w2"}, [r["worker"] for r in rows]
        names, metrics, children = _parent_artifacts(stack_env, doc["parent_run_id"])
        assert {"sweep/sweep.csv", "sweep/pareto.png"} <= set(names) and len(children) == 2
        print(first.stdout)  # the table, for the record (pytest -s)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()


def test_the_same_point_in_two_concurrent_sweeps_is_computed_once(stack_env, tiny_reference_dir, tmp_path):
    """Two sweeps started together with one identical point: one runs it, the other waits on the point's
    one-slot Prefect limit and then reuses the finished run."""
    import json

    procs, dirs = [], []
    for name in ("twin-a", "twin-b"):
        folder = tmp_path / name
        folder.mkdir()
        path = _sweep_file(folder, tiny_reference_dir, name=name, grid={"ratio": [0.25], "seed": [7]})
        procs.append(subprocess.Popen([sys.executable, "-m", "pipprune.cli", "sweep", "--config", str(path), "--json"],
                                      env={**os.environ, **stack_env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        dirs.append(folder)
    outs = [p.communicate(timeout=1500) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    rows = [json.loads(out)["rows"][0] for out, _ in outs]
    assert sorted(r["status"] for r in rows) == ["ran", "reused"], rows
    assert rows[0]["mlflow_run_id"] == rows[1]["mlflow_run_id"]
