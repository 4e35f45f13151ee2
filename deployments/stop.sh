#!/usr/bin/env bash
# Stop what deployments/start.sh started (and the served model, which lives on the Ray head).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
stop_bg prefect-worker
stop_bg ray-head
stop_bg prefect-server
