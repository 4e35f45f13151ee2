#!/usr/bin/env bash
# Create .venv and install ringflow with its test tools. Safe to run again: it only installs
# what changed. torch is installed first at the CPU build this project is pinned to, so the
# installer never replaces it with a multi-GB CUDA build.
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
# uv installs (a few seconds where pip takes minutes); pip installs uv, and everything where uv
# cannot be had. uv is handed pip's own configuration (its find-links and indexes, as pip reads
# them from pip.conf and PIP_* variables), so both pick the same files, the CPU torch among them,
# and compiles the bytecode as pip does (where PYTHONDONTWRITEBYTECODE is set, as on CI, every
# process would otherwise compile torch and Lightning again: twice their import time).
pip_install() {
  "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"
}
pip_sources() {
  "$VENV/bin/python" -m pip config list 2>/dev/null | sed -nE \
    "s/^[^.]*\.(find-links|index-url|extra-index-url)='(.*)'$/\1 \2/p" | while read -r key values; do
    for value in $values; do printf -- '--%s=%s\n' "$key" "$value"; done
  done | sort -u
}
install() {
  if [ -x "$VENV/bin/uv" ]; then
    mapfile -t sources < <(pip_sources)
    "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" \
      --index-strategy unsafe-best-match --compile-bytecode "${sources[@]}" "$@"
  else
    pip_install "$@"
  fi
}
echo "[1/3] uv, the installer, into $VENV"
pip_install --quiet uv || echo "uv could not be installed: pip installs the rest (a few minutes)"
echo "[2/3] torch 2.13.0, the CPU build (about 200 MB on a fresh machine)"
install "torch==2.13.0"
echo "[3/3] ringflow and its dependencies (Prefect, Ray, Lightning, pyarrow, ...) and test tools"
install "torch==2.13.0" -e "$ROOT[dev]"
echo "$want" >"$stamp"
echo "installed ringflow into $VENV"
