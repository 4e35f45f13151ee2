#!/usr/bin/env bash
# Fetch what an offline GPU host lacks (see bench/gpu_host.sh) into one folder, from this
# machine's package index: the cp312 wheel of the Ray installed here without its Java jars
# (about 45 MiB, under the device's 64 MiB), Ray's schema dependencies, pydantic (Ray Train
# and Tune import it), pytest, and torchft with the OpenTelemetry packages it imports
# (bench.chaos runs it).
#   bash bench/gpu_wheels.sh .gpu/dl && . bench/gpu_host.sh .gpu/dl   # the second on the host
set -euo pipefail
out="${1:?usage: bash bench/gpu_wheels.sh WHEEL_DIR}"
python="${PYTHON:-.venv/bin/python}"
ray_version="$("$python" -c 'import ray; print(ray.__version__)')"
torchft_version="$("$python" -c 'import importlib.metadata as m; print(m.version("torchft"))')"
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$raw" \
  "ray==$ray_version" jsonschema jsonschema-specifications referencing rpds-py \
  pytest pluggy iniconfig annotated-types pydantic pydantic-core typing-inspection \
  "torchft==$torchft_version"
# torchft's own dependencies, with theirs (the host skips those it has: bench/gpu_host.sh)
"$python" -m pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any -d "$raw" \
  opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
mkdir -p "$out"
"$python" - "$raw" "$out" <<'PY'
import pathlib, shutil, sys, zipfile

raw, out = map(pathlib.Path, sys.argv[1:])
for wheel in raw.glob("*.whl"):
    if not wheel.name.startswith("ray-"):
        shutil.copy(wheel, out / wheel.name)
        continue
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out / wheel.name, "w", zipfile.ZIP_DEFLATED) as kept:
        for item in source.infolist():
            if not item.filename.startswith("ray/jars/"):  # Java workers: never used
                kept.writestr(item, source.read(item.filename))
PY
du -sh "$out"
