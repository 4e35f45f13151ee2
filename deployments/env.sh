# Sourced by every script in deployments/: where things live, which ports, and no telemetry.
# Override any RINGFLOW_* variable before calling a script to move ports or state.
RINGFLOW_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export RINGFLOW_ROOT
export RINGFLOW_STATE="${RINGFLOW_STATE:-$RINGFLOW_ROOT/.ringflow}"
export RINGFLOW_VENV="${RINGFLOW_VENV:-$RINGFLOW_ROOT/.venv}"
export RINGFLOW_PREFECT_PORT="${RINGFLOW_PREFECT_PORT:-4200}"
export RINGFLOW_RAY_PORT="${RINGFLOW_RAY_PORT:-6379}"
export RINGFLOW_SERVE_PORT="${RINGFLOW_SERVE_PORT:-8000}"
export RINGFLOW_POOL="${RINGFLOW_POOL:-ringflow-process}"
export RINGFLOW_CPUS="${RINGFLOW_CPUS:-$(nproc)}"
# The local Ray head's dashboard (on 127.0.0.1); a run's summary links it. 0: none.
export RINGFLOW_RAY_DASHBOARD="${RINGFLOW_RAY_DASHBOARD:-1}"
export RINGFLOW_RAY_DASHBOARD_PORT="${RINGFLOW_RAY_DASHBOARD_PORT:-8265}"

# Prefect: embedded SQLite server on loopback, state kept inside the checkout.
export PREFECT_HOME="${PREFECT_HOME:-$RINGFLOW_STATE/prefect}"
export PREFECT_SERVER_API_HOST=127.0.0.1
export PREFECT_SERVER_API_PORT="$RINGFLOW_PREFECT_PORT"
export PREFECT_API_URL="http://127.0.0.1:$RINGFLOW_PREFECT_PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_UI_ENABLED="${PREFECT_UI_ENABLED:-true}"
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-2}"
export DO_NOT_TRACK=1

# Preempted runs come back (docs/preemption.md): flow processes send a heartbeat this often
# (seconds, at least 30); deploy.sh's automations mark a run silent for the grace period Crashed
# and reschedule a Crashed run of a deployment tagged RINGFLOW_RESUME_TAG while it has started
# at most RINGFLOW_MAX_RESTARTS times.
export PREFECT_FLOWS_HEARTBEAT_FREQUENCY="${PREFECT_FLOWS_HEARTBEAT_FREQUENCY:-30}"
export RINGFLOW_HEARTBEAT_GRACE_SECONDS="${RINGFLOW_HEARTBEAT_GRACE_SECONDS:-$((3 * PREFECT_FLOWS_HEARTBEAT_FREQUENCY))}"
export RINGFLOW_MAX_RESTARTS="${RINGFLOW_MAX_RESTARTS:-3}"
export RINGFLOW_RESUME_TAG="${RINGFLOW_RESUME_TAG:-auto-resume}"
# The table score-pipeline/nightly scores (a file or a folder of Parquet files, any fsspec
# URL): where the day's rows are dropped.
export RINGFLOW_SCORE_INPUT="${RINGFLOW_SCORE_INPUT:-$RINGFLOW_STATE/score-input}"

# Ray: flows reach it through RAY_ADDRESS. Set it before calling a script to use an existing
# cluster; otherwise start.sh starts a local head on loopback.
if [ -z "${RAY_ADDRESS:-}" ] || [ "${RINGFLOW_LOCAL_RAY:-0}" = 1 ]; then
  export RINGFLOW_LOCAL_RAY=1
else
  export RINGFLOW_LOCAL_RAY=0
fi
export RAY_USAGE_STATS_ENABLED=0
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_ADDRESS="${RAY_ADDRESS:-127.0.0.1:$RINGFLOW_RAY_PORT}"
if [ "$RINGFLOW_LOCAL_RAY" = 1 ]; then
  # The local head's auth token is this checkout's own (start.sh creates it), so it never
  # depends on, or overwrites, the one in ~/.ray that other Ray clusters on the machine use.
  export RAY_AUTH_TOKEN_PATH="${RAY_AUTH_TOKEN_PATH:-$RINGFLOW_STATE/ray/auth_token}"
fi
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"

RUN_DIR="$RINGFLOW_STATE/run"
LOG_DIR="$RINGFLOW_STATE/logs"
mkdir -p "$RUN_DIR" "$LOG_DIR"

if [ -x "$RINGFLOW_VENV/bin/python" ]; then
  # shellcheck disable=SC1091
  . "$RINGFLOW_VENV/bin/activate"
fi

# wait_for NAME SECONDS COMMAND...: retry COMMAND until it succeeds or SECONDS pass.
wait_for() {
  local name=$1 seconds=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      echo "error: $name did not come up within ${seconds}s; see $LOG_DIR" >&2
      return 1
    fi
    sleep 1
  done
}

# running NAME: true while the process this checkout started as NAME is alive.
running() {
  [ -f "$RUN_DIR/$1.pid" ] && kill -0 "$(cat "$RUN_DIR/$1.pid")" 2>/dev/null
}

# Secrets only the flow's own process reads (the serving token, from which the model server
# gets a digest): servers and Ray processes start without them (`"${without_secrets[@]}" CMD`
# for start_bg).
SECRET_ENV=(RINGFLOW_SERVE_TOKEN)
without_secrets=(env)
for _secret in "${SECRET_ENV[@]}"; do without_secrets+=(-u "$_secret"); done
# The Ray nodes these scripts start prestart no idle workers: ringflow's never use them
# (LEAN_RAY_ENV in engine/cluster.py says why). `"${without_secrets[@]}" "${lean_ray[@]}" ray`.
lean_ray=(RAY_enable_worker_prestart=0 RAY_prestart_worker_first_driver=0)

# start_bg NAME COMMAND...: run COMMAND detached in a session of its own, remember its pid.
start_bg() {
  local name=$1
  shift
  if running "$name"; then
    echo "$name already running (pid $(cat "$RUN_DIR/$name.pid"))"
    return 0
  fi
  setsid bash -c 'echo $$ >"$0"; exec "$@"' "$RUN_DIR/$name.pid" "$@" \
    >"$LOG_DIR/$name.log" 2>&1 </dev/null &
  sleep 0.2
  echo "started $name (pid $(cat "$RUN_DIR/$name.pid"), log $LOG_DIR/$name.log)"
}

# tree PID: PID and all its descendants.
tree() {
  echo "$1"
  local child
  for child in $(ps -o pid= --ppid "$1"); do tree "$child"; done
}

# stop_bg NAME: ask the process started as NAME to stop, then end whatever it left behind.
# Only processes this checkout started are touched (never `ray stop`, which ends every Ray).
stop_bg() {
  local name=$1 pid procs
  if running "$name"; then
    pid=$(cat "$RUN_DIR/$name.pid")
    procs=$(tree "$pid")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    # shellcheck disable=SC2086
    kill -KILL $procs 2>/dev/null || true
    echo "stopped $name"
  fi
  rm -f "$RUN_DIR/$name.pid"
}
