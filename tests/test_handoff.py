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
