"""The in-memory hand-off of models between the tasks of one flow run (tasks.models.ModelHandoff)."""

from __future__ import annotations

from tasks.models import ModelHandoff


def test_update_takes_only_the_working_copy_and_the_reference_stays():
    handoff = ModelHandoff()
    dense, pruned, tok = object(), object(), object()
    handoff.put("dense", dense, tok, role="reference")
    handoff.put("dense", pruned, tok)  # the working copy of the same content, about to be pruned in place
    assert handoff.get("dense", take=True) == (pruned, tok)
    assert handoff.get("dense", take=True) is None  # the reference copy is never handed out for an update
    assert handoff.get("dense") == (dense, tok)  # read-only users still find it
    handoff.put("step-1", object(), tok)
    assert handoff.get("dense") == (dense, tok) and handoff.get("step-1") is not None
    assert handoff.get("unknown") is None


def test_a_model_read_from_disk_replaces_the_one_in_hand_before_it_is_read(monkeypatch):
    """A resumed run holds the dense model, then reads its checkpoint: the dense one must go first, or the
    process holds two models at once (measured on SmolLM2-135M: 1.75 GiB instead of 1.3)."""
    import weakref
    from types import SimpleNamespace

    from tasks import models
    from tasks.refs import ModelRef

    class Net:
        pass

    monkeypatch.setattr(models, "HANDOFF", ModelHandoff())
    alive_at_read: list[bool] = []
    dense = Net()
    dense_ref = weakref.ref(dense)

    def read(path, **_):
        alive_at_read.append(dense_ref() is not None)
        return Net(), "tokenizer"

    monkeypatch.setattr(models.core_io, "load", read)
    monkeypatch.setattr(models, "ensure_local", lambda ref, settings=None: ref.local_dir)
    monkeypatch.setattr(models, "placement_for", lambda *a, **k: SimpleNamespace(
        dtype=None, device="cpu", device_map=None, fits=False, describe=lambda: "cpu"))
    models.HANDOFF.put("dense", dense, "tokenizer")
    del dense
    models.load_model(ModelRef(local_dir="/ref", fingerprint="other", num_params=1), keep_slot=True)
    assert alive_at_read == [True]  # read beside the model in hand: that one stays
    step = models.load_model(ModelRef(local_dir="/step", fingerprint="step-1", num_params=1))[0]
    assert alive_at_read == [True, False]  # the model in hand was let go before the checkpoint was read
    assert models.HANDOFF.get("step-1") == (step, "tokenizer") and models.HANDOFF.get("dense") is None
