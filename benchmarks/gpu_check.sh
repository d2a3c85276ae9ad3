#!/usr/bin/env bash
# One-GPU check (< 8 min): PIP scoring throughput, peak GPU memory / weights, pruned generation speedup
# for a ~1B random-init Llama in bf16. Falls back to a small fp32 model on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
timeout 470 "$PY" -m benchmarks.gpu_check "$@"
