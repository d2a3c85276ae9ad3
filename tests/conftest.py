"""Test-wide environment (offline Hugging Face, no telemetry) and the shared fixtures."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from infra.stack import free_port
from tests.helpers import ROOT, seaweed_port_base

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUILDER = ROOT / "infra" / "reference"


def builder_digest() -> str:
    """Digest of the reference builder's sources: the cached tiny model is rebuilt when they change."""
    files = sorted(BUILDER.glob("*.py"))
    assert files, f"no reference builder sources under {BUILDER}"
    h = hashlib.sha256()
    for path in files:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _tiny_reference(threads: int | None = None) -> Path:
    """The built `tiny` reference (about two minutes the first time), under a file lock: one process builds it,
    any other waits for it. `threads`: torch threads for the build (the test processes run one each)."""
    from filelock import FileLock

    out = ROOT / ".pipprune" / "test-cache" / f"tiny-{builder_digest()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "manifest.json").is_file():
            import torch

            from infra.reference.build import build_reference

            before = torch.get_num_threads()
            torch.set_num_threads(threads or before)
            try:
                build_reference("tiny", out, ROOT / ".pipprune" / "cache", seed=0, progress=False)
            finally:
                torch.set_num_threads(before)
    return out


def pytest_configure(config) -> None:
    """With pytest-xdist workers, the controller builds the tiny reference with every core before the workers
    start: otherwise one worker builds it on one thread while the other waits on the lock (138 s each measured)."""
    workers = getattr(config.option, "numprocesses", None)
    is_worker = hasattr(config, "workerinput")
    wants_models = "not slow" not in (config.getoption("markexpr", "") or "")
    if workers and not is_worker and wants_models and not config.option.collectonly:
        _tiny_reference(threads=os.cpu_count())


@pytest.fixture(scope="session")
def tiny_reference_dir() -> Path:
    """Path to a built `tiny` reference model, reused across runs (see `_tiny_reference`)."""
    return _tiny_reference()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests that use the stack are marked `stack`, and those that build or load models `slow`, whatever their
    module says, so `make test-fast` (-m "not stack and not slow") is only pure unit tests."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & {"local_stack", "stack_env"}:
            item.add_marker(pytest.mark.stack)
        if names & {"tiny_reference_dir", "local_stack", "stack_env"}:
            item.add_marker(pytest.mark.slow)


def stack_settings(home: Path):  # infra.settings.Settings, imported lazily
    """Settings of an embedded stack in `home` on free loopback ports (S3 and the block SeaweedFS adds)."""
    from infra.settings import Settings

    return Settings(home=home, s3_port=free_port(), s3_aux_port_base=seaweed_port_base(),
                    mlflow_port=free_port(), prefect_port=free_port(), s3_endpoint_url=None, mlflow_tracking_uri=None,
                    prefect_api_url=None)


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory):
    """Yields (stack, settings): real S3 (SeaweedFS), MLflow and Prefect servers on free 127.0.0.1 ports, fresh state."""
    from infra.stack import LocalStack

    home = tmp_path_factory.mktemp("stack-home")
    settings = stack_settings(home)
    stack = LocalStack(settings)
    try:
        stack.up(wait=True, timeout=240)
        yield stack, settings
    finally:
        stack.down()


@pytest.fixture(scope="module")
def stack_env(local_stack, tmp_path_factory):
    """Environment of a client of the test stack, with its own state dir."""
    stack, settings = local_stack
    home = tmp_path_factory.mktemp("pipprune-home")
    env = {**stack.client_env(), "PIPPRUNE_HOME": str(home)}
    return env
