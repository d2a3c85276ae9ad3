"""A per-layer width output (custom config + modeling file) loads through MLflow's transformers loader.

No stack: the MLflow model is built on disk exactly as registration lays it out in S3 (the
flavor's files beside the checkpoint's `model/`), then loaded by a fresh interpreter that never
imports pipprune, so only the remote code saved beside the weights can build the model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from infra import mlflow_model
from pip_core import io as core_io
from pip_core import schedule
from pip_core.importance import CalibrationData

PROMPT = "It is a truth universally acknowledged"


@pytest.mark.slow
def test_per_layer_width_model_loads_through_mlflow(tiny_reference_dir, tmp_path):
    net, tok = core_io.load(tiny_reference_dir)
    options = schedule.ScoringOptions("magnitude", "width", protect_first=1, protect_last=1, width_mode="per_layer")
    schedule.prune_iteratively(net, CalibrationData(tok), options, 0.2, 1, progress=False)
    pruned = core_io.save_pruned(net, tok, tmp_path / "pruned")
    assert (pruned / "modeling_pipprune.py").is_file() and mlflow_model.needs_remote_code(pruned)

    root = tmp_path / "checkpoint"
    files = mlflow_model.build(pruned, root, run_id="r0", model_id=None, metadata={"pipprune.unit": "width"})
    assert not any(rel.startswith("model/") for rel in files), "the flavor files must not copy the weights"
    shutil.copytree(pruned, root / mlflow_model.MODEL_SUBDIR)  # what the S3 checkpoint already holds
    mlmodel = (root / "MLmodel").read_text()
    assert "pipprune.requires_remote_code: 'true'" in mlmodel and "trust_remote_code" in mlmodel

    code = f"""
import json, sys, mlflow
assert "pip_core" not in sys.modules
parts = mlflow.transformers.load_model({str(root)!r}, return_type="components")
ids = parts["tokenizer"]({PROMPT!r}, return_tensors="pt")
out = parts["model"].generate(**ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
print(json.dumps({{"tokens": out[0].tolist(), "cls": type(parts["model"]).__module__}}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd="/", env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                          "MLFLOW_DISABLE_TELEMETRY": "true", "HOME": str(tmp_path)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["cls"].startswith("transformers_modules"), "loaded through the remote code beside the weights"
    with torch.no_grad():
        ids = tok(PROMPT, return_tensors="pt")
        expected = net.generate(**ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0].tolist()
    assert got["tokens"] == expected
