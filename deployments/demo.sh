#!/usr/bin/env bash
# The whole demo from a fresh clone: install, start the local stack, deploy, run
# train-pipeline/local to completion, and ask the served model for a prediction.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$HERE/setup.sh"
. "$HERE/env.sh"
"$HERE/start.sh"
"$HERE/deploy.sh" >"$LOG_DIR/deploy.log" 2>&1 || { cat "$LOG_DIR/deploy.log" >&2; exit 1; }
echo "deployed train-pipeline/local and train-pipeline/nightly (log $LOG_DIR/deploy.log)"

out="$LOG_DIR/demo-run.log"
echo "running train-pipeline/local: preprocess, tune (8 trials), train, evaluate, promote, serve;"
echo "its log, epoch by epoch: prefect flow-run logs <the UUID below>, or the UI"
prefect deployment run train-pipeline/local --param serve_port="$RINGFLOW_SERVE_PORT" --watch \
  2>&1 | tee "$out" || true
run_id=$(grep -oE 'UUID: [0-9a-f-]{36}' "$out" | head -n 1 | cut -d' ' -f2)
echo
if ! grep -q "Flow run finished successfully in 'Completed'" "$out"; then
  if [ -n "$run_id" ]; then python -m ringflow.flows.result "$run_id" >&2 || true; fi
  echo "error: the train-pipeline/local run did not complete; its log: prefect flow-run logs" \
    "${run_id:-<id>} (also $out and $LOG_DIR)" >&2
  exit 1
fi
python -m ringflow.flows.result "$run_id"

pixels=$(python -c 'from sklearn.datasets import load_digits; d = load_digits(); print([int(v) for v in d.data[7]])')
echo
echo "The model keeps serving on the Ray head. Asking it about a handwritten 7:"
echo "  curl -s -X POST 127.0.0.1:$RINGFLOW_SERVE_PORT/predict -d '{\"pixels\": $pixels}'"
curl -sf -X POST "127.0.0.1:$RINGFLOW_SERVE_PORT/predict" -d "{\"pixels\": $pixels}"
echo
echo
echo "Prefect UI: http://127.0.0.1:$RINGFLOW_PREFECT_PORT    artifacts: $RINGFLOW_STATE/storage"
echo "this run's result again: . deployments/env.sh && python -m ringflow.flows.result $run_id"
echo "stop everything: ./deployments/stop.sh"
