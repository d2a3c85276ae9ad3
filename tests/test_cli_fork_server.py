"""The tests' CLI fork server gives what a fresh `python -m pipprune.cli` gives, or steps aside."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, _fork_server, cli

pytestmark = pytest.mark.slow  # it imports the whole CLI once per test process


def _fresh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipprune.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_a_forked_run_reads_its_own_environment_and_matches_a_fresh_process(tmp_path):
    server = _fork_server()
    key = tmp_path / "nowhere" / "team.pem"
    env = {**os.environ, "PIPPRUNE_HOME": str(tmp_path / "home"), "PIPPRUNE_SIGNING_KEY": str(key)}
    assert server.differences(env) == set()  # whatever the tests before this one changed in os.environ
    assert server.accepts({**server.env, "PYTEST_CURRENT_TEST": "a later test (call)"})
    runs = server.runs
    forked = cli(env, "keys", "export-public", timeout=120)
    assert server.runs == runs + 1  # it was the fork server's
    fresh = _fresh(env, "keys", "export-public")
    assert forked.returncode == fresh.returncode == 2
    assert str(key) in forked.stderr and (forked.stdout, forked.stderr) == (fresh.stdout, fresh.stderr)
    usage = cli(env, "no-such-command")
    assert usage.returncode == _fresh(env, "no-such-command").returncode != 0


def test_an_environment_read_at_import_gets_a_fresh_process(tmp_path):
    server = _fork_server()
    changed = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    assert not server.accepts(changed) and not server.accepts({"PATH": os.environ["PATH"]})
    runs = server.runs
    with pytest.warns(UserWarning, match="HF_HOME"):
        assert cli(changed, "--help").returncode == 0
    assert server.runs == runs


def test_what_the_cli_sets_before_importing_is_known_to_the_client():
    from infra import progress
    from tests.helpers import CLI_SETS

    assert progress._BARS_OFF.items() <= CLI_SETS.items()
