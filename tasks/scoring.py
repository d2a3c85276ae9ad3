"""score_units and select_units: unit scores on one model, then a validated choice of what to remove.

Every method (PIP and the baselines) goes through these same two tasks, so comparisons differ
only in the criterion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import get_args

import pandas as pd
import pandera.pandas as pa
from prefect import task

from infra import atomic
from infra.config import RuntimeSettings, ScoringSettings
from infra.memory import roomy_allocator
from infra.settings import Settings
from pip_core import schedule
from pip_core import units as core_units
from pip_core.importance import CalibrationData
from pip_core.schedule import ScoringOptions, StepSpec
from pip_core.vocabulary import FORWARD_ONLY_METHODS, PERTURBATION_METHODS, UnitKind
from tasks import parallel_scoring
from tasks._common import key_from
from tasks.calibration import read_pairs
from tasks.models import load_model, placement_for
from tasks.refs import CalibrationRef, ModelRef, PrunePlan, StatsRef

log = logging.getLogger(__name__)


class ScoreTable(pa.DataFrameModel):
    """One row per structural unit of the scored model."""

    unit_id: str = pa.Field(unique=True)
    kind: str = pa.Field(isin=list(get_args(UnitKind)))
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


def scoring_options(scoring: ScoringSettings, max_length: int, gradient_checkpointing: bool = False) -> ScoringOptions:
    """The config's scoring group as pip_core takes it."""
    return ScoringOptions(method=scoring.method, kind=scoring.unit, max_length=max_length,
                          protect_first=scoring.protect_first, protect_last=scoring.protect_last,
                          width_mode=scoring.width_mode, gradient_checkpointing=gradient_checkpointing,
                          align=scoring.align, width_split=scoring.width_split)


@task(name="score-units", cache_key_fn=key_from("model", "calib", "scoring", "spec", "runtime"),
      persist_result=True, result_serializer="json")
def score_units(model: ModelRef, calib: CalibrationRef, scoring: ScoringSettings, spec: StepSpec,
                runtime: RuntimeSettings = RuntimeSettings()) -> StatsRef:
    """Score every unit of `model` with the configured method (PIP: dual-view gradient differences).

    Gradients are reduced to float32/float64 per unit whatever the weights' dtype; gradient
    checkpointing is switched on when the plan says the activations do not fit, never for a forward-only
    criterion (no backward: it would save nothing and cost train mode). The PIP forms read the pairs' perturbed
    views; every other method reads all the scoring texts.
    """
    max_length = calib.max_length
    net, tokenizer = load_model(model, runtime, seq_len=max_length)
    placement = placement_for(model, runtime, max_length, loaded=True)
    started = time.perf_counter()
    pairs = read_pairs(calib)
    if scoring.method in PERTURBATION_METHODS and not calib.n_pairs:
        raise ValueError(f"method {scoring.method} compares perturbed views, but {calib.pairs_path} holds none: "
                         "prepare the calibration with perturb=True")
    lean = placement.gradient_checkpointing and scoring.method not in FORWARD_ONLY_METHODS
    options = scoring_options(scoring, max_length, lean)
    if parallel_scoring.wants_cluster(runtime, scoring.method):  # data-parallel over Dask workers: same scores
        found, scores = parallel_scoring.score_on_cluster(model, pairs, spec, options, runtime)
    else:
        with roomy_allocator() if scoring.method in FORWARD_ONLY_METHODS else nullcontext():
            found, scores = schedule.score_step(
                net, CalibrationData(tokenizer, pairs, texts=[original for original, _ in pairs]), spec, options)
    seconds = time.perf_counter() - started
    out = Settings().work_dir / "stats" / model.fingerprint[:16] / \
        f"{scoring.method}-{scoring.unit}-{calib.data_hash[:12]}-s{spec.seed}"
    out.mkdir(parents=True, exist_ok=True)
    columns = {"unit_id": [unit_id(u) for u in found], "kind": [u.kind for u in found],  # columns, not a dict per
               "layer": [u.layer for u in found], "index": [u.index for u in found],  # unit: 46k units of a 135M
               "num_params": [u.num_params for u in found], "score": list(scores)[:len(found)]}  # model, 10x less heap
    atomic.write_text(out / "stats.json", json.dumps(columns))
    log.info("%s scored %d %s units in %.1fs", scoring.method, len(found), scoring.unit, seconds)
    return StatsRef(path=str(out / "stats.json"), model_fingerprint=model.fingerprint, method=scoring.method,
                    unit=scoring.unit, n_units=len(found), seconds=seconds)


@task(name="select-units", cache_key_fn=key_from("stats", "scoring", "spec"), persist_result=True,
      result_serializer="json")
def select_units(stats: StatsRef, scoring: ScoringSettings, spec: StepSpec) -> PrunePlan:
    """Pick the lowest-scoring units worth the step's budget; write the validated score table behind the choice."""
    table = pd.DataFrame(json.loads(Path(stats.path).read_text()))  # columns (rows, as written before, read too)
    found = [core_units.Unit(kind=k, layer=int(lay), index=None if i is None or i != i else int(i), num_params=int(n))
             for k, lay, i, n in zip(table["kind"], table["layer"], table["index"], table["num_params"], strict=True)]
    chosen = schedule.select_step(found, table["score"].tolist(), spec, scoring_options(scoring, 0))
    chosen_ids = {unit_id(u) for u in chosen}
    table["index"] = table["index"].astype("float64")
    table["rank"] = table["score"].rank(method="first").astype(int) - 1
    table["selected"] = table["unit_id"].isin(chosen_ids)
    table = ScoreTable.validate(table, lazy=True)
    path = Path(stats.path).with_name(
        f"plan-{spec.params_to_remove}-p{scoring.protect_first}-{scoring.protect_last}-{scoring.width_mode}"
        f"-a{scoring.align}.csv")
    atomic.write_text(path, table.to_csv(index=False))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    selected = sum(u.num_params for u in chosen)
    log.info("plan: remove %d units (%d params; asked %d)", len(chosen), selected, spec.params_to_remove)
    return PrunePlan(table_path=str(path), table_sha256=digest,
                     units=tuple({"kind": u.kind, "layer": u.layer, "index": u.index, "num_params": u.num_params}
                                 for u in chosen),
                     params_to_remove=spec.params_to_remove, params_selected=selected)
