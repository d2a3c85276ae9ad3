"""The tests' CLI fork server gives what a fresh `python -m pipprune.cli` gives, or steps aside."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, _fork_server, cli

pytestmark = [pytest.mark.slow,  # it imports the whole CLI once per test process
              pytest.mark.skipif(os.environ.get("PIPPRUNE_TEST_FORK_SERVER", "1") == "0",
                                 reason="PIPPRUNE_TEST_FORK_SERVER=0: every CLI run is a fresh process")]


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


def test_what_the_client_counts_as_set_by_a_run_is_what_a_fresh_compress_run_sets(tmp_path):
    """CLI_SETS may be missing from a request's environment only because a fresh run sets each of them itself
    (before the imports that read them, or by importing what it uses): checked on a fresh process that starts as
    `pipprune compress` does and imports what a run imports, from an environment without them."""
    import json

    from tests.helpers import CLI_SETS

    env = {k: v for k, v in os.environ.items() if k not in CLI_SETS}
    env["PIPPRUNE_HOME"] = str(tmp_path / "home")
    start = ("import json, os\n"
             "from infra import progress\n"
             "from infra.settings import Settings, apply_process_env\n"
             "progress.configure(progress.choose_mode(False, False))\n"
             "apply_process_env(Settings())\n"
             "from pipprune.precompile import import_run_modules\n"
             "import_run_modules()\n"
             "print(json.dumps(dict(os.environ)))\n")
    done = subprocess.run([sys.executable, "-c", start], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    after = json.loads(done.stdout.splitlines()[-1])
    assert {k: after.get(k) for k in CLI_SETS} == CLI_SETS
