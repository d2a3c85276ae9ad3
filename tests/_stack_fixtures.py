"""Session-scoped local stack (moto S3, MLflow, Prefect servers) on free 127.0.0.1 ports."""

from __future__ import annotations

import socket

import pytest

from pipprune.infra.settings import Settings
from pipprune.infra.stack import LocalStack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory):
    """Yields (stack, settings); every test session gets fresh servers and state."""
    home = tmp_path_factory.mktemp("stack-home")
    settings = Settings(home=home, s3_port=free_port(), mlflow_port=free_port(), prefect_port=free_port(),
                        s3_endpoint_url=None, mlflow_tracking_uri=None, prefect_api_url=None)
    stack = LocalStack(settings)
    try:
        stack.up(wait=True, timeout=240)
        yield stack, settings
    finally:
        stack.down()
