"""MLflow access shared by tasks and commands: an explicit client, and params safe to log."""

from __future__ import annotations

import os
import re
from typing import Any

#: names and values that must never reach MLflow (credentials)
_SECRET_NAME = re.compile(r"(secret|password|passwd|token|credential|access_key|api_key|session_key)", re.I)
_ACCESS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b")
#: an AWS secret key: exactly 40 base64 characters, mixed case (hex digests are lowercase)
_SECRET_KEY = re.compile(r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+=]*[A-Z])(?=[A-Za-z0-9/+=]*[a-z])"
                         r"[A-Za-z0-9/+=]{40}(?![A-Za-z0-9/+=])")
MAX_PARAM_VALUE = 6000


def mlflow_client():  # noqa: ANN201
    """A client bound to the configured tracking URI (set by `prepare_runtime` / the environment)."""
    from mlflow import MlflowClient

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise RuntimeError("MLFLOW_TRACKING_URI is not set: start the stack (`pipprune stack up`) or "
                           "set PIPPRUNE_MLFLOW_TRACKING_URI")
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def looks_secret(text: str) -> bool:
    """True if `text` contains something shaped like an AWS access key id or secret key."""
    return bool(_ACCESS_KEY_ID.search(text) or _SECRET_KEY.search(text))


def flatten_params(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dict -> dotted keys with string values, secrets dropped, values truncated."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_params(value, f"{name}."))
            continue
        text = "" if value is None else str(value)
        if _SECRET_NAME.search(name) or looks_secret(text):
            continue
        flat[name] = text[:MAX_PARAM_VALUE]
    return flat
