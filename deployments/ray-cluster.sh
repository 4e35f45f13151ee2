#!/usr/bin/env bash
# A Ray cluster of several nodes on this one machine, for trying placement and node loss:
#
#   deployments/ray-cluster.sh head [CPUS]            the head, on 127.0.0.1:$RINGFLOW_RAY_PORT
#   deployments/ray-cluster.sh node NAME CPUS [PORT]  one more node joining it, as NAME
#   deployments/ray-cluster.sh kill-node NAME         SIGKILL that node's raylet and workers
#   deployments/ray-cluster.sh stop                   stop every node and the head started here
#
# Every port is derived from RINGFLOW_RAY_PORT (the head) or PORT (a node; default
# RINGFLOW_RAY_PORT + 10), so clusters of several checkouts run side by side. Drivers reach the
# cluster through RAY_ADDRESS and the auth token at RAY_AUTH_TOKEN_PATH (see env.sh).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"

usage() {
  sed -n '2,12p' "$0" >&2
  exit 2
}

auth_token() {
  if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
    mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
    (umask 077 && python -c 'import secrets; print(secrets.token_hex(32), end="")' >"$RAY_AUTH_TOKEN_PATH")
  fi
}

head() {
  local cpus=${1:-$RINGFLOW_CPUS} p=$RINGFLOW_RAY_PORT
  auth_token
  start_bg ray-head "${without_secrets[@]}" "${lean_ray[@]}" ray start --head --block --disable-usage-stats \
    --node-ip-address=127.0.0.1 --port="$p" --num-cpus="$cpus" \
    --include-dashboard=false --ray-client-server-port=$((p + 1)) \
    --dashboard-agent-listen-port=$((p + 2)) --dashboard-agent-grpc-port=$((p + 3)) \
    --metrics-export-port=$((p + 4)) --runtime-env-agent-port=$((p + 5))
  wait_for "Ray head" 120 ray health-check --address "$RAY_ADDRESS"
}

node() {
  local name=$1 cpus=$2 p=${3:-$((RINGFLOW_RAY_PORT + 10))}
  [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || { echo "error: bad node name '$name'" >&2; exit 2; }
  [[ $cpus =~ ^[0-9]+$ ]] || { echo "error: CPUS must be a whole number, got '$cpus'" >&2; exit 2; }
  auth_token
  # A node started again under its name first waits until the cluster has seen the earlier
  # one go: until its heartbeats time out it still counts as alive (it would pass for this
  # one), and a raylet on its ports may not register meanwhile.
  wait_for "the end of the earlier node $name" 120 python -c "$NODE_ALIVE" "$name" gone
  # ray_node.py is `ray start` that may join a node on loopback (see its docstring).
  start_bg "ray-node-$name" "${without_secrets[@]}" "${lean_ray[@]}" python "$RINGFLOW_ROOT/deployments/ray_node.py" start --address="$RAY_ADDRESS" --block --disable-usage-stats \
    --node-ip-address=127.0.0.1 --num-cpus="$cpus" --resources="{\"ringflow-node-$name\": 1}" \
    --node-manager-port="$p" --object-manager-port=$((p + 1)) \
    --dashboard-agent-listen-port=$((p + 2)) --dashboard-agent-grpc-port=$((p + 3)) \
    --metrics-export-port=$((p + 4)) --runtime-env-agent-port=$((p + 5))
  wait_for "Ray node $name" 120 node_up "$name"
}

# node_up NAME: the node this script started as NAME runs, and the cluster counts it alive.
node_up() {
  running "ray-node-$1" && python -c "$NODE_ALIVE" "$1" up
}

# Exits 0 where a node named argv[1] is alive in the cluster (argv[2] "up") or none is ("gone").
NODE_ALIVE='
import sys
import ray
ray.init(log_to_driver=False)
want = f"ringflow-node-{sys.argv[1]}"
alive = any(n["Alive"] and want in n["Resources"] for n in ray.nodes())
sys.exit(0 if alive == (sys.argv[2] == "up") else 1)
'

kill_node() {
  local name=ray-node-$1 procs
  running "$name" || { echo "error: no node $1 started here" >&2; exit 1; }
  procs=$(tree "$(cat "$RUN_DIR/$name.pid")")
  # shellcheck disable=SC2086
  kill -KILL $procs 2>/dev/null || true
  rm -f "$RUN_DIR/$name.pid"
  echo "killed node $1"
}

stop() {
  local pidfile name
  for pidfile in "$RUN_DIR"/ray-node-*.pid; do
    [ -e "$pidfile" ] || continue
    name=$(basename "$pidfile" .pid)
    stop_bg "$name"
  done
  stop_bg ray-head
}

case "${1:-}" in
  head) shift; head "$@" ;;
  node) [ $# -ge 3 ] || usage; shift; node "$@" ;;
  kill-node) [ $# -eq 2 ] || usage; kill_node "$2" ;;
  stop) stop ;;
  *) usage ;;
esac
