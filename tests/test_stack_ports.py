"""SeaweedFS' internal ports follow PIPPRUNE_S3_PORT, and a `stack up` that fails leaves no server behind.

Issue 28: a second stack with its own PIPPRUNE_S3_PORT used to collide on the fixed internal
ports, and the failed `up` left MLflow and Prefect running. The derivation is checked as a pure
function; the failure paths with real servers on 127.0.0.1, in a home of their own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.settings import AUX_PORT_BLOCKS, AUX_PORT_STRIDE, Settings, default_aux_port_base
from infra.stack import free_port
from tests.helpers import ROOT, cli


@pytest.fixture(autouse=True)
def _no_pipprune_env(monkeypatch):
    """Settings here come from the test alone, not from PIPPRUNE_* variables of the shell running it."""
    for key in [k for k in os.environ if k.startswith("PIPPRUNE_")]:
        monkeypatch.delenv(key)


def settings_for(home: Path, **ports: int) -> Settings:
    return Settings(home=home, s3_endpoint_url=None, mlflow_tracking_uri=None, prefect_api_url=None, **ports)


def stack_ports(settings: Settings) -> set[int]:
    """Every port the stack of `settings` opens."""
    from infra.stack import LocalStack

    stack = LocalStack(settings)
    return {port for name in stack.urls for port, _, _ in stack.ports(name)}


# ---------------------------------------------------------------------- the derivation (no servers)
def test_internal_ports_follow_the_s3_port_and_two_s3_ports_never_share_one(tmp_path):
    from infra.stack import ADMIN_GRPC_OFFSET, WEED_AUX_PORTS, LocalStack

    assert len(WEED_AUX_PORTS) <= AUX_PORT_STRIDE  # a block holds every port weed mini pins
    defaults = settings_for(tmp_path)
    assert defaults.s3_aux_port_base is None and defaults.aux_port_base == 13100  # 9310 -> block 310
    aux = LocalStack(defaults).aux_ports()
    assert aux["admin.port.grpc"] == aux["admin.port"] + ADMIN_GRPC_OFFSET
    assert not set(aux.values()) & {9310, 5310, 4310}  # never a default main port

    a, b = (LocalStack(settings_for(tmp_path, s3_port=p)).aux_ports() for p in (9310, 9311))
    assert not set(a.values()) & set(b.values())  # neighbouring S3 ports: disjoint
    # every one of the 1000 blocks, with its admin gRPC port, is disjoint from every other
    blocks = [set(LocalStack(settings_for(tmp_path, s3_port=p)).aux_ports().values())
              for p in range(1000, 1000 + AUX_PORT_BLOCKS)]
    assert all(len(block) == len(WEED_AUX_PORTS) + 1 for block in blocks)
    assert len(set().union(*blocks)) == sum(len(block) for block in blocks)
    assert min(map(min, blocks)) >= 10000 and max(map(max, blocks)) < 32768  # below Linux's ephemeral ports
    assert all(default_aux_port_base(p) == default_aux_port_base(p + AUX_PORT_BLOCKS) for p in (1, 9310, 40000))

    explicit = settings_for(tmp_path, s3_port=9311, s3_aux_port_base=21310)  # an explicit base still wins
    assert LocalStack(explicit).aux_ports()["master.port"] == 21311


def test_free_stack_ports_never_give_two_services_one_port(tmp_path):
    """Ports drawn one by one once put Prefect inside the SeaweedFS block (`stack up` refused); one block cannot."""
    from infra.stack import WEED_AUX_PORTS, LocalStack, free_stack_ports

    for _ in range(20):
        stack = LocalStack(settings_for(tmp_path, **free_stack_ports()))  # Settings validates each port
        ports = [port for name in stack.urls for port, _, _ in stack.ports(name)]
        assert len(ports) == len(set(ports)) == 3 + len(WEED_AUX_PORTS) + 1


def test_two_stacks_differing_only_in_main_ports_share_no_port(tmp_path):
    first = settings_for(tmp_path / "a")
    second = settings_for(tmp_path / "b", s3_port=9410, mlflow_port=5410, prefect_port=4410)
    assert not stack_ports(first) & stack_ports(second)


def test_a_stack_whose_own_ports_collide_is_refused_before_anything_starts(tmp_path):
    from infra.stack import LocalStack, StackError

    settings = settings_for(tmp_path, s3_port=10000, mlflow_port=free_port(), prefect_port=free_port())
    assert settings.aux_port_base == 10000  # block 0 starts on the S3 port itself
    with pytest.raises(StackError, match="port 10000 would be both s3 and SeaweedFS s3.port.grpc"):
        LocalStack(settings).up(wait=False)
    assert json.loads((settings.stack_dir / "state.json").read_text()) == {}


# ---------------------------------------------------------------------- failures with real servers
def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def derived_settings(home: Path) -> Settings:
    """A stack on free ports whose SeaweedFS ports are derived (PIPPRUNE_S3_AUX_PORT_BASE unset) and free too."""
    for _ in range(200):
        settings = settings_for(home, s3_port=free_port(), mlflow_port=free_port(), prefect_port=free_port())
        ports = stack_ports(settings)
        if len(ports) == 14 and all(_port_free(p) for p in ports):
            return settings
    raise RuntimeError("no free derived port block found")


def processes_of(home: Path) -> dict[int, str]:
    """Pid -> command line of the live processes naming `home` in their command line or environment
    (every server of a stack does, and `home` is this test's own)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().split()[2] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes()
            if str(home).encode() in cmdline + (entry / "environ").read_bytes():
                found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
    return found


def assert_nothing_left(settings: Settings, busy: int | None = None) -> None:
    """No process of the home, no port of the stack taken (but `busy`), status: every service down, not running."""
    from infra.stack import LocalStack

    assert processes_of(settings.home) == {}
    assert [p for p in stack_ports(settings) if p != busy and not _port_free(p)] == []
    statuses = LocalStack(settings).status()
    assert [(s.up, s.pid, s.detail, s.rss_mb) for s in statuses] == [(False, None, "not running", 0.0)] * 3


def cli_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPPRUNE_", "MLFLOW_", "PREFECT_", "AWS_"))}
    return {**env, "PIPPRUNE_HOME": str(settings.home), "PIPPRUNE_S3_PORT": str(settings.s3_port),
            "PIPPRUNE_MLFLOW_PORT": str(settings.mlflow_port), "PIPPRUNE_PREFECT_PORT": str(settings.prefect_port)}


@pytest.mark.slow
@pytest.mark.stack
def test_a_failed_stack_up_leaves_no_server_and_the_next_one_works(tmp_path, caplog):
    """A busy internal port is refused before anything starts; a failure after the starts stops them all;
    `status` tells the truth each time; once the port is free `stack up` works on the same settings."""
    from infra.stack import LocalStack, StackError

    settings = derived_settings(tmp_path / "home")
    env, stack = cli_env(settings), LocalStack(settings)
    master = stack.aux_ports()["master.port"]
    started = time.monotonic()
    try:
        with socket.socket() as blocker:  # someone else's server on SeaweedFS' master port
            blocker.bind(("127.0.0.1", master))
            blocker.listen()
            failed = cli(env, "stack", "up", timeout=120)
            assert failed.returncode == 3, failed.stdout + failed.stderr
            assert (f"port {master} for SeaweedFS master.port is already used by another process; these ports "
                    f"follow PIPPRUNE_S3_PORT (now {settings.s3_port}") in failed.stderr, failed.stderr
            assert_nothing_left(settings, busy=master)
            shown = cli(env, "stack", "status", "--json", timeout=120)
            assert shown.returncode == 3 and not any(s["up"] or s["pid"] for s in json.loads(shown.stdout)["services"])

        with caplog.at_level("WARNING", logger="infra.stack"), pytest.raises(StackError, match="not healthy after 0s"):
            stack.up(wait=True, timeout=0)  # fails after all three were started
        assert_nothing_left(settings)
        assert [m.split(" (")[0] for m in caplog.messages if m.endswith("stack up failed")] == \
            ["stopping s3", "stopping mlflow", "stopping prefect"]
        assert cli(env, "stack", "down", timeout=120).returncode == 0

        # the same settings now work, even from two commands at once (they take turns: one set of servers)
        ups = [subprocess.Popen([sys.executable, "-m", "pipprune.cli", "stack", "up", "--json"], env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for done in ups:
            out, err = done.communicate(timeout=300)
            assert done.returncode == 0, out[-2000:] + err[-2000:]
            assert all(s["up"] for s in json.loads(out)["services"])
        assert len([c for c in processes_of(settings.home).values() if " mini " in c]) == 1
        assert cli(env, "stack", "status", timeout=120).returncode == 0
    finally:
        stack.down()
        leftovers = processes_of(settings.home)
        for pid in leftovers:  # only after a failure above: never leave servers of this test behind
            os.kill(pid, signal.SIGKILL)
        print(f"wall time {time.monotonic() - started:.1f} s")
    assert leftovers == {}
    assert_nothing_left(settings)


def test_an_internal_error_of_the_embedded_s3_server_points_at_its_log(tmp_path):
    """The server answers "please try again"; its log has the cause (CI's full volume cap did not say so)."""
    from infra.stack import s3_failure_hint

    settings = settings_for(tmp_path)
    error = RuntimeError("Failed to upload x: An error occurred (InternalError) when calling the PutObject operation")
    assert s3_failure_hint(error, settings) == ""  # no embedded server ran here: nothing to point at
    settings.stack_dir.mkdir(parents=True, exist_ok=True)
    (settings.stack_dir / "s3.log").write_text("No writable volumes and no free volumes left\n")
    assert str(settings.stack_dir / "s3.log") in s3_failure_hint(error, settings)
    assert s3_failure_hint(RuntimeError("NoSuchBucket"), settings) == ""
