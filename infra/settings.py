"""Settings from the environment (prefix PIPPRUNE_). No secrets live here: S3 credentials come from
the standard AWS chain (or, for the embedded stack, its 0600 credentials file), so nothing that
logs settings can leak them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_BUCKET = re.compile(r"^(?!xn--)(?!.*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: SeaweedFS' internal ports, unless PIPPRUNE_S3_AUX_PORT_BASE is set, take block number (s3_port mod 1000) of
#: 1000 blocks of 10 ports in 10000-19999; their admin gRPC ports (admin + 10000) then fall in 20007-29997.
#: So two stacks whose S3 ports differ mod 1000 never share an internal port, and no internal port can be a
#: default main port (9310, 5310, 4310) or in Linux's ephemeral range (32768+) where clients' sockets land.
AUX_PORT_FIRST, AUX_PORT_STRIDE, AUX_PORT_BLOCKS = 10000, 10, 1000


def default_aux_port_base(s3_port: int) -> int:
    """The first internal SeaweedFS port of a stack whose S3 port is `s3_port` (9310 -> 13100)."""
    return AUX_PORT_FIRST + AUX_PORT_STRIDE * (s3_port % AUX_PORT_BLOCKS)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PIPPRUNE_", env_nested_delimiter="__", extra="ignore")

    home: Path = Field(default_factory=lambda: Path(".pipprune"), description="state dir (work files, stack data)")
    s3_endpoint_url: str | None = None
    s3_bucket: str = "pipprune"
    s3_region: str = "us-east-1"
    s3_max_attempts: int = Field(4, ge=1, le=20)
    mlflow_tracking_uri: str | None = None
    prefect_api_url: str | None = None
    s3_port: int = Field(9310, ge=1, le=65535)
    s3_aux_port_base: int | None = Field(None, ge=1, le=65535 - AUX_PORT_STRIDE - 10000,
                                         description="first of 10 consecutive ports the embedded S3 server "
                                                     "(SeaweedFS) opens besides S3 (master, volume, filer, admin, "
                                                     "gRPC); its admin gRPC port is the admin port (base + 7) + "
                                                     "10000; unset: derived from s3_port (aux_port_base)")
    mlflow_port: int = Field(5310, ge=1, le=65535)
    prefect_port: int = Field(4310, ge=1, le=65535)
    registered_model_name: str = "pipprune-model"
    signing_key: Path | None = Field(None, description="PEM EC private key that signs every registered model "
                                     "(OpenSSF model-signing); default: the install's key under home/keys")
    auto_stack: bool = Field(True, description="start the embedded stack when it is down and no endpoint is set; "
                                               "false (or --no-auto-stack) makes that an error, for schedulers")

    @field_validator("home")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @field_validator("signing_key", mode="before")
    @classmethod
    def _key_path(cls, value: object) -> Path | None:
        return Path(value).expanduser().resolve() if value not in (None, "") else None  # type: ignore[arg-type]

    @field_validator("s3_bucket")
    @classmethod
    def _bucket(cls, value: str) -> str:
        if not _BUCKET.match(value) or re.match(r"^\d+\.\d+\.\d+\.\d+$", value):
            raise ValueError(f"invalid S3 bucket name {value!r}: 3-63 lowercase letters, digits, '.' or '-', "
                             "starting and ending with a letter or digit")
        return value

    @property
    def work_dir(self) -> Path:
        return self.home / "work"

    @property
    def stack_dir(self) -> Path:
        return self.home / "stack"

    @property
    def aux_port_base(self) -> int:
        """PIPPRUNE_S3_AUX_PORT_BASE when set, else derived from the S3 port: a second stack needs only its own
        PIPPRUNE_S3_PORT (and MLflow/Prefect ports) to run beside the first."""
        return self.s3_aux_port_base if self.s3_aux_port_base is not None else default_aux_port_base(self.s3_port)

    def uses_embedded_stack(self) -> bool:
        """True when no endpoint is configured: the local stack on 127.0.0.1 is the default."""
        return not (self.s3_endpoint_url or self.mlflow_tracking_uri or self.prefect_api_url)

    def safe_dump(self) -> dict[str, str]:
        """Settings for logs and lineage; holds no credentials by construction."""
        return {k: str(v) for k, v in self.model_dump().items()}


def apply_process_env(settings: Settings) -> None:
    """Point Prefect, MLflow and Hugging Face at the state dir, offline and without telemetry."""
    home = settings.home
    defaults = {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # bounded retries: a dead tracking server fails the run in seconds, not minutes
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if settings.mlflow_tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = settings.mlflow_tracking_uri
    if settings.prefect_api_url:
        os.environ["PREFECT_API_URL"] = settings.prefect_api_url
