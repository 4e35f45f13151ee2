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
prefect deployment run train-pipeline/local --param serve_port="$RINGFLOW_SERVE_PORT" --watch \
  2>&1 | tee "$out"
grep -q "Flow run finished successfully in 'Completed'" "$out" || {
  echo "error: the train-pipeline/local run did not complete; see $out and $LOG_DIR" >&2
  exit 1
}

pixels=$(python -c 'from sklearn.datasets import load_digits; d = load_digits(); print([int(v) for v in d.data[7]])')
echo
echo "The model keeps serving on the Ray head. Asking it about a handwritten 7:"
echo "  curl -s -X POST 127.0.0.1:$RINGFLOW_SERVE_PORT/predict -d '{\"pixels\": $pixels}'"
curl -sf -X POST "127.0.0.1:$RINGFLOW_SERVE_PORT/predict" -d "{\"pixels\": $pixels}"
echo
echo
echo "Prefect UI: http://127.0.0.1:$RINGFLOW_PREFECT_PORT    stop everything: ./deployments/stop.sh"
