"""Sweeps: a grid over compress settings on top of a base config, and what a sweep reports (table, Pareto front).

A sweep file:

    base: {model: ..., calibration: ..., scoring: {method: pip}}   # any compress config (grouped or flat keys)
    grid:                                                          # every combination is one point
      ratio: [0.1, 0.2, 0.3]
      scoring.unit: [block, width]                                 # a group's field, dotted
    work_pool: pipprune          # optional: points run as deployment runs on this Prefect work pool
    concurrency: 2               # at most this many points at once (a Prefect global concurrency limit)
    gates: gates.yaml            # optional: the best point passing these gates gets `alias`
    alias: sweep-best

Each point is an ordinary `CompressConfig`; a point's key hashes its whole config with the code digest and the
source model's fingerprint, so two identical points are one point, and a rerun finds points already finished.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra.config import FLAT_KEYS, CompressConfig, read_yaml_mapping

#: the sweep's table, one row per point (what `pipprune sweep` prints and the parent run stores)
COLUMNS = ("point", "status", "params_removed", "achieved_ratio", "kl", "ppl_ratio", "decode_speedup", "wall_s",
           "mlflow_run_id", "model_version", "worker", "error")


class SweepConfig(BaseModel):
    """A grid of compress runs: `base` with each combination of `grid` values applied."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("sweep", description="the sweep's name (MLflow parent run, Prefect concurrency limit)")
    base: dict[str, Any] = Field(description="a compress config: the settings every point shares")
    grid: dict[str, list[Any]] = Field(description="setting (flat key, or group.field) -> values to try")
    work_pool: str | None = Field(None, description="Prefect work pool whose workers run the points "
                                  "(none: points run one after another in this process)")
    deployment: str = Field("sweep-point", description="name of the compress deployment the points run as")
    concurrency: int = Field(2, ge=1, le=1000, description="points running at once (Prefect global concurrency "
                             "limit `pipprune-sweep-<name>`)")
    gates: Path | None = Field(None, description="gates file (as `pipprune promote`): the best passing point "
                               "gets `alias`")
    alias: str = Field("sweep-best", description="registry alias given to the best point that passes `gates`")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", value):
            raise ValueError(f"sweep name {value!r}: use letters, digits, '.', '_' or '-' (at most 100)")
        return value

    @field_validator("grid")
    @classmethod
    def _check_grid(cls, value: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not value:
            raise ValueError("grid is empty: give at least one setting with a list of values")
        for key, values in value.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"grid.{key} must be a non-empty list of values")
        return value

    @classmethod
    def from_file(cls, path: Path) -> SweepConfig:
        data = read_yaml_mapping(path, "sweep file")
        if isinstance(data.get("gates"), str):
            data["gates"] = str((path.parent / data["gates"]).resolve())
        return cls(**data)

    def points(self) -> list[SweepPoint]:
        """Every combination of the grid as a validated compress config; duplicates collapse to one point."""
        keys = list(self.grid)
        seen: dict[str, SweepPoint] = {}
        for values in itertools.product(*(self.grid[k] for k in keys)):
            setting = dict(zip(keys, values, strict=True))
            config = CompressConfig(**apply_settings(self.base, setting))
            label = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in setting.items())
            digest = config.digest()
            if digest not in seen:
                seen[digest] = SweepPoint(label=label, setting=setting, config=config)
        return list(seen.values())


class SweepPoint(BaseModel):
    """One point of a sweep: the grid values that made it and its full compress config."""

    label: str
    setting: dict[str, Any]
    config: CompressConfig

    def key(self, source_fingerprint: str, code: str) -> str:
        """Identity of the point's result: its config, the source model's content and the code."""
        payload = json.dumps([self.config.model_dump(mode="json"), source_fingerprint, code], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:20]


def apply_settings(base: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any]:
    """`base` with each `key: value` of `setting` written in (flat keys to their group, dotted keys as paths)."""
    out = json.loads(json.dumps(base))
    for key, value in setting.items():
        path = key.split(".") if "." in key else list(FLAT_KEYS.get(key, (key,)))
        node = out
        for part in path[:-1]:
            current = node.get(part)
            if isinstance(current, str) and part == "calibration":
                current = {"source": current}
            node[part] = dict(current) if isinstance(current, dict) else {}
            node = node[part]
        node[path[-1]] = value
    return out


def point_row(label: str, status: str, metrics: dict[str, float], **extra: Any) -> dict[str, Any]:
    """One table row from a finished compress run's logged metrics (missing figures are NaN)."""
    def get(name: str) -> float:
        value = metrics.get(name)
        return float(value) if value is not None else math.nan

    before, after = get("source.num_params"), get("final.num_params")
    ppl_ratio = get("final.heldout_ppl_ratio")
    return {"point": label, "status": status, "params_removed": before - after,
            "achieved_ratio": get("final.achieved_ratio"), "kl": get("final.heldout_kl"),
            "ppl_ratio": ppl_ratio,
            "decode_speedup": get("serving.decode_speedup"), **extra}


def pareto_front(rows: list[dict[str, Any]], size: str = "achieved_ratio", quality: str = "kl") -> list[int]:
    """Indexes of the rows no other row beats on both: more removed (`size`, higher) and lower `quality` loss."""
    finite = [i for i, r in enumerate(rows) if math.isfinite(r.get(size, math.nan))
              and math.isfinite(r.get(quality, math.nan))]
    front = []
    for i in finite:
        a = rows[i]
        dominated = any(rows[j][size] >= a[size] and rows[j][quality] <= a[quality]
                        and (rows[j][size] > a[size] or rows[j][quality] < a[quality]) for j in finite if j != i)
        if not dominated:
            front.append(i)
    return front


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The sweep's table as markdown (figures rounded; failed points keep their error)."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else (f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}")
        return "-" if value in (None, "") else str(value).replace("|", "/")

    shown = [c for c in COLUMNS if c not in ("mlflow_run_id",)]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in shown) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def pareto_plot(rows: list[dict[str, Any]], title: str):  # noqa: ANN201 - matplotlib Figure
    """KL to the dense model against parameters removed, one dot per finished point, the Pareto front joined."""
    from infra.plots import plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    done = [r for r in rows if math.isfinite(r.get("achieved_ratio", math.nan)) and math.isfinite(r.get("kl", math.nan))]
    front = sorted((done[i] for i in pareto_front(done)), key=lambda r: r["achieved_ratio"])
    ax.scatter([100 * r["achieved_ratio"] for r in done], [r["kl"] for r in done], color="tab:blue", zorder=3,
               label="point")
    ax.plot([100 * r["achieved_ratio"] for r in front], [r["kl"] for r in front], color="tab:red", marker="o",
            zorder=2, label="Pareto front")
    for r in done:
        ax.annotate(r["point"], (100 * r["achieved_ratio"], r["kl"]), textcoords="offset points", xytext=(5, 5),
                    fontsize=7)
    xs = [100 * r["achieved_ratio"] for r in done] or [0.0]
    ax.set_xlim(min(xs) - 0.05 * (max(xs) - min(xs) + 1), max(xs) + 0.35 * (max(xs) - min(xs) + 1))
    ax.set_xlabel("parameters removed (%)")
    ax.set_ylabel("KL to the dense model, nats/token (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig
