"""What every task shares: content-addressed cache keys and a retry policy for transient faults."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

from prefect.context import TaskRunContext
from prefect.tasks import exponential_backoff

from infra.version import code_digest

#: retries for steps that talk to S3 or MLflow; bounded so a dead server fails the run clearly.
RETRIES = 3
RETRY_DELAYS = exponential_backoff(backoff_factor=2)


def content_key(*parts: Any) -> str:
    """Hash JSON-able parts (hashes, configs) together with the code digest."""
    payload = json.dumps([code_digest(), *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def key_from(*param_names: str) -> Callable[[TaskRunContext, dict[str, Any]], str]:
    """A Prefect cache_key_fn over the named parameters plus the task's own name.

    The task name is part of the key because Prefect's INPUTS policy alone lets two tasks with
    equal inputs return each other's results (see the stack notes). Parameters must be content
    descriptors (hashes, refs, configs), never live objects. The state dir is part of the key
    too: results name files under it, which exist only on the machine (and dir) that wrote
    them; across machines, runs resume from the S3 checkpoints instead.
    """

    def _key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
        from infra.settings import Settings

        parts = [context.task.name, str(Settings().work_dir)]
        for name in param_names:
            value = parameters.get(name)
            if hasattr(value, "model_dump"):
                value = value.model_dump(mode="json")
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            parts.append(value)
        return content_key(*parts)

    return _key


def is_transient(exc: BaseException) -> bool:
    """True for network/server faults worth retrying; False for bad input and bugs.

    A wrapper is judged by what it wraps: boto3's `upload_file` turns an S3 500 ("InternalError", seen
    from SeaweedFS under load) into an `S3UploadFailedError` raised while handling the ClientError.
    """
    inner = exc.__cause__ or exc.__context__
    if inner is not None and inner is not exc and is_transient(inner):
        return True
    try:
        import botocore.exceptions as bce
    except ImportError:  # pragma: no cover - boto3 is a dependency
        bce = None
    if bce is not None:
        if isinstance(exc, (bce.EndpointConnectionError, bce.ConnectionClosedError,
                            bce.ReadTimeoutError, bce.ConnectTimeoutError)):
            return True
        if isinstance(exc, bce.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = exc.response.get("Error", {}).get("Code", "")
            return status >= 500 or code in {"SlowDown", "Throttling", "RequestTimeout"}
    name = type(exc).__name__
    if name in {"ConnectionError", "ConnectTimeout", "ReadTimeout", "ConnectionRefusedError"}:
        return True
    if name == "MlflowException" or name == "RestException":
        text = str(exc)
        return any(s in text for s in ("Connection", "503", "502", "504", "500", "Max retries"))
    return isinstance(exc, (ConnectionError, TimeoutError))


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry_condition_fn: retry only transient faults."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - we classify, not handle
        return is_transient(exc)
    return False
