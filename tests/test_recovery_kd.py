"""Distillation recovery (issue 22, point 7): the chunked KD loss equals the whole-logits reference,
a few KD steps bring the pruned model's distribution closer to the dense one, the teacher never
changes, and bad settings are refused with the field named."""

from __future__ import annotations

import copy

import pytest
import torch

from pip_core import io as core_io


@pytest.fixture(scope="module")
def dense(tiny_reference_dir):
    model, tokenizer = core_io.load(tiny_reference_dir, dtype="float32")
    return model, tokenizer


def _pruned(model, n_blocks: int = 1):
    """A copy of `model` with its middle block(s) removed (a real pruned student)."""
    from pip_core import prune, units

    student = copy.deepcopy(model)
    blocks = [u for u in units.discover(student, "block")]
    middle = len(blocks) // 2
    prune.apply(student, blocks[middle:middle + n_blocks])
    return student


def _texts(ref, n: int, split: str = "calibration") -> list[str]:
    import json

    path = ref / ("calibration/calibration.jsonl" if split == "calibration" else "tasks/persuasion.jsonl")
    return [json.loads(line)["text"] for line in path.read_text().splitlines()[:n]]


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (2.5, 16), (0.7, 1000)])
def test_chunked_kd_loss_and_its_gradient_equal_the_whole_logits_reference(dense, tiny_reference_dir, temperature,
                                                                           chunk):
    from pip_core.distill import full_logits_kd_loss, kd_loss

    teacher, tokenizer = dense
    student = _pruned(teacher)
    texts = [t[:n] for t, n in zip(_texts(tiny_reference_dir, 3), (60, 400, 150), strict=True)]
    batch = tokenizer(texts, return_tensors="pt", truncation=True, max_length=48, padding=True)
    assert (batch["attention_mask"] == 0).any()  # padding is part of the check
    ids, mask = batch["input_ids"], batch["attention_mask"]

    loss = kd_loss(student, teacher, ids, mask, temperature, chunk_tokens=chunk)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad(set_to_none=True)
    ref = full_logits_kd_loss(student, teacher, ids, mask, temperature)
    ref.backward()
    assert loss.item() > 0
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=0)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert all(p.grad is None for p in teacher.parameters())


def test_kd_loss_of_the_teacher_against_itself_is_zero(dense, tiny_reference_dir):
    from pip_core.distill import kd_loss

    teacher, tokenizer = dense
    batch = tokenizer(_texts(tiny_reference_dir, 2), return_tensors="pt", truncation=True, max_length=32, padding=True)
    with torch.no_grad():
        assert abs(kd_loss(teacher, teacher, batch["input_ids"], batch["attention_mask"], 2.0, 5).item()) < 1e-6


@pytest.mark.parametrize("params,lr", [("lora", 2e-3), ("full", 2e-4)])
def test_a_few_kd_steps_reduce_kl_to_the_dense_model(dense, tiny_reference_dir, params, lr):
    from pip_core.divergence import divergence
    from pip_core.recovery import RecoveryOptions, recover_kd

    teacher, tokenizer = dense
    before_teacher = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    student = _pruned(teacher)
    held = _texts(tiny_reference_dir, 12, "heldout")
    kl_before = divergence(teacher, student, tokenizer, held, max_length=64)["kl"]
    n_params = core_io.param_count(student)
    options = RecoveryOptions(steps=12, kd_params=params, lr=lr, batch_size=4, max_length=64, seed=0, chunk_tokens=16,
                              progress=False)
    out, report = recover_kd(student, teacher, tokenizer, _texts(tiny_reference_dir, 200), options)
    kl_after = divergence(teacher, out, tokenizer, held, max_length=64)["kl"]
    assert kl_after < 0.9 * kl_before, (kl_before, kl_after)
    assert len(report.losses) == 12 and report.last_loss < report.first_loss
    assert core_io.param_count(out) == n_params
    assert not any("lora" in name for name, _ in out.named_parameters())  # merged back: a plain HF model
    for name, p in teacher.named_parameters():
        assert torch.equal(p, before_teacher[name]), name
        assert p.requires_grad  # restored


def test_kd_refuses_bad_settings(dense, tiny_reference_dir):
    from pydantic import ValidationError

    from infra.config import RecoverySettings
    from pip_core.distill import kd_loss
    from pip_core.errors import PipCoreError
    from pip_core.recovery import RecoveryOptions, recover_kd

    teacher, tokenizer = dense
    with pytest.raises(PipCoreError, match="params must be one of"):
        recover_kd(copy.deepcopy(teacher), teacher, tokenizer, ["a text"], RecoveryOptions(steps=1, kd_params="half"))
    batch = tokenizer(["some words here"], return_tensors="pt")
    with pytest.raises(PipCoreError, match="temperature must be > 0"):
        kd_loss(teacher, teacher, batch["input_ids"], batch["attention_mask"], temperature=0.0)
    with pytest.raises(ValidationError, match="recovery.kind|kind"):
        RecoverySettings(steps=5, kind="distill")
    with pytest.raises(ValidationError, match="kd_params"):
        RecoverySettings(steps=5, kind="kd", kd_params="half")
    with pytest.raises(ValidationError, match="temperature"):
        RecoverySettings(steps=5, kind="kd", temperature=0)
    assert RecoverySettings().kind == "lora"  # default: today's LoRA on the LM loss
