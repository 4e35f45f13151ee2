#!/usr/bin/env bash
# Register train-pipeline/local and train-pipeline/nightly with the running Prefect server, and
# the automations that bring their preempted runs back (deployments/automations.py).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$RINGFLOW_ROOT"
prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml
python deployments/automations.py
