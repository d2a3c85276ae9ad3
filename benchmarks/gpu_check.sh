#!/usr/bin/env bash
# One-GPU check (< 8 min), self-contained: PIP scoring throughput, peak GPU memory / weights and pruned
# generation speedup for a ~1B random-init Llama in bf16; fused (liger-kernel) vs chunked loss on CUDA; and the
# compress flow itself (`pipprune compress`, bf16 checkpoint, --device cuda, embedded stack). Writes
# benchmarks/results/gpu_check.json when a GPU is present. Falls back to a small fp32 model on the CPU.
# Installs what it needs from the repo (pip install -e .) into .venv-gpu when pipprune's dependencies are missing;
# PY=... picks the interpreter instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
  if ! "$PY" -c "import prefect, mlflow, boto3, pipprune" 2>/dev/null; then
    echo "gpu_check: installing pipprune and its dependencies into .venv-gpu (torch from the system is kept)" >&2
    if [ ! -x .venv-gpu/bin/python ]; then python3 -m venv --system-site-packages .venv-gpu; fi
    if .venv-gpu/bin/python -m pip install -q -e . ; then
      PY=.venv-gpu/bin/python
    else
      echo "gpu_check: install failed (offline?); the compress-flow part will report its error" >&2
    fi
  fi
fi
# optional fused loss kernel on CUDA; pip_core falls back to the chunked torch path without it
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$PY" -c "import liger_kernel" 2>/dev/null || "$PY" -m pip install -q liger-kernel 2>/dev/null || \
    echo "gpu_check: liger-kernel not installed; the chunked torch loss is used" >&2
fi
timeout 470 "$PY" -m benchmarks.gpu_check "$@"
