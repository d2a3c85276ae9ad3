"""The suite profiler's bookkeeping: which kind each process is, and the totals it reports."""

from benchmarks.suite_cpu import Proc, kind_of, summarise


def test_processes_are_told_apart_by_their_command_line():
    assert kind_of("/v/bin/python -m pipprune.cli compress --model x") == "pipprune CLI: compress"
    assert kind_of("/v/bin/pipprune lineage m --version 1") == "pipprune CLI: lineage"
    assert kind_of("/v/bin/python -m prefect server start --host 127.0.0.1") == "Prefect server"
    assert kind_of("/v/bin/python -m mlflow server --host 127.0.0.1") == "MLflow server"
    assert kind_of("/x/weed mini -dir=/s3") == "S3 server (SeaweedFS)"
    assert kind_of("/v/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))") == "pytest-xdist workers"
    assert kind_of("/v/bin/python -m pytest -q -n 2") == "pytest controller (and the tiny model build)"
    assert kind_of("/usr/bin/git status") == "other"


def test_summary_adds_up_by_kind_and_against_the_cores():
    procs = [Proc("a", "x", 30.0), Proc("a", "y", 10.0), Proc("b", "z", 60.0)]
    s = summarise(procs, wall_seconds=100.0, cores=2)
    assert s["cpu_seconds"] == 100.0 and s["utilisation"] == 0.5
    assert [(r["kind"], r["processes"], r["per_process"]) for r in s["kinds"]] == [("b", 1, 60.0), ("a", 2, 20.0)]
    assert abs(sum(r["share"] for r in s["kinds"]) - 1.0) < 1e-12
