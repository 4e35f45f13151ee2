#!/usr/bin/env bash
# The scaling run: every multi-GPU bench on one host, one after the other, each under
# its own `timeout`, each one's output tee'd to "$OUT/<name>.txt" so partial results survive.
#
#   OUT=/tmp/scaling bash bench/scaling_run.sh          # on the GPU host, from the repo root
#   SMOKE=1 OUT=/tmp/s bash bench/scaling_run.sh        # CPU smoke test: gloo, tiny sizes
#
# The GPU counts are lists (2,4,8 / 1,2,4,8 / layouts up to 8 processes): each bench skips,
# with a note, what needs more GPUs than the host has, so the same command runs unchanged on
# 4 and on 8 GPUs. BUDGET_S caps the whole run: a bench gets at most what is left of it.
set -uo pipefail

OUT="${OUT:?set OUT to the folder the outputs go to}"
PYTHON="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-540}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast can put a shared host's GPUs out of service: keep it off everywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GLOO_SOCKET_IFNAME=lo
started=$(date +%s)
failed=0

# run_bench NAME SECONDS COMMAND...: at most SECONDS, and never past the run's budget.
run_bench() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - started)))
    if ((left < 20)); then
        echo "# $name skipped: ${left}s of the ${BUDGET_S}s budget left" | tee "$OUT/$name.txt"
        failed=1
        return
    fi
    ((limit > left)) && limit=$left
    echo "### $name (limit ${limit}s): $*" | tee "$OUT/$name.txt"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
    rc=${PIPESTATUS[0]}
    echo "### $name: exit $rc after $(($(date +%s) - t0))s" | tee -a "$OUT/$name.txt"
    ((rc == 0)) || failed=1
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    uname -r
    nvidia-smi -L || true
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    nvidia-smi topo -m || true
    nproc
    "$PYTHON" --version
    "$PYTHON" -m pip list 2>/dev/null | grep -i -E "^(torch|nvidia-nccl)" || true
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None, \
'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/machine.txt"

if [[ "${SMOKE:-0}" == 1 ]]; then
    run_bench allreduce 120 "$PYTHON" -m bench.allreduce --procs 2,4 --sizes 1M,16M \
        --rounds 2 --target-s 0.05
    run_bench dp_fp32 240 "$PYTHON" -m bench.dp_throughput --workers 1,2 --epochs 1 \
        --hidden 256 --layers 2 --per-worker-batch 32 --data synthetic --warmup-steps 2 \
        --runners ours_processes,ddp
    run_bench pipeline 240 "$PYTHON" -m bench.pipeline --layouts 2x2,1x4,4x1 \
        --hidden 64 --layers-per-stage 1 --micro-size 8 --micro-batches 4 --steps 3 \
        --warmup 1 --compare-torch
else
    run_bench allreduce 120 "$PYTHON" -m bench.allreduce --backend nccl --procs 2,4,8 \
        --sizes 1M,16M,64M,128M,256M --rounds 3
    # Compute-bound: fp32 (TF32 off, torch's default) MLP 64-8192x8-10, 470 M parameters
    # (1.75 GiB of gradients), 1024 samples per GPU per step at every count (weak scaling).
    run_bench dp_fp32 180 "$PYTHON" -m bench.dp_throughput --device cuda --workers 1,2,4,8 \
        --hidden 8192 --layers 8 --per-worker-batch 1024 --epochs 2 --warmup-steps 3 \
        --runners ours_processes,ddp
    run_bench pipeline 200 "$PYTHON" -m bench.pipeline --device cuda \
        --layouts 2x2,1x4,4x1,2x4,4x2 --hidden 8192 --layers-per-stage 4 --micro-size 512 \
        --micro-batches 4,8,16 --steps 5 --warmup 2
    # The same model under bf16 autocast: a step 3 to 4 times shorter, the same bytes to sum.
    run_bench dp_bf16 120 "$PYTHON" -m bench.dp_throughput --device cuda --workers 1,2,4,8 \
        --hidden 8192 --layers 8 --per-worker-batch 1024 --epochs 2 --warmup-steps 3 \
        --runners ours_processes,ddp --amp bf16
fi

echo "# scaling run done in $(($(date +%s) - started))s, all benches ok: $((1 - failed))" |
    tee -a "$OUT/machine.txt"
exit "$failed"
