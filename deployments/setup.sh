#!/usr/bin/env bash
# Create .venv and install ringflow with its test tools. Safe to run again: it only installs
# what changed. torch is installed first at the CPU build this project is pinned to, so pip
# never replaces it with a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RINGFLOW_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "error: ringflow needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
  exit 1
}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.ringflow-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# Each phase says what it installs; pip shows its own progress (a bar per download when this
# is a terminal).
pip_install() {
  "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"
}
echo "[1/3] pip: the newest release, into $VENV"
pip_install --quiet --upgrade pip
echo "[2/3] torch 2.13.0, the CPU build (about 200 MB on a fresh machine)"
pip_install "torch==2.13.0"
echo "[3/3] ringflow and its dependencies (Prefect, Ray, Lightning, pyarrow, ...) and test tools"
pip_install -e "$ROOT[dev]"
echo "$want" >"$stamp"
echo "installed ringflow into $VENV"
