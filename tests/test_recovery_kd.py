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


@pytest.mark.parametrize("params,lr", [("lora", 2e-3), ("full", 2e-4), ("consumers", 1e-3)])
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
    if params == "consumers":  # only the modules that read pruned units and the norms moved; all trainable again
        from pip_core.recovery import consumer_params

        trained = set(consumer_params(out))
        assert any(n.endswith("o_proj.weight") for n in trained) and any(n.endswith("down_proj.weight")
                                                                            for n in trained)
        assert any("norm" in n for n in trained) and not any("q_proj" in n or "embed" in n for n in trained)
        moved = {n for n, p in out.named_parameters() if not torch.equal(p, _pruned(teacher).get_parameter(n))}
        assert moved and moved <= trained, moved - trained
        assert all(p.requires_grad for p in out.parameters())


def test_learning_rate_warms_up_then_decays_and_never_runs_at_zero():
    from pip_core.errors import PipCoreError
    from pip_core.recovery import RecoveryOptions, lr_schedule

    def rates(**kw) -> list[float]:
        options = RecoveryOptions(steps=16, lr=1.0, **kw)
        optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=options.lr)
        schedule, out = lr_schedule(optim, options), []
        for _ in range(options.steps):
            out.append(optim.param_groups[0]["lr"])
            optim.step()
            schedule.step()
        return out

    cosine = rates(warmup=0.125, decay="cosine")  # 2 warm-up steps
    assert cosine[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert all(a > b for a, b in zip(cosine[2:], cosine[3:], strict=False)) and 0 < cosine[-1] < 0.05
    assert rates(warmup=0.125, decay="constant")[2:] == [1.0] * 14
    assert rates(warmup=0.0, decay="cosine")[0] == 1.0
    assert rates() == [1.0] * 16  # the default: a constant rate (what the real-model comparison favoured)
    with pytest.raises(PipCoreError, match="decay"):
        rates(decay="linear")
    with pytest.raises(PipCoreError, match="warmup"):
        rates(warmup=1.5)


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


def _batch(tokenizer, texts: list[str], max_length: int = 48):
    batch = tokenizer(texts, return_tensors="pt", truncation=True, max_length=max_length, padding=True,
                      padding_side="right")
    return batch["input_ids"], batch["attention_mask"]


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (2.5, 1000)])
def test_cached_teacher_loss_and_gradient_equal_the_live_teacher_and_the_whole_logits(dense, tiny_reference_dir,
                                                                                     temperature, chunk):
    """Issue 47: the teacher's final hidden states computed once (in other batches, other padding) give the loss and
    gradients of the teacher run on the batch, and of the whole-logits reference."""
    from pip_core.distill import full_logits_kd_loss, kd_loss, teacher_outputs

    teacher, tokenizer = dense
    student = _pruned(teacher)
    texts = [t[:n] for t, n in zip(_texts(tiny_reference_dir, 4), (60, 400, 150, 90), strict=True)]
    ids, mask = _batch(tokenizer, texts)
    assert (mask == 0).any()
    rows = tokenizer(texts[::-1] + texts[:1], truncation=True, max_length=48)["input_ids"]  # other order, a repeat
    cached = teacher_outputs(teacher, rows, batch_size=3)
    assert len(cached.hidden) == 4 and cached.nbytes == int(mask.sum()) * teacher.config.hidden_size * 4

    results = []
    for source in (cached, teacher):
        loss = kd_loss(student, source, ids, mask, temperature, chunk_tokens=chunk)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}))
        student.zero_grad(set_to_none=True)
    ref = full_logits_kd_loss(student, teacher, ids, mask, temperature)
    ref.backward()
    for loss, grads in results:
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=0)
        for name, p in student.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_teacher_outputs_refuse_a_text_they_were_not_computed_on_and_share_an_equal_head(dense, tiny_reference_dir):
    from pip_core.distill import kd_loss, teacher_outputs
    from pip_core.errors import PipCoreError

    teacher, tokenizer = dense
    texts = _texts(tiny_reference_dir, 3)
    ids, mask = _batch(tokenizer, texts)
    cached = teacher_outputs(teacher, tokenizer(texts[:2], truncation=True, max_length=48)["input_ids"])
    with pytest.raises(PipCoreError, match="no cached teacher outputs for batch row 2"):
        kd_loss(teacher, cached, ids, mask)
    student = _pruned(teacher)  # blocks removed: the LM head is the teacher's, equal but another tensor
    shared = cached.with_head_of(student)
    assert shared.head is student.lm_head and cached.head is teacher.lm_head
    changed = copy.deepcopy(student)
    with torch.no_grad():
        changed.lm_head.weight[0, 0] += 1.0
    assert cached.with_head_of(changed).head is teacher.lm_head  # a head that differs is never shared
    with torch.no_grad():
        torch.testing.assert_close(kd_loss(student, shared, ids[:2], mask[:2]), kd_loss(student, teacher, ids[:2],
                                                                                     mask[:2]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("params,lr", [("lora", 2e-3), ("full", 2e-4)])
def test_recovery_on_cached_teacher_outputs_gives_the_weights_of_the_live_teacher(dense, tiny_reference_dir, params,
                                                                                  lr):
    """Same seed, same batches: KD on the teacher's outputs computed once ends at the weights of KD that runs the
    teacher on every batch (the loop HEAD ran), within float tolerance; handing the outputs over is the same run."""
    from pip_core.distill import kd_loss
    from pip_core.recovery import RecoveryOptions, _distil, kd_teacher_outputs, recover_kd

    teacher, tokenizer = dense
    texts = _texts(tiny_reference_dir, 10)
    options = RecoveryOptions(steps=6, kd_params=params, lr=lr, batch_size=4, max_length=48, seed=3, chunk_tokens=16,
                              progress=False)

    def live(model, batch):
        return kd_loss(model, teacher, batch["input_ids"], batch["attention_mask"], options.temperature, 16)

    ref, ref_report = _distil(_pruned(teacher), live, tokenizer, texts, options)
    cached, report = recover_kd(_pruned(teacher), teacher, tokenizer, texts, options)
    student = _pruned(teacher)
    handed, handed_report = recover_kd(student, kd_teacher_outputs(teacher, tokenizer, texts, options, student),
                                       tokenizer, texts, options)
    assert report.tokens == ref_report.tokens and report.losses[0] == pytest.approx(ref_report.losses[0], rel=1e-5)
    assert handed_report.losses == report.losses
    reference = dict(ref.named_parameters())
    for name, p in cached.named_parameters():
        torch.testing.assert_close(p, reference[name], rtol=1e-4, atol=1e-6, msg=name)
    for (name, p), q in zip(handed.named_parameters(), cached.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_batches_show_every_text_once_per_pass():
    """With as many texts as steps x batch every text is seen once; with more steps, each text once per pass;
    the order is the seed's."""
    from pip_core.recovery import _order

    once = _order(24, steps=6, batch_size=4, seed=0)
    assert len(once) == 6 and all(len(b) == 4 for b in once)
    assert sorted(i for b in once for i in b) == list(range(24))
    twice = [i for b in _order(24, steps=12, batch_size=4, seed=0) for i in b]
    assert sorted(twice[:24]) == sorted(twice[24:]) == list(range(24))
    assert _order(24, 6, 4, seed=0) == once and _order(24, 6, 4, seed=1) != once
    assert all(sorted(b) == [0, 1, 2] for b in _order(3, 2, 8, seed=0))  # a batch never holds more than the texts
