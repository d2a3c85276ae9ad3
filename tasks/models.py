"""Resolve a source model and make model refs available on local disk.

Hub ids and local paths go through the same code: a hub id is first materialised into the
Hugging Face cache (which honours HF_HUB_OFFLINE), then handled exactly like a local directory.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from prefect import task

from infra.config import RuntimeSettings
from infra.gguf_source import is_gguf, read_source_record
from infra.model_source import ModelNotFoundError, local_model_dir  # noqa: F401 - re-exported
from infra.settings import Settings
from pip_core import io as core_io
from pip_core.placement import Placement, plan_placement
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.refs import ModelRef, SourceRef

log = logging.getLogger(__name__)


@task(name="resolve-source", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS,
      retry_condition_fn=retry_transient)
def resolve_source(model_id: str) -> SourceRef:
    """Locate the source model, check it is a causal LM we can prune, and fingerprint it."""
    local = local_model_dir(model_id)
    core_io.check_loadable(local)
    fingerprint = core_io.model_fingerprint(local)
    num_params = core_io.param_count_from_dir(local)
    log.info("source %s -> %s (%d params, fingerprint %s)", model_id, local, num_params, fingerprint[:12])
    return SourceRef(model_id=model_id, model=ModelRef(local_dir=str(local), fingerprint=fingerprint,
                                                       num_params=num_params), gguf=_gguf_record(model_id, local))


def _gguf_record(model_id: str, local: Path) -> dict | None:
    """The GGUF record of a source given as a GGUF file, with where the file lies (for lineage to re-hash it)."""
    record = read_source_record(local)
    return {**record, "path": str(Path(model_id).expanduser().resolve())} if record and is_gguf(model_id) else None


def ensure_local(ref: ModelRef, settings: Settings | None = None) -> Path:
    """Return a local directory holding exactly `ref`, fetching its verified S3 copy if needed."""
    local = Path(ref.local_dir)
    if local.is_dir() and core_io.model_fingerprint(local) == ref.fingerprint:
        return local
    if not ref.s3_uri:
        raise FileNotFoundError(f"model {ref.fingerprint[:12]} is missing at {local} and has no S3 copy")
    from infra.s3store import CheckpointStore

    settings = settings or Settings()
    store = CheckpointStore.for_uri(settings, ref.s3_uri)
    store.download_uri(ref.s3_uri, local)
    if core_io.model_fingerprint(local) != ref.fingerprint:
        raise RuntimeError(f"model fetched from {ref.s3_uri} does not match fingerprint {ref.fingerprint[:12]}")
    return local


class ModelHandoff:
    """The models of this process's flow run in memory, keyed by their content fingerprints.

    Two slots. `working`: the model the last task loaded or produced; the tasks of one run hand it
    along (score -> prune -> quick eval -> next score) instead of each reading the same weights
    again. `reference`: a read-only copy of the dense source for the tasks that compare against it
    at every step (KL to dense, its lm-eval, its serving speed), kept only when memory holds two
    models. Cache keys and S3 checkpoints are untouched: a task still receives a `ModelRef`, and
    only a matching fingerprint uses the object in memory. A task that changes the model in place
    takes the working copy out first, so no other task sees it half-pruned; the reference copy is
    never handed out for update.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[str, tuple[str, Any, Any]] = {}

    def get(self, fingerprint: str, *, take: bool = False) -> tuple[Any, Any] | None:
        """The model with `fingerprint`; `take=True` (for an update) looks at the working slot only and empties it."""
        with self._lock:
            for role in ("working",) if take else ("working", "reference"):
                held = self._slots.get(role)
                if held is not None and held[0] == fingerprint:
                    if take:
                        del self._slots[role]
                    return held[1], held[2]
            return None

    def holds(self, role: str) -> bool:
        with self._lock:
            return role in self._slots

    def put(self, fingerprint: str, net: Any, tokenizer: Any, *, role: str = "working") -> None:
        with self._lock:
            self._slots[role] = (fingerprint, net, tokenizer)

    def drop(self, role: str) -> None:
        """Forget the model in `role`, so its memory can go before another model is read in its place."""
        with self._lock:
            self._slots.pop(role, None)


#: one per process: the flow's tasks run in the flow's process (Prefect's default thread runner)
HANDOFF = ModelHandoff()


def placement_for(ref: ModelRef, runtime: RuntimeSettings, seq_len: int = 128, loaded: bool = False) -> Placement:
    """Device, dtype, device map and gradient checkpointing for `ref` under `runtime` (see pip_core.placement).

    `loaded=True` when the weights already sit on the device: their bytes count as available.
    """
    config = core_io.read_config(ensure_local(ref))
    placement = plan_placement(config, runtime.device, runtime.dtype, seq_len,
                               activation_budget=runtime.activation_budget)
    if loaded and not placement.device_map:
        placement = plan_placement(config, runtime.device, runtime.dtype, seq_len,
                                   free_bytes=placement.free_bytes + placement.plan.weights,
                                   activation_budget=runtime.activation_budget)
    return placement


def load_model(ref: ModelRef, runtime: RuntimeSettings | None = None, *, for_update: bool = False,
               seq_len: int = 128, keep_slot: bool = False, transient: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) for `ref`: the object already in memory when its fingerprint matches, else from disk.

    Loaded in `runtime`'s dtype on its device (whole, or spread by device_map='auto' when it does
    not fit one GPU). `for_update=True` is for tasks that modify the model in place: the in-memory
    copy is taken out of the hand-off until the task puts back what it produced. `keep_slot=True`
    is for read-only use beside the model in hand (the dense model's KL, evaluation and serving
    speed): a copy read from disk goes to the reference slot, never evicting the working model, and
    only while memory holds a second copy. `transient=True` is for a one-off read that must not
    keep a copy at all (the dense model's held-out log-probabilities): the object in hand when
    there is one, else a copy read from disk that the caller drops.
    """
    held = HANDOFF.get(ref.fingerprint, take=for_update)
    if held is not None:
        return held
    if not (keep_slot or transient):  # what is read now becomes the model in hand: the one it replaces goes first
        HANDOFF.drop("working")  # (a resumed run read the dense model, then its checkpoint: two models at once)
    runtime = runtime or RuntimeSettings()
    placement = placement_for(ref, runtime, seq_len)
    net, tokenizer = core_io.load(ensure_local(ref), dtype=placement.dtype, device=placement.device,
                                  device_map=placement.device_map)
    log.info("loaded %s: %s", ref.fingerprint[:12], placement.describe())
    if transient:
        pass
    elif keep_slot and not HANDOFF.holds("working"):  # nothing in hand to keep it beside: it is the model in hand
        HANDOFF.put(ref.fingerprint, net, tokenizer)
    elif keep_slot:
        if _room_for_another(ref, runtime, seq_len):
            HANDOFF.put(ref.fingerprint, net, tokenizer, role="reference")
        else:
            log.info("reference copy of %s not kept: memory does not hold two models; read again when needed",
                     ref.fingerprint[:12])
    elif not for_update:
        HANDOFF.put(ref.fingerprint, net, tokenizer)
    return net, tokenizer


def _room_for_another(ref: ModelRef, runtime: RuntimeSettings, seq_len: int) -> bool:
    """After loading `ref`, does its device still have room for scoring a model of the same size?"""
    placement = placement_for(ref, runtime, seq_len)  # free memory measured now, with the copy loaded
    return placement.fits and not placement.device_map


def save_model(net, tokenizer, name: str, num_params: int) -> ModelRef:  # noqa: ANN001
    """Save `net` under the state dir's models/<name> atomically and hand it on to the next task."""
    out = Settings().work_dir / "models" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}.partial-", dir=out.parent))  # this call's own
    core_io.save_pruned(net, tokenizer, tmp)
    fingerprint = core_io.model_fingerprint(tmp)
    try:
        tmp.rename(out)
    except OSError:  # already there: names are content-addressed, so another run wrote these same weights
        shutil.rmtree(tmp, ignore_errors=True)
        if core_io.model_fingerprint(out) != fingerprint:
            raise RuntimeError(f"{out} holds other weights than its content-addressed name says") from None
    ref = ModelRef(local_dir=str(out), fingerprint=fingerprint, num_params=num_params)
    HANDOFF.put(ref.fingerprint, net, tokenizer)
    return ref
