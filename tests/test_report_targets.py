"""The results README's target rows: recovery (cheapest passing recovery first) and `make bench`'s wall time."""

from __future__ import annotations

from benchmarks.report import _recovery_rows


def _result() -> dict:
    def variant(ratio: float) -> dict:
        return {"ppl_ratio": {"point": ratio, "low": ratio, "high": ratio}}

    curve = [{"recovery": "none", "train_seconds": 0.0, "cloze_retained": 0.88},
             {"recovery": "lora_lm@10", "train_seconds": 35.0, "cloze_retained": 0.94},
             {"recovery": "kd_full@40", "train_seconds": 290.0, "cloze_retained": 0.93},
             {"recovery": "lora_lm@40", "train_seconds": 2000.0, "cloze_retained": 0.95}]
    return {"args": {"model": ".pipprune/reference/smollm2-135m", "unit": "width", "method": "pip", "ratio": 0.2},
            "curve": curve,
            "summary": {"persuasion": {"variants": {"none": variant(2.0), "lora_lm@10": variant(1.46),
                                                    "kd_full@40": variant(1.41), "lora_lm@40": variant(1.2)}},
                        "wordnet": {"variants": {"none": variant(4.4), "lora_lm@10": variant(3.1),
                                                 "kd_full@40": variant(2.8), "lora_lm@40": variant(2.6)}}}}


def test_the_cheapest_recovery_meeting_the_target_is_named_else_the_closest_and_missed():
    persuasion, wordnet = _recovery_rows(_result())
    # lora_lm@10 is the cheapest that passes; lora_lm@40 is lower but over the 20-minute budget
    assert "(smollm2, width pip 0.2, persuasion)" in persuasion
    assert "| lora_lm@10: x1.46, cloze 94% of dense, 35 s | met |" in persuasion
    # nothing reaches x1.5 on wordnet: the lowest ratio is shown, and the row is missed
    assert "| lora_lm@40: x2.60, cloze 95% of dense, 2000 s | missed |" in wordnet


def test_a_recovery_over_the_time_budget_never_meets_the_target():
    result = _result()
    result["curve"] = [c for c in result["curve"] if c["recovery"] in ("none", "lora_lm@40")]
    persuasion, _ = _recovery_rows(result)  # x1.2 and 95% of the cloze, but 2000 s of training
    assert "| lora_lm@40: x1.20, cloze 95% of dense, 2000 s | missed |" in persuasion


def test_the_versus_row_is_missed_when_any_recovery_is_worse_and_ignores_no_recovery():
    from benchmarks.report import _versus_rows

    def row(recovery: str, held: str, verdict: str) -> dict:
        return {"recovery": recovery, "heldout": held, "kl": {"verdict": verdict}}

    result = {"a_pruning": "pip width 0.2", "b_pruning": "block_influence block 0.2",
              "rows": [row("none", "persuasion", "worse"), row("lora_lm@10", "persuasion", "better"),
                       row("kd_lora@10", "persuasion", "indistinguishable"), row("lora_lm@10", "wordnet", "better"),
                       row("kd_lora@10", "wordnet", "worse")]}
    persuasion, wordnet = _versus_rows(result)
    assert persuasion.endswith("| 1 better, 1 indistinguishable, 0 worse | met |")
    assert wordnet.endswith("| 1 better, 0 indistinguishable, 1 worse (kd_lora@10) | missed |")


def test_the_bench_wall_time_is_met_only_within_its_limit_and_a_reversed_interval_is_refused():
    import pytest

    from benchmarks.bench_wall import measure
    from benchmarks.report import _wall_row

    payload, table = measure(1000.0, 1000.0 + 76 * 60 + 14, "make bench", 90, "abc1234")
    assert payload["met"] and "| `make bench` | 76 min 14 s | 90 min |" in table[-1]
    assert _wall_row(payload).endswith("| 76 min 14 s | met |")
    over, _ = measure(1000.0, 1000.0 + 91 * 60, "make bench", 90, "abc1234")
    assert not over["met"] and _wall_row(over).endswith("| 91 min 0 s | missed |")
    with pytest.raises(ValueError, match="after the start"):
        measure(2000.0, 1000.0, "make bench", 90, "abc1234")
