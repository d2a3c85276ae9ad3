"""The wheel: built from the repository, installed outside the source tree, runs `pipprune compress`."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.stack]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv holding only the pipprune wheel; its dependencies come from the test venv (a .pth line)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a copy: the build must not leave a build/ dir in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", ".pipprune", "build", "dist",
                                                                "__pycache__", "*.egg-info"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(work / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    [wheel] = (work / "dist").glob("pipprune-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # dependencies only: a .pth line adds the directory but not the editable finder of the source tree
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


def test_wheel_installs_and_compresses_outside_the_source_tree(wheel_venv, local_stack, tiny_reference_dir,
                                                              tmp_path):
    stack, _ = local_stack
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(stack.client_env(), PIPPRUNE_HOME=str(tmp_path / "home"), PIPPRUNE_S3_BUCKET="wheel-test")
    py = wheel_venv / "bin" / "python"
    where = subprocess.run([str(py), "-c", "import pip_core, tasks, flows, infra, pipprune; "
                            "print('\\n'.join(m.__file__ for m in (pip_core, tasks, flows, infra, pipprune)))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(wheel_venv)) for line in where.stdout.split()), where.stdout
    import boto3

    boto3.client("s3", endpoint_url=env["PIPPRUNE_S3_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket="wheel-test")
    done = subprocess.run([str(wheel_venv / "bin" / "pipprune"), "compress", "--model", str(tiny_reference_dir),
                           "--ratio", "0.1", "--unit", "block", "--method", "magnitude", "--iterations", "1",
                           "--n-samples", "4", "--tasks", "pipprune_wordnet_cloze", "--include-path",
                           str(tiny_reference_dir / "tasks"), "--eval-limit", "5", "--name", "tiny-wheel", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["registered_model"] == "tiny-wheel" and summary["params_after"] < summary["params_before"]
