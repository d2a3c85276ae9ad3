"""collect_dual_view_gradients and score: unit statistics on one model, then a validated prune plan.

Every method (PIP and the baselines) goes through these same two tasks, so comparisons differ
only in the criterion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path

import pandas as pd
import pandera.pandas as pa
from prefect import task

from infra.settings import Settings
from pip_core import importance, prune, units as core_units
from pip_core import io as core_io
from tasks._common import key_from
from tasks.calibration import read_pairs
from tasks.models import ensure_local
from tasks.refs import CalibrationRef, ModelRef, PrunePlan, StatsRef

log = logging.getLogger(__name__)


class ScoreTable(pa.DataFrameModel):
    """One row per structural unit of the scored model."""

    unit_id: str = pa.Field(unique=True)
    kind: str = pa.Field(isin=["block", "attn", "mlp"])
    layer: int = pa.Field(ge=0)
    index: float = pa.Field(nullable=True, ge=0)
    num_params: int = pa.Field(gt=0)
    score: float = pa.Field(nullable=False)
    rank: int = pa.Field(ge=0)
    selected: bool

    @pa.dataframe_check
    def finite_scores(cls, df: pd.DataFrame) -> pd.Series:
        return df["score"].map(math.isfinite)


def unit_id(unit: core_units.Unit) -> str:
    return f"{unit.kind}:{unit.layer}" + ("" if unit.index is None else f":{unit.index}")


@task(name="collect-dual-view-gradients", cache_key_fn=key_from("model", "calib", "method", "unit", "seed",
                                                                "max_length"),
      persist_result=True, result_serializer="json")
def collect_dual_view_gradients(model: ModelRef, calib: CalibrationRef, method: str, unit: str, seed: int,
                                max_length: int) -> StatsRef:
    """Score every unit of `model` (PIP: per-pair gradient-difference norms, reduced as they arrive)."""
    model_dir = ensure_local(model)
    net, tokenizer = core_io.load(model_dir)
    found = core_units.discover(net, unit)
    started = time.perf_counter()
    pairs = read_pairs(calib)
    scores = importance.score(net, method, found, tokenizer=tokenizer, pairs=pairs,
                              texts=[original for original, _ in pairs], seed=seed, max_length=max_length)
    seconds = time.perf_counter() - started
    out = Settings().work_dir / "stats" / model.fingerprint[:16] / f"{method}-{unit}-{calib.data_hash[:12]}-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"unit_id": unit_id(u), "kind": u.kind, "layer": u.layer, "index": u.index,
             "num_params": u.num_params, "score": float(s)} for u, s in zip(found, scores.tolist())]
    (out / "stats.json").write_text(json.dumps(rows))
    log.info("%s scored %d %s units in %.1fs", method, len(found), unit, seconds)
    return StatsRef(path=str(out / "stats.json"), model_fingerprint=model.fingerprint, method=method,
                    unit=unit, n_units=len(found), seconds=seconds)


@task(name="score", cache_key_fn=key_from("stats", "params_to_remove", "protect_first", "protect_last"),
      persist_result=True, result_serializer="json")
def score(stats: StatsRef, params_to_remove: int, protect_first: int, protect_last: int) -> PrunePlan:
    """Rank units, pick the lowest-scoring ones worth `params_to_remove`, and validate the table."""
    rows = json.loads(Path(stats.path).read_text())
    found = [core_units.Unit(kind=r["kind"], layer=r["layer"], index=r["index"], num_params=r["num_params"])
             for r in rows]
    chosen = prune.select(found, [r["score"] for r in rows], params_to_remove,
                          protect_first=protect_first, protect_last=protect_last)
    chosen_ids = {unit_id(u) for u in chosen}
    table = pd.DataFrame(rows)
    table["index"] = table["index"].astype("float64")
    table["rank"] = table["score"].rank(method="first").astype(int) - 1
    table["selected"] = table["unit_id"].isin(chosen_ids)
    table = ScoreTable.validate(table, lazy=True)
    path = Path(stats.path).with_name(f"plan-{params_to_remove}-p{protect_first}-{protect_last}.csv")
    table.to_csv(path, index=False)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    selected = sum(u.num_params for u in chosen)
    log.info("plan: remove %d units (%d params; asked %d)", len(chosen), selected, params_to_remove)
    return PrunePlan(table_path=str(path), table_sha256=digest,
                     units=tuple({"kind": u.kind, "layer": u.layer, "index": u.index, "num_params": u.num_params}
                                 for u in chosen),
                     params_to_remove=params_to_remove, params_selected=selected)
