#!/usr/bin/env bash
# Register train-pipeline/local and train-pipeline/nightly with the running Prefect server.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$RINGFLOW_ROOT"
prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml
