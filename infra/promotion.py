"""Gated promotion: an alias moves to a model version only if its logged metrics pass every gate.

Gates come from a config file so the bar is reviewed like code, and every decision is recorded
on the version (who, when, why) so a later audit can see why a model became `champion`.
"""

from __future__ import annotations

import getpass
import math
import re
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra.signing import SignatureCheck
from infra.tags import PROMOTION, QUALITY_REASONS, QUALITY_VERDICT

#: MLflow's own alias rule, plus its reserved names
_ALIAS = re.compile(r"^[A-Za-z0-9_-]{1,255}$")
_RESERVED = re.compile(r"^(latest|v\d+)$", re.IGNORECASE)


class PromotionError(ValueError):
    """Bad promotion input (unknown version, invalid alias, bad gate file)."""


class PromotionGates(BaseModel):
    """The bar a version must clear. Metric names are those logged by the compress flow."""

    model_config = ConfigDict(extra="forbid")

    retained_min: dict[str, float] = Field(
        default_factory=dict,
        description="task.metric -> minimum final/source ratio, e.g. {'pipprune_wordnet_cloze.acc': 0.85}")
    perplexity_increase_max: float | None = Field(
        None, ge=0, description="maximum relative increase of held-out perplexity (0.5 = +50%)")
    param_reduction_min: float | None = Field(None, ge=0, le=1, description="minimum fraction of params removed")
    decode_speedup: str | None = Field(
        None, description='bound on the measured decode speedup over the dense model, e.g. ">= 1.2" '
                          "(metric serving.decode_speedup, logged by the flow's serving measurement)")
    metric_bounds: dict[str, str] = Field(
        default_factory=dict, description='any logged metric -> bound, e.g. {"serving.fraction_of_ideal": ">= 0.5"}')
    require_signature: bool = Field(
        True, description="the version's OpenSSF model signature must verify with the public key against the "
                          "model in S3 (false: promote unsigned versions too)")

    @field_validator("decode_speedup")
    @classmethod
    def _check_speedup(cls, value: str | None) -> str | None:
        if value is not None:
            parse_bound(value)
        return value

    @field_validator("metric_bounds")
    @classmethod
    def _check_bounds(cls, value: dict[str, str]) -> dict[str, str]:
        for bound in value.values():
            parse_bound(bound)
        return value

    def bounds(self) -> dict[str, str]:
        """Every metric bound, the decode_speedup shorthand included."""
        extra = {"serving.decode_speedup": self.decode_speedup} if self.decode_speedup else {}
        return {**self.metric_bounds, **extra}

    @classmethod
    def from_file(cls, path: Path) -> PromotionGates:
        from infra.config import read_yaml_mapping

        try:
            data = read_yaml_mapping(path, "gate file")
        except (FileNotFoundError, ValueError) as exc:
            raise PromotionError(str(exc)) from None
        return cls(**data.get("gates", data))


_BOUND = re.compile(r"^\s*(>=|<=|>|<|==)\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b,
    "==": lambda a, b: a == b}


def parse_bound(text: str) -> tuple[str, float]:
    """'>= 1.2' -> ('>=', 1.2); anything else is a ValueError naming the expected form."""
    match = _BOUND.match(str(text))
    if not match:
        raise ValueError(f"bound {text!r} is not OP NUMBER with OP one of >=, <=, >, <, == (e.g. \">= 1.2\")")
    return match.group(1), float(match.group(2))


class GateResult(BaseModel):
    gate: str
    passed: bool
    observed: float | None
    threshold: float
    detail: str


def check_alias(alias: str) -> None:
    if not _ALIAS.match(alias) or _RESERVED.match(alias):
        raise PromotionError(f"invalid alias {alias!r}: use letters, digits, '_' or '-', not 'latest' or 'v<N>'")


def evaluate_gates(gates: PromotionGates, metrics: dict[str, float]) -> list[GateResult]:
    """Compare logged `source.*` / `final.*` metrics with the gates; a missing metric fails its gate."""
    results: list[GateResult] = []
    for name, minimum in sorted(gates.retained_min.items()):
        src, fin = metrics.get(f"source.{name}"), metrics.get(f"final.{name}")
        if src is None or fin is None or not src:
            results.append(GateResult(gate=f"retained {name}", passed=False, observed=None, threshold=minimum,
                                      detail=f"metric source.{name} / final.{name} not logged for this version"))
            continue
        ratio = fin / src
        results.append(GateResult(gate=f"retained {name}", passed=ratio >= minimum, observed=ratio, threshold=minimum,
                                  detail=f"{fin:.4g} / {src:.4g} = {ratio:.3f} (need >= {minimum})"))
    if gates.perplexity_increase_max is not None:
        src, fin = metrics.get("source.heldout_perplexity"), metrics.get("final.heldout_perplexity")
        if src is None or fin is None:
            results.append(GateResult(gate="perplexity increase", passed=False, observed=None,
                                      threshold=gates.perplexity_increase_max, detail="held-out perplexity not logged"))
        else:
            rise = fin / src - 1.0
            results.append(GateResult(gate="perplexity increase", passed=math.isfinite(rise) and
                                      rise <= gates.perplexity_increase_max, observed=rise,
                                      threshold=gates.perplexity_increase_max,
                                      detail=f"{src:.4g} -> {fin:.4g} (+{rise:.1%}, max +{gates.perplexity_increase_max:.1%})"))
    if gates.param_reduction_min is not None:
        got = metrics.get("final.achieved_ratio")
        results.append(GateResult(gate="parameter reduction", passed=got is not None and got >= gates.param_reduction_min,
                                  observed=got, threshold=gates.param_reduction_min,
                                  detail="not logged" if got is None
                                  else f"{got:.2%} removed (need >= {gates.param_reduction_min:.2%})"))
    for name, bound in sorted(gates.bounds().items()):
        op, threshold = parse_bound(bound)
        got = metrics.get(name)
        label = "decode speedup" if name == "serving.decode_speedup" else name
        if got is None:
            results.append(GateResult(gate=label, passed=False, observed=None, threshold=threshold,
                                      detail=f"metric {name} not logged for this version"))
            continue
        results.append(GateResult(gate=label, passed=math.isfinite(got) and _COMPARE[op](got, threshold), observed=got,
                                  threshold=threshold, detail=f"{name} = {got:.4g} (need {op} {threshold:g})"))
    return results


class PromotionOutcome(BaseModel):
    name: str
    version: str
    alias: str
    promoted: bool
    changed: bool
    gates: list[GateResult]


def quality_gate(tags: dict[str, str]) -> list[GateResult]:
    """The run's own quality verdict (flows.records.quality_verdict): a version marked `not usable` never
    moves an alias, whatever the gates file says. Versions registered before verdicts existed have none."""
    verdict = tags.get(QUALITY_VERDICT)
    if verdict is None:
        return []
    reasons = tags.get(QUALITY_REASONS, "")
    return [GateResult(gate="quality verdict", passed=verdict != "not usable", observed=float(verdict == "usable"),
                       threshold=1.0, detail=f"{verdict}" + (f": {reasons}" if reasons else ""))]


def signature_gate(check: SignatureCheck | None) -> GateResult:
    """The signature as a gate: passed only when it verified (None: nothing could check it)."""
    if check is None:
        return GateResult(gate="signature", passed=False, observed=None, threshold=1.0,
                          detail="no signature verifier configured")
    detail = (f"verified with key {check.verified_with[:16]} ({check.files_verified} files)" if check.verified
              else "; ".join(check.problems))
    return GateResult(gate="signature", passed=check.verified, observed=float(check.verified), threshold=1.0,
                      detail=detail)


def promote(client, name: str, version: str, alias: str, gates: PromotionGates, reason: str = "",  # noqa: ANN001
            verify_signature: Callable[[dict[str, str]], SignatureCheck] | None = None) -> PromotionOutcome:
    """Set `alias` on `name`/`version` if every gate passes; otherwise change nothing.

    `verify_signature(version_tags)` checks the model signature when the gates require one.
    """
    from mlflow.exceptions import MlflowException

    check_alias(alias)
    try:
        mv = client.get_model_version(name, version)
    except MlflowException as exc:
        raise PromotionError(f"model {name!r} has no version {version!r}") from exc
    if not mv.run_id:
        raise PromotionError(f"{name} v{version} has no MLflow run to read metrics from")
    metrics = client.get_run(mv.run_id).data.metrics
    results = [*quality_gate(dict(mv.tags)), *evaluate_gates(gates, metrics)]
    if gates.require_signature:
        results.append(signature_gate(verify_signature(dict(mv.tags)) if verify_signature else None))
    passed = all(r.passed for r in results)
    if not passed:
        return PromotionOutcome(name=name, version=str(version), alias=alias, promoted=False, changed=False, gates=results)
    try:
        current = client.get_model_version_by_alias(name, alias).version
    except MlflowException:
        current = None
    if str(current) == str(version):
        return PromotionOutcome(name=name, version=str(version), alias=alias, promoted=True, changed=False, gates=results)
    client.set_registered_model_alias(name, alias, version)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    why = reason or "; ".join(r.detail for r in results) or "no gates configured"
    for key, value in {"by": getpass.getuser(), "at": now, "why": why[:4000],
                       "replaced_version": str(current or "")}.items():
        client.set_model_version_tag(name, version, PROMOTION.format(alias=alias, key=key), value)
    return PromotionOutcome(name=name, version=str(version), alias=alias, promoted=True, changed=True, gates=results)
