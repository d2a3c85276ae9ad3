#!/usr/bin/env bash
# The worked example of docs/scale-out.md: from a clean stack, a sweep of
# 6 points on a process work pool served by 2 workers, then the same sweep again (every point reused).
# Usage: bash scripts/sweep_pool_demo.sh [REFERENCE_DIR] [OUT_DIR]
# Ports: set PIPPRUNE_S3_PORT / PIPPRUNE_MLFLOW_PORT / PIPPRUNE_PREFECT_PORT when another stack uses the defaults.
set -euo pipefail
ref=$(realpath "${1:-.pipprune/reference/tiny}")
out=$(realpath -m "${2:-$(mktemp -d)/sweep-demo}")
mkdir -p "$out"
export PIPPRUNE_HOME=${PIPPRUNE_HOME:-$out/home}
pipprune() { python -m pipprune.cli "$@"; }

pipprune stack up                                   # S3 (SeaweedFS), MLflow, Prefect on 127.0.0.1
eval "$(pipprune stack env)"                        # PREFECT_API_URL, MLFLOW_TRACKING_URI, S3 endpoint and keys
python -m prefect work-pool create demo-pool --type process || true
pids=()
for w in 1 2; do                                    # two workers, one point at a time each (any machine can add more)
  python -m prefect worker start --pool demo-pool --name "w$w" --limit 1 > "$out/worker-$w.log" 2>&1 &
  pids+=($!)
done
stop_workers() {
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "${pids[@]}" 2>/dev/null || return 0; sleep 1; done
  kill -9 "${pids[@]}" 2>/dev/null || true
}
trap stop_workers EXIT

cat > "$out/sweep.yaml" <<EOF
name: demo
work_pool: demo-pool
concurrency: 2
base:
  model: $ref
  calibration: $ref
  registered_model_name: tiny-sweep
  n_samples: 8
  heldout_samples: 4
  max_length: 64
  eval_tasks: [pipprune_wordnet_cloze]
  eval_include_path: $ref/tasks
  eval_limit: 40
  scoring: {method: pip, iterations: 1}
grid:
  ratio: [0.15, 0.3, 0.45]
  scoring.unit: [block, width]
EOF

/usr/bin/time -f "first sweep: %e s" python -m pipprune.cli sweep --config "$out/sweep.yaml" | tee "$out/first.md"
/usr/bin/time -f "rerun: %e s" python -m pipprune.cli sweep --config "$out/sweep.yaml" | tee "$out/rerun.md"
grep -h "submitting flow run\|Completed submission" "$out"/worker-*.log | tee "$out/workers.txt" || true
echo "MLflow: $MLFLOW_TRACKING_URI (experiment pipprune-compress, run sweep-demo: Artifacts -> sweep/);" \
  "stop the stack: PIPPRUNE_HOME=$PIPPRUNE_HOME pipprune stack down"
python - "$out" <<'PY'  # the parent run's table and Pareto plot, as MLflow stores them
import sys
from mlflow import MlflowClient
client = MlflowClient()
exp = client.get_experiment_by_name("pipprune-compress")
parent = client.search_runs([exp.experiment_id], "tags.`pipprune.sweep.role` = 'parent' and tags.`pipprune.sweep` = 'demo'",
                            order_by=["attributes.start_time ASC"])[0]
children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
print(f"parent run {parent.info.run_id}: {len(children)} child runs; metrics {parent.data.metrics}")
print("artifacts:", [a.path for a in client.list_artifacts(parent.info.run_id, "sweep")])
client.download_artifacts(parent.info.run_id, "sweep", sys.argv[1])
# the Pareto plot as the MLflow UI shows it, in a real (headless) browser, when Chromium is installed
from infra.screenshots import chromium_binary, screenshot_artifact
if chromium_binary():
    import os, pathlib
    out = pathlib.Path(os.environ.get("PIPPRUNE_DOCS_DIR") or sys.argv[1]) / "mlflow_sweep_pareto.png"
    print("screenshot:", screenshot_artifact(os.environ["MLFLOW_TRACKING_URI"], parent.info.run_id,
                                             "sweep/pareto.png", out))
PY
