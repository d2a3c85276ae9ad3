"""Validated configuration of one compress job.

One object describes the whole job so that its content hash can key caches, name S3 prefixes and
be recorded in lineage. Unknown keys are rejected: a typo in a config file must not silently
fall back to a default.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

UnitKind = Literal["block", "attn", "mlp", "width"]
Method = Literal["pip", "random", "magnitude", "taylor", "block_influence"]

#: CLI spellings accepted for methods (the design card writes "block-influence").
METHOD_ALIASES = {"block-influence": "block_influence"}


class RecoverySettings(BaseModel):
    """Optional LoRA recovery fine-tuning after the last pruning step; `steps == 0` (default) is off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(0, ge=0, le=1_000_000, description="LoRA training steps on the calibration texts")
    rank: int = Field(8, ge=1, le=1024)
    lr: float = Field(2e-3, gt=0.0, le=1.0)
    batch_size: int = Field(8, ge=1, le=4096)
    max_texts: int = Field(2048, ge=1, le=10_000_000,
                           description="calibration texts to train on (held-out texts never included)")

    @property
    def enabled(self) -> bool:
        return self.steps > 0


class CompressConfig(BaseModel):
    """Everything that determines the output of a compress run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face hub id or local directory of a causal LM")
    ratio: float = Field(0.2, description="fraction of the source model's parameters to remove")
    unit: UnitKind = "block"
    method: Method = "pip"
    iterations: int = Field(4, ge=1, le=100)
    calibration: str = Field(description="JSONL/TXT calibration file, or a reference model dir")
    wordlist: str | None = Field(None, description="word list deciding real words (perturber)")
    n_samples: int = Field(32, ge=1, le=100_000)
    heldout_samples: int = Field(16, ge=0, le=100_000)
    max_length: int = Field(128, ge=2, le=32_768)
    perturb_rate: float = Field(0.15, gt=0.0, le=1.0)
    seed: int = 0
    protect_first: int = Field(1, ge=0)
    protect_last: int = Field(1, ge=0)
    eval_tasks: tuple[str, ...] = ()
    eval_include_path: str | None = None
    eval_limit: int | None = Field(None, ge=1)
    recovery: RecoverySettings = RecoverySettings()
    registered_model_name: str = "pipprune-model"
    trust_remote_code: bool = False

    @field_validator("method", mode="before")
    @classmethod
    def _alias_method(cls, value: object) -> object:
        return METHOD_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("ratio")
    @classmethod
    def _check_ratio(cls, value: float) -> float:
        if math.isnan(value) or not 0.0 < value <= 0.9:
            raise ValueError(f"ratio must be in (0, 0.9], got {value}")
        return value

    @field_validator("eval_tasks", mode="before")
    @classmethod
    def _split_tasks(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(t.strip() for t in value.split(",") if t.strip())
        return value

    @field_validator("registered_model_name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not value or len(value) > 200 or any(c in value for c in "/\\:%"):
            raise ValueError(f"invalid registered model name {value!r}")
        return value

    @model_validator(mode="after")
    def _check_method_unit(self) -> "CompressConfig":
        if self.method == "block_influence" and self.unit != "block":
            raise ValueError("method 'block_influence' (ShortGPT) scores whole blocks: use --unit block")
        return self

    def digest(self) -> str:
        """Stable hash of the settings that change the result (not of paths' spelling alone)."""
        payload = self.model_dump(mode="json")
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load_config_file(path: Path, **overrides: object) -> CompressConfig:
    """Read a YAML/JSON config file; CLI values given explicitly override file values."""
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    for key, value in overrides.items():
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}  # e.g. --recovery-steps keeps the file's recovery.rank
        else:
            data[key] = value
    return CompressConfig(**data)
