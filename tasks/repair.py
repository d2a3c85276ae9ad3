"""repair_step: the closed-form repair of a width-pruned model against the dense one (pip_core.repair).

Runs right after each prune step, on the scoring texts (the texts the step's units were chosen on), so the next
step scores the repaired model. The dense model is read beside the model in hand for each repair and dropped after
it (no second model is kept through the run: the first run's memory target); the repaired model replaces the
pruned one in the hand-off.
"""

from __future__ import annotations

import logging
import statistics

from prefect import task
from pydantic import BaseModel, ConfigDict

from infra.config import RepairSettings, RuntimeSettings
from pip_core import io as core_io
from pip_core.repair import repair
from tasks._common import content_key, key_from
from tasks.calibration import read_texts
from tasks.models import load_model, save_model
from tasks.refs import CalibrationRef, ModelRef

log = logging.getLogger(__name__)


class RepairResult(BaseModel):
    """The repaired model and what the repair did (per consumer figures reduced to what a run shows)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelRef
    form: str
    #: calibration tokens the statistics summed over
    tokens: int
    #: consumers (o_proj, down_proj of a layer) repaired
    consumers: int
    #: mean over the repaired consumers of ||W X_p - Y_d|| / ||Y_d|| on the calibration tokens, before and after
    error_before: float
    error_after: float
    #: config switches turned on to give consumers a bias (the bias form)
    bias_switches: tuple[str, ...] = ()
    seconds: float = 0.0


@task(name="repair", cache_key_fn=key_from("model", "dense", "calib", "settings", "runtime"), persist_result=True,
      result_serializer="json")
def repair_step(model: ModelRef, dense: ModelRef, calib: CalibrationRef, settings: RepairSettings,
                runtime: RuntimeSettings = RuntimeSettings()) -> RepairResult:
    """Refit (or bias-compensate) every consumer of `model` that lost input columns, layer by layer, so that it
    reproduces `dense`'s outputs on the scoring texts; saved like any pruned step."""
    texts = read_texts(calib)
    net, tokenizer = load_model(model, runtime, for_update=True)
    reference = load_model(dense, runtime, transient=True)[0]
    report = repair(net, reference, tokenizer, texts, settings.options(calib.max_length))
    del reference
    num_params = core_io.param_count(net)  # the bias form adds (zero-initialised, then compensated) biases
    name = content_key(model.fingerprint, dense.fingerprint, calib.data_hash, settings.model_dump())
    repaired = save_model(net, tokenizer, f"{model.fingerprint[:16]}-{settings.form}-{name[:16]}", num_params)
    before = [c.error_before for c in report.consumers]
    after = [c.error_after for c in report.consumers]
    result = RepairResult(model=repaired, form=settings.form, tokens=report.tokens, consumers=len(report.consumers),
                          error_before=statistics.fmean(before) if before else 0.0,
                          error_after=statistics.fmean(after) if after else 0.0,
                          bias_switches=tuple(report.bias_switches), seconds=report.seconds)
    log.info("repair (%s): %d consumers, output error %.3f -> %.3f on %d tokens in %.1f s", settings.form,
             result.consumers, result.error_before, result.error_after, result.tokens, result.seconds)
    return result
