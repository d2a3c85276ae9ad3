"""Two recovery curves paired row by row on the same documents."""

import pytest

from benchmarks.recovery_versus import versus


def _run(variant: str, steps: int, kl: float, sha: str = "d1") -> dict:
    n = 8
    docs = {"kl": [kl * 10 + 0.01 * i for i in range(n)], "agree": [5.0] * n, "nll_dense": [30.0] * n,
            "nll_pruned": [30.0 + kl * 10] * n, "tokens": [10.0] * n}
    return {"variant": variant, "seed": 0, "steps": steps, "train_seconds": 1.0, "tokens": 100, "cloze_acc": 0.7,
            "heldout": {"persuasion": {"sha256": sha, "docs": docs}}}


def test_rows_both_curves_have_are_paired_and_judged():
    a = {"runs": [_run("none", 10, 0.5), _run("lora_lm", 10, 0.3), _run("kd_full", 10, 0.2)]}
    b = {"runs": [_run("none", 10, 0.7), _run("lora_lm", 10, 0.3)]}
    rows = {r["recovery"]: r for r in versus(a, b, n_boot=200)}
    assert set(rows) == {"none", "lora_lm@10"}  # kd_full only in one curve: no row
    assert rows["none"]["kl"]["verdict"] == "better" and rows["none"]["kl"]["diff"]["point"] == pytest.approx(-0.2)
    assert rows["lora_lm@10"]["kl"]["verdict"] == "indistinguishable"


def test_curves_on_different_documents_are_refused():
    with pytest.raises(SystemExit, match="different documents"):
        versus({"runs": [_run("none", 10, 0.5)]}, {"runs": [_run("none", 10, 0.5, sha="other")]}, n_boot=50)
