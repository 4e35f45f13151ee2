#!/usr/bin/env bash
# Register train-pipeline/local and /nightly, horovod-train/local and score-pipeline/local and
# /nightly (deployments/prefect.yaml) with the running Prefect server, and
# the automations that bring their preempted runs back (deployments/automations.py).
#
#   deployments/deploy.sh                       ringflow's own deployments
#   deployments/deploy.sh path/to/prefect.yaml  a project's own, from its directory
#
# Either way, a deployment of ringflow's flows (or of the given file) that lacks what an
# automatic resume needs (the RINGFLOW_RESUME_TAG tag, the heartbeat in its job variables) is
# named in a warning.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ $# -gt 0 ]; then
  project_file="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
  (cd "$(dirname "$project_file")" && prefect --no-prompt deploy --all --prefect-file "$project_file")
  python "$RINGFLOW_ROOT/deployments/automations.py" --prefect-file "$project_file"
  exit 0
fi
cd "$RINGFLOW_ROOT"
prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml
python deployments/automations.py
