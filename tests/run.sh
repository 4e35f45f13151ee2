#!/usr/bin/env bash
# The test command: install what the tests need (deployments/setup.sh), then run them all,
# in parallel (pytest-xdist: RINGFLOW_TEST_WORKERS processes, each test module whole on one of
# them, every e2e test on the first, on one stack; tests/conftest.py).
# Extra arguments go to pytest, e.g. `./tests/run.sh -m "not e2e"` or `-m unit`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/deployments/setup.sh"
cd "$ROOT"
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0
bin="${RINGFLOW_VENV:-$ROOT/.venv}/bin"
"$bin/ruff" check .
"$bin/ruff" format --check .
exec "$bin/python" -m pytest -n "${RINGFLOW_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
