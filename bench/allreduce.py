"""All-reduce: our ring against ``torch.distributed``'s own, in the same processes, same run.

For each process count and size it times the native all-reduce (gloo or NCCL), our ring in
float32 and our ring with bfloat16 on the wire, interleaved in rounds so that a noisy
neighbour slows all three alike, keeps each one's fastest round (other tenants only ever add
time), and prints time per operation, bus bandwidth
(size x 2(n-1)/n / time) and the ratios. The last line is one JSON object:
``min_ratio_16mib_up`` (the worst native/ours time ratio from 16 MiB up: 1.0 means as fast)
and ``bf16_speedup_64mib_up`` (the worst native-float32/ours-bfloat16 ratio from 64 MiB up).

    python -m bench.allreduce                                 # CPU, gloo, 2 and 4 processes
    python -m bench.allreduce --backend nccl --procs 2        # one process per GPU
    python -m bench.allreduce --backend nccl --procs 2,4,8    # one host, 2 to 8 GPUs
    python -m bench.allreduce --backend nccl --procs 4 --transport symm --ring-buffers

``--ring-buffers`` also times the ring on tensors it allocated itself (``ring_own``), as
gradient buckets are: on the ``symm`` transport symmetric memory (unless
``RINGFLOW_SYMM_BUCKETS=0``), whose sums the kernel writes straight into every rank's copy.

A process count larger than the GPUs present is skipped with a note, so the same command
runs unchanged on a 4-GPU and an 8-GPU host.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import headline_json
from bench.ports import free_port

HEADLINE = (
    "min_ratio_16mib_up",
    "min_ratio_128mib_up",
    "bf16_speedup_64mib_up",
    "min_ratio_own_16mib_up",
)
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,32M,64M,128M,256M"
VARIANTS = ("native", "ring", "ring_bf16")


@dataclass(frozen=True, kw_only=True)
class Options:
    backend: str
    procs: list[int]
    sizes: list[int]
    rounds: int
    target_s: float
    transport: str
    segment_bytes: int | None
    ring_buffers: bool = False
    """Also time the ring on a tensor it allocated (``Collective.empty``, what gradient buckets
    reduce): on ``symm`` that is symmetric memory (unless ``RINGFLOW_SYMM_BUCKETS=0``)."""


def main(argv: list[str] | None = None) -> dict:
    options = _parse(argv)
    # NVLink multicast (NVLS) can wedge a shared host's GPUs: off unless the user says otherwise.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    print(
        f"# all-reduce, backend={options.backend}, transport={options.transport}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{_device_name(options.backend)}",
        flush=True,
    )
    rows = []
    for n in options.procs:
        rows += run_group(_rank_main, n, options)
    summary = _summary(rows)
    print(headline_json(summary, HEADLINE), flush=True)
    return summary


def _parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--procs", default="2,4", help="process counts, comma-separated")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="bytes, e.g. 1K,16M,256M")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    parser.add_argument("--target-s", type=float, default=0.15, help="time per timed block")
    parser.add_argument(
        "--transport", default="auto", help="the ring's: auto, shm, gloo, nccl, symm"
    )
    parser.add_argument("--segment-bytes", default=None, help="the ring's segment, e.g. 1M")
    parser.add_argument(
        "--ring-buffers",
        action="store_true",
        help="also time the ring on tensors it allocated, as gradient buckets are (ring_own)",
    )
    args = parser.parse_args(argv)
    return Options(
        backend=args.backend,
        procs=[int(p) for p in args.procs.split(",")],
        sizes=[_bytes(s) for s in args.sizes.split(",")],
        rounds=args.rounds,
        target_s=args.target_s,
        transport=args.transport,
        segment_bytes=_bytes(args.segment_bytes) if args.segment_bytes else None,
        ring_buffers=args.ring_buffers,
    )


def run_group(rank_main, n: int, options) -> list[dict]:
    """``rank_main(rank, n, ports, options, queue)`` in ``n`` spawned processes (one GPU each on
    ``nccl``, where ``options.backend`` names the backend); the rows rank 0 put on the queue,
    none where the host has fewer GPUs than ``n``."""
    if options.backend == "nccl" and torch.cuda.device_count() < n:
        print(f"# skipping {n} processes: only {torch.cuda.device_count()} GPUs", flush=True)
        return []
    ports = [free_port() for _ in range(2)]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(n, ports, options, queue), nprocs=n, join=True)
    return queue.get()


def join_group(rank: int, n: int, ports: list[int], backend: str):
    """This spawned rank's device, the arguments every collective of the group takes, the
    native collective (the default process group) and a store for the ring's rendezvous."""
    from ringflow.engine.collective import NativeCollective

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    common = {"rank": rank, "world_size": n, "backend": backend}
    native = NativeCollective(**common, init_method=f"tcp://127.0.0.1:{ports[0]}", timeout_s=300)
    store = dist.TCPStore("127.0.0.1", ports[1], n, rank == 0, timeout=dt.timedelta(seconds=120))
    return device, common, native, store


def _rank_main(rank: int, n: int, ports: list[int], options: Options, queue) -> None:
    from ringflow.engine.collective import RingCollective

    device, common, native, store = join_group(rank, n, ports, options.backend)
    ring_options = {"transport": options.transport, "segment_bytes": options.segment_bytes}
    rings = {
        "ring": RingCollective(
            **common,
            **ring_options,
            store=dist.PrefixStore("fp32", store),
            timeout_s=120,
        ),
        "ring_bf16": RingCollective(
            **common,
            **ring_options,
            store=dist.PrefixStore("bf16", store),
            timeout_s=120,
            compression="bf16",
        ),
    }
    _check(native, rings, n, rank, device)
    collectives = {"native": native, **rings}
    rows = []
    for size in options.sizes:
        times = _time_size(collectives, size, options, device, native)
        if options.ring_buffers:
            own = rings["ring"].empty(max(1, size // 4), torch.float32, device)
            times["ring_own"] = _time_size(
                {"native": native, "ring": rings["ring"]}, size, options, device, native, tensor=own
            )["ring"]
        if rank == 0:
            rows.append(_row(n, size, times, rings["ring"].transport))
    for c in collectives.values():
        c.close()
    if rank == 0:
        queue.put(rows)


def _check(native, rings, n: int, rank: int, device: torch.device) -> None:
    """Every variant must agree with the native result before it is timed."""
    base = torch.arange(1000, device=device, dtype=torch.float32) / 8 + rank
    want = native.allreduce_(base.clone())
    for name, ring in rings.items():
        got = ring.allreduce_(base.clone())
        if not torch.allclose(got, want, rtol=1e-2 if "bf16" in name else 1e-6):
            raise AssertionError(f"{name} disagrees with the native all-reduce on rank {rank}")


def _time_size(
    collectives, size: int, options: Options, device, native, *, tensor: torch.Tensor | None = None
) -> dict[str, float]:
    if tensor is None:
        tensor = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
    for c in collectives.values():  # warm up: buffers, connections, page faults
        c.allreduce_(tensor)
    iters = _iterations(collectives["native"], tensor, options.target_s, native, device)
    samples: dict[str, list[float]] = {name: [] for name in collectives}
    for _ in range(options.rounds):
        for name, c in collectives.items():
            samples[name].append(_timed(c, tensor, iters, native, device))
    return {name: min(values) for name, values in samples.items()}


def _iterations(c, tensor, target_s: float, native, device) -> int:
    once = _timed(c, tensor, 1, native, device)
    return max(2, min(200, int(target_s / max(once, 1e-6))))


def _timed(c, tensor: torch.Tensor, iters: int, native, device) -> float:
    """Seconds per operation: the slowest rank's, so a rank that finishes early counts not."""
    native.allreduce_(torch.zeros(1, device=device))  # line the ranks up
    _sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        c.allreduce_(tensor)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - started) / iters], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _row(n: int, size: int, times: dict[str, float], transport: str) -> dict:
    bus = size * 2 * (n - 1) / n
    row = {
        "procs": n,
        "bytes": size,
        "transport": transport,
        **{f"{k}_ms": v * 1e3 for k, v in times.items()},
        **{f"{k}_busbw_gibs": bus / v / (1 << 30) for k, v in times.items()},
        "ratio": times["native"] / times["ring"],
        "bf16_speedup": times["native"] / times["ring_bf16"],
    }
    if "ring_own" in times:
        row["ratio_own"] = times["native"] / times["ring_own"]
    print(
        f"n={n} {_human(size):>6} native {row['native_ms']:9.3f} ms "
        f"{row['native_busbw_gibs']:6.2f} GiB/s | ring {row['ring_ms']:9.3f} ms "
        f"{row['ring_busbw_gibs']:6.2f} GiB/s ratio {row['ratio']:5.2f} | ring bf16 "
        f"{row['ring_bf16_ms']:9.3f} ms speedup {row['bf16_speedup']:5.2f}"
        + (
            f" | own {row['ring_own_ms']:9.3f} ms ratio {row['ratio_own']:5.2f}"
            if "ratio_own" in row
            else ""
        ),
        flush=True,
    )
    return row


def _summary(rows: list[dict]) -> dict:
    from_16 = [r["ratio"] for r in rows if r["bytes"] >= 16 * MIB]
    from_64 = [r["bf16_speedup"] for r in rows if r["bytes"] >= 64 * MIB]
    from_128 = [r["ratio"] for r in rows if r["bytes"] >= 128 * MIB]
    return {
        "min_ratio_16mib_up": round(min(from_16), 3) if from_16 else None,
        "min_ratio_128mib_up": round(min(from_128), 3) if from_128 else None,
        "bf16_speedup_64mib_up": round(min(from_64), 3) if from_64 else None,
        "min_ratio_own_16mib_up": _least(rows, "ratio_own", 16 * MIB),
        "min_ratio_16mib_up_by_procs": {
            n: round(min(r["ratio"] for r in rows if r["procs"] == n and r["bytes"] >= 16 * MIB), 3)
            for n in sorted({r["procs"] for r in rows if r["bytes"] >= 16 * MIB})
        },
        "rows": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows
        ],
    }


def _least(rows: list[dict], key: str, from_bytes: int) -> float | None:
    values = [r[key] for r in rows if key in r and r["bytes"] >= from_bytes]
    return round(min(values), 3) if values else None


def _bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": KIB, "M": MIB, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def _human(size: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return f"{size // scale}{unit}"
    return f"{size}B"


def _device_name(backend: str) -> str:
    if backend == "nccl" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return "CPU"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
