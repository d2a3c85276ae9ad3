"""SeaweedFS' internal ports follow PIPPRUNE_S3_PORT.

Issue 28: a second stack with its own PIPPRUNE_S3_PORT used to collide on the fixed internal
ports. The derivation is checked as a pure function (no servers).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.settings import AUX_PORT_BLOCKS, AUX_PORT_STRIDE, Settings, default_aux_port_base


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

    return {settings.s3_port, settings.mlflow_port, settings.prefect_port, *LocalStack(settings).aux_ports().values()}


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


def test_two_stacks_differing_only_in_main_ports_share_no_port(tmp_path):
    first = settings_for(tmp_path / "a")
    second = settings_for(tmp_path / "b", s3_port=9410, mlflow_port=5410, prefect_port=4410)
    assert not stack_ports(first) & stack_ports(second)
