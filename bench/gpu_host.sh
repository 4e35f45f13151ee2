#!/usr/bin/env bash
# Make Ray and the test tools importable on an offline GPU host that has torch but not Ray
# (see the device notes): source it from the repository root on that host. The wheels come
# from bench/gpu_wheels.sh, run where a package index is reachable.
#   . bench/gpu_host.sh .gpu/dl && python -m pytest -m gpu tests/test_gpu_workers.py
# Wheels (and a Ray wheel without ray/jars, zipped) are unpacked into $RINGFLOW_GPU_SITE, skipping
# packages the host already has; ringflow's folders are linked in as the `ringflow` package.
wheels="${1:?usage: . bench/gpu_host.sh WHEEL_DIR}"
site="${RINGFLOW_GPU_SITE:-/tmp/ringflow-site}"
mkdir -p "$site/ringflow"
for folder in engine storage tasks flows models serving tuning horovod; do
  ln -sfn "$PWD/$folder" "$site/ringflow/$folder"
done
for wheel in "$wheels"/*; do
  name="$(basename "$wheel" | cut -d- -f1 | tr _ -)"
  python -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null &&
    continue
  python -m zipfile -e "$wheel" "$site"
done
chmod +x "$site/ray/core/src/ray/raylet/raylet" "$site/ray/core/src/ray/gcs/gcs_server" 2>/dev/null
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 GLOO_SOCKET_IFNAME=lo
