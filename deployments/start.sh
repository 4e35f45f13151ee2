#!/usr/bin/env bash
# Start the local stack: Prefect server (SQLite, 127.0.0.1), a Ray head, a process worker.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"

# keep_log NAME: set aside the log of a NAME that is not running, before start_bg starts a
# new one over it: a dead worker's log is what says why its runs crashed.
keep_log() {
  local log="$LOG_DIR/$1.log"
  if ! running "$1" && [ -s "$log" ]; then
    mv "$log" "$LOG_DIR/$1.$(date -u -r "$log" +%Y%m%dT%H%M%S.%NZ).log"
  fi
}

for name in prefect-server ray-head prefect-worker; do keep_log "$name"; done

start_bg prefect-server "${without_secrets[@]}" prefect server start --host 127.0.0.1 --port "$RINGFLOW_PREFECT_PORT"

if [ "$RINGFLOW_LOCAL_RAY" = 1 ]; then
  # Every port the head opens is derived from RINGFLOW_RAY_PORT, so a second stack (the
  # tests') can run beside the demo's.
  p=$RINGFLOW_RAY_PORT
  if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
    mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
    (umask 077 && python -c 'import secrets; print(secrets.token_hex(32), end="")' >"$RAY_AUTH_TOKEN_PATH")
  fi
  dashboard=(--include-dashboard=false)
  if [ "$RINGFLOW_RAY_DASHBOARD" = 1 ]; then
    dashboard=(--include-dashboard=true --dashboard-host=127.0.0.1
      --dashboard-port="$RINGFLOW_RAY_DASHBOARD_PORT")
  fi
  start_bg ray-head "${without_secrets[@]}" "${lean_ray[@]}" ray start --head --block --disable-usage-stats \
    --node-ip-address=127.0.0.1 --port="$p" --num-cpus="$RINGFLOW_CPUS" \
    "${dashboard[@]}" --ray-client-server-port=$((p + 1)) \
    --dashboard-agent-listen-port=$((p + 2)) --dashboard-agent-grpc-port=$((p + 3)) \
    --metrics-export-port=$((p + 4)) --runtime-env-agent-port=$((p + 5))
else
  echo "using the existing Ray cluster at $RAY_ADDRESS"
fi

wait_for "Prefect server" 180 curl -sf "$PREFECT_API_URL/health"
wait_for "Ray head" 120 ray health-check --address "$RAY_ADDRESS"

prefect --no-prompt work-pool create "$RINGFLOW_POOL" --type process >/dev/null 2>&1 ||
  prefect work-pool inspect "$RINGFLOW_POOL" >/dev/null
start_bg prefect-worker prefect worker start --pool "$RINGFLOW_POOL" --type process
echo "Prefect UI: http://127.0.0.1:$RINGFLOW_PREFECT_PORT   Ray: $RAY_ADDRESS"
if [ "$RINGFLOW_LOCAL_RAY" = 1 ] && [ "$RINGFLOW_RAY_DASHBOARD" = 1 ]; then
  echo "Ray dashboard: http://127.0.0.1:$RINGFLOW_RAY_DASHBOARD_PORT"
fi
