"""The recover task (issue 47): it trains on the calibration's own recovery texts when it has them, computes the
teacher's outputs once and drops the teacher, and checkpoints only the layers its memory plan says must be."""

from __future__ import annotations

import json

import pytest

from pip_core import io as core_io


def _ref(path):
    from tasks.refs import ModelRef

    return ModelRef(local_dir=str(path), fingerprint=core_io.model_fingerprint(path),
                    num_params=core_io.param_count_from_dir(path))


@pytest.fixture()
def refs(tiny_reference_dir, tmp_path, monkeypatch):
    """(student, dense, calibration) refs: the tiny reference with a block removed, the reference, and a calibration
    whose recovery texts are 12 of the reference's texts (`recovery_path` None: the source's texts instead)."""
    from pip_core import prune, units
    from tasks.refs import CalibrationRef

    monkeypatch.setenv("PIPPRUNE_HOME", str(tmp_path / "home"))
    model, tokenizer = core_io.load(tiny_reference_dir, dtype="float32")
    prune.apply(model, units.discover(model, "block")[2:3])
    core_io.save_pruned(model, tokenizer, tmp_path / "student")
    source = tiny_reference_dir / "calibration" / "calibration.jsonl"
    texts = [json.loads(line)["text"] for line in source.read_text().splitlines()]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:4]))
    (tmp_path / "recovery.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[100:112]))
    calib = CalibrationRef(pairs_path=str(tmp_path / "pairs.jsonl"), heldout_path=str(tmp_path / "heldout.jsonl"),
                           data_hash="d", wordlist_hash="w", n_pairs=0, n_skipped=0, n_heldout=4,
                           source_path=str(source), source_digest="s", max_length=48,
                           recovery_path=str(tmp_path / "recovery.jsonl"), n_recovery=12)
    return _ref(tmp_path / "student"), _ref(tiny_reference_dir), calib


def test_kd_recovery_trains_on_the_recovery_texts_with_the_teacher_run_once_and_dropped(refs):
    from infra.config import RecoverySettings, RuntimeSettings
    from tasks.models import HANDOFF
    from tasks.recovery import recover

    student, dense, calib = refs
    settings = RecoverySettings(steps=3, kind="kd", batch_size=4)
    result = recover.fn(student, calib, settings, 0, RuntimeSettings(device="cpu"), dense)
    assert result.n_texts == 12 and result.tokens > 0 and len(result.losses) == 3
    assert 0 < result.teacher_seconds < result.seconds
    assert result.checkpointed_layers == 0  # a tiny model: the plan fits whatever this machine has
    assert HANDOFF.get(dense.fingerprint) is None  # the teacher is not kept once its outputs are taken
    lora = recover.fn(student, calib.model_copy(update={"recovery_path": None}),
                      RecoverySettings(steps=2, kind="lora", batch_size=4), 0, RuntimeSettings(device="cpu"))
    n_source = len(open(calib.source_path).read().splitlines())
    assert lora.n_texts == min(2048, n_source - 4)  # without recovery texts: the source's, less the held-out ones


def test_recovery_checkpoints_the_fewest_layers_the_memory_left_allows(refs, monkeypatch):
    """The run's target less what the process holds is the room: plenty, none checkpointed; enough for one layer
    checkpointed, one; a target that even every layer checkpointed misses (or no budget), none for the target."""
    import tasks.recovery as task
    from infra.config import RuntimeSettings
    from pip_core.memory_plan import plan_training
    from pip_core.recovery import RecoveryOptions, lora_params

    student, dense, _ = refs
    net, _ = core_io.load(student.local_dir, dtype="float32")
    options = RecoveryOptions(batch_size=4, max_length=48, chunk_tokens=16)
    target = int(task.MEMORY_TARGET * dense.num_params * 4)
    plan = plan_training(core_io.read_config(student.local_dir), "float32", 4, 48, lora_params(net, 8), 16)

    def layers(room: int, budget: float | None = 0.5) -> int:
        monkeypatch.setattr(task, "resident_bytes", lambda: target - room)
        return task.checkpointed_layers(net, student, dense, RuntimeSettings(device="cpu", activation_budget=budget),
                                        options, "kd")

    assert plan.layers > 2
    assert layers(plan.peak(0)) == 0
    assert layers(plan.peak(1)) == 1
    least = min(plan.peak(k) for k in range(plan.layers + 1))
    assert layers(least) == plan.layers - 1  # the last layer's backward comes first: rebuilding it saves nothing
    assert layers(least - 1) == 0  # out of reach: checkpointing would cost time and still miss it
    assert layers(plan.peak(1), budget=None) == 0  # no budget: only the memory actually free counts
