"""Test-wide environment (offline Hugging Face, no telemetry) and the shared fixtures."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from infra.stack import free_stack_ports
from tests.helpers import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUILDER = ROOT / "infra" / "reference"
#: training steps of the suite's tiny model: the `tiny` size trains 500 (73 s on 2 idle cores), which the suite
#: waited on at its start; 200 (35 s) keep its held-out perplexity at 312 of 2048 (uniform), WordNet cloze 0.46
#: (chance 0.25), the bounds test_reference checks with a margin, and no test needs a better-trained model
TEST_TINY_STEPS = 200


def builder_digest() -> str:
    """Digest of the reference builder's sources: the cached tiny model is rebuilt when they change."""
    files = sorted(BUILDER.glob("*.py"))
    assert files, f"no reference builder sources under {BUILDER}"
    h = hashlib.sha256()
    for path in files:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _tiny_reference(threads: int | None = None, on_locked: Callable[[], None] | None = None) -> Path:
    """The built `tiny` reference, trained TEST_TINY_STEPS steps (under a minute the first time), under a file lock:
    one process builds it, any other waits for it. `threads`: torch threads for the build (the test processes run
    one each); `on_locked`: called once the lock is held."""
    from filelock import FileLock

    out = ROOT / ".pipprune" / "test-cache" / f"tiny{TEST_TINY_STEPS}-{builder_digest()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if on_locked is not None:
            on_locked()
        if not (out / "manifest.json").is_file():
            import torch

            from infra.reference.build import build_reference

            before = torch.get_num_threads()
            torch.set_num_threads(threads or before)
            try:
                build_reference("tiny", out, ROOT / ".pipprune" / "cache", seed=0, progress=False,
                                train_steps=TEST_TINY_STEPS)
            finally:
                torch.set_num_threads(before)
    return out


def pytest_configure(config) -> None:
    """With pytest-xdist workers, the controller builds the reference data and then the tiny reference (every core:
    110 s here; with one thread 130 s, and the workers had too little else to run meanwhile) in a thread while
    the workers start, collect and run what needs no tiny model. The thread holds both file locks before any
    worker exists, so no worker builds either a second time."""
    workers = getattr(config.option, "numprocesses", None)
    is_worker = hasattr(config, "workerinput")
    wants_models = "not slow" not in (config.getoption("markexpr", "") or "")
    if workers and not is_worker and wants_models and not config.option.collectonly:
        config.pluginmanager.register(_ReferenceBuild(), "pipprune-reference-build")


class _ReferenceBuild:
    """The tiny reference built in a controller thread; made once the thread holds the lock, so no worker builds it."""

    def __init__(self) -> None:
        import threading

        self.locked, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self._build, name="tiny-reference-build", daemon=True)
        self.thread.start()
        self.locked.wait()

    def _build(self) -> None:
        try:  # both locks held before the workers start: the data first (seconds), then the model
            _tiny_reference(threads=os.cpu_count(), on_locked=lambda: _reference_data(on_locked=self.locked.set))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread at the end
            self.error = exc
        finally:
            self.locked.set()

    def pytest_unconfigure(self, config) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _reference_data(on_locked: Callable[[], None] | None = None) -> Path:
    """The part of a reference that needs no model (infra.reference.build.write_reference_data: calibration windows,
    word list, lm-eval tasks), from the same corpus, under a file lock; seconds to make, so a test that brings its
    own model (a GGUF file) does not wait for the tiny reference to train. `on_locked`: called once the lock is held."""
    from filelock import FileLock

    out = ROOT / ".pipprune" / "test-cache" / f"data-{builder_digest()}"
    done = out / ".complete"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if on_locked is not None:
            on_locked()
        if not done.is_file():
            import shutil

            from infra.reference.build import write_reference_data
            from infra.reference.corpus import build_corpus

            shutil.rmtree(out, ignore_errors=True)  # a test-cache folder of a build that stopped part-way
            out.mkdir()
            corpus = build_corpus(ROOT / ".pipprune" / "cache")
            write_reference_data(out, corpus.train_texts(), corpus.heldout.read_text(), seed=0)
            done.write_text("")
    return out


@pytest.fixture(scope="module", autouse=True)
def _module_environment():
    """Each test file ends with the environment it started with: libraries that set variables in this process
    (dask's LocalCluster: OPENBLAS_NUM_THREADS, PYTHONHASHSEED, ...) would otherwise reach the CLI runs of every
    later file in this worker, and send them to fresh processes instead of the fork server (tests/helpers.py)."""
    saved = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    for key in [k for k in os.environ if k not in saved and k != "PYTEST_CURRENT_TEST"]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(scope="session")
def reference_data_dir() -> Path:
    """Calibration data and lm-eval tasks of the reference corpus, without a model (see `_reference_data`)."""
    return _reference_data()


@pytest.fixture(scope="session")
def tiny_reference_dir() -> Path:
    """Path to a built `tiny` reference model, reused across runs (see `_tiny_reference`)."""
    return _tiny_reference()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests that use the stack are marked `stack`, and those that build or load models `slow`, whatever their
    module says, so `make test-fast` (-m "not stack and not slow") is only pure unit tests.

    The order is the order xdist hands files out in (`make test` passes --no-loadscope-reorder): first the files
    none of whose tests needs the tiny reference, which the controller trains meanwhile (see _ReferenceBuild), the
    ones on the stack first (they are the long ones); then the rest, the files with the most tests first (xdist's
    own order). Inside a file, its tests that need no tiny reference go first. On a clean clone the two workers
    otherwise reached a test that needs the model within 25 s and waited 64-68 s each for it."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & {"local_stack", "stack_env"}:
            item.add_marker(pytest.mark.stack)
        if names & {"tiny_reference_dir", "local_stack", "stack_env"}:
            item.add_marker(pytest.mark.slow)

    def waits(item) -> bool:
        return "tiny_reference_dir" in getattr(item, "fixturenames", ())

    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def file_order(name: str) -> tuple[bool, bool, int]:
        tests = files[name]
        return any(map(waits, tests)), not any(item.get_closest_marker("stack") for item in tests), -len(tests)

    items[:] = [item for name in sorted(files, key=file_order) for item in sorted(files[name], key=waits)]


def stack_settings(home: Path):  # infra.settings.Settings, imported lazily
    """Settings of an embedded stack in `home` on free loopback ports (S3 and the block SeaweedFS adds)."""
    from infra.settings import Settings

    return Settings(home=home, **free_stack_ports(), s3_endpoint_url=None, mlflow_tracking_uri=None,
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
