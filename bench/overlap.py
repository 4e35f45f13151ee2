"""What an all-reduce costs the computation it overlaps: our ring against ``torch.distributed``.

A data-parallel step hides its gradients' all-reduces behind the backward pass, but hidden is
not free: a collective's kernels take SMs, memory bandwidth and, while they wait for a late
peer, whole SMs that spin. This benchmark plays a backward pass in each process: ``--buckets``
chunks of matrix products (``--matmul``, ``--per-bucket`` of them a chunk), and after each
chunk the all-reduce of one ``--bucket-mb`` float32 bucket starts, as gradient buckets do. It
times the same steps with no collective (``compute``), with ``torch.distributed``'s all-reduce
(``native``, NCCL on GPUs) and with our ring on buckets it allocated (``ring``; with
``--blocks``, once per block count of the symmetric-memory kernel). With ``--skew-ms`` rank
``r`` starts ``r`` times that late, as ranks whose hosts lag do. Rounds interleave the
variants; each keeps its fastest round, timed on the slowest rank.

It prints the step's time, the time the collectives added to it (``exposed``) and native's
step time over each variant's (``native/this``); the last line is one JSON object with
``ring_vs_native`` (per process count, skew and ring variant: native's step time over the
ring's; above 1.0 the ring costs the step less).

    python -m bench.overlap --backend nccl --procs 2,4                      # GPUs
    python -m bench.overlap --backend nccl --procs 4 --skew-ms 0,2 --blocks 16,32,64
    python -m bench.overlap                        # CPU, gloo: the code path, small sizes
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench import headline_json
from bench.allreduce import _device_name, join_group, run_group

HEADLINE = ("ring_vs_native",)
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Options:
    backend: str
    procs: list[int]
    bucket_mb: float
    buckets: int
    matmul: int
    per_bucket: int
    skews_ms: list[float]
    blocks: list[int | None]
    rounds: int


def main(argv: list[str] | None = None) -> dict:
    options = _parse(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast can wedge a shared host
    print(
        f"# overlap, backend={options.backend}, {options.buckets} buckets of "
        f"{options.bucket_mb:g} MiB, {options.per_bucket} matmul(s) of {options.matmul} "
        f"per bucket, torch {torch.__version__}, {_device_name(options.backend)}, "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        flush=True,
    )
    rows: list[dict] = []
    for n in options.procs:
        rows += run_group(_rank_main, n, options)
    _print_table(rows)
    summary = {"ring_vs_native": _ratios(rows), "rows": rows}
    print(headline_json(summary, HEADLINE), flush=True)
    return summary


def _parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--procs", default="2", help="process counts, comma-separated")
    parser.add_argument("--bucket-mb", type=float, default=None, help="default 25 (GPU), 1 (CPU)")
    parser.add_argument("--buckets", type=int, default=20)
    parser.add_argument("--matmul", type=int, default=None, help="default 8192 (GPU), 256 (CPU)")
    parser.add_argument("--per-bucket", type=int, default=1, help="matmuls between buckets")
    parser.add_argument("--skew-ms", default="0", help="rank r starts r x this late; a list")
    parser.add_argument("--blocks", default="", help="ring kernel block counts (GPU), a list")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    gpu = args.backend == "nccl"
    if args.bucket_mb is not None and args.bucket_mb <= 0:
        parser.error("--bucket-mb must be positive")
    if args.buckets < 1 or args.per_bucket < 0 or args.rounds < 1:
        parser.error("--buckets and --rounds must be at least 1, --per-bucket at least 0")
    return Options(
        backend=args.backend,
        procs=[int(p) for p in args.procs.split(",")],
        bucket_mb=args.bucket_mb or (25.0 if gpu else 1.0),
        buckets=args.buckets,
        matmul=args.matmul or (8192 if gpu else 256),
        per_bucket=args.per_bucket,
        skews_ms=[float(s) for s in args.skew_ms.split(",")],
        blocks=[int(b) for b in args.blocks.split(",") if b] or [None],
        rounds=args.rounds,
    )


def _rank_main(rank: int, n: int, ports: list[int], options: Options, queue) -> None:
    device, common, native, store = join_group(rank, n, ports, options.backend)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(options.matmul, options.matmul, device=device, dtype=dtype)
    b = torch.randn(options.matmul, options.matmul, device=device, dtype=dtype)
    out = torch.empty_like(a)

    def compute() -> None:
        for _ in range(options.per_bucket):
            torch.matmul(a, b, out=out)

    variants = _variants(native, store, common, options, device)
    rows = []
    for skew in options.skews_ms:
        step = functools.partial(_step, compute=compute, native=native, late_ms=skew * rank)
        best = _fastest(variants, options.rounds, step)
        if rank == 0:
            rows += [
                {"procs": n, "skew_ms": skew, "variant": name, "step_ms": t * 1e3}
                for name, t in best.items()
            ]
    for c, _ in variants.values():
        if c is not None and c is not native:
            c.close()
    native.close()
    if rank == 0:
        queue.put(rows)


def _variants(native, store, common: dict, options: Options, device: torch.device) -> dict:
    """Name -> (collective or ``None`` for compute alone, the buckets it reduces)."""
    from ringflow.engine.collective import RingCollective

    numel = int(options.bucket_mb * MIB) // 4
    plain = [torch.ones(numel, device=device) for _ in range(options.buckets)]
    variants = {"compute": (None, plain), "native": (native, plain)}
    for blocks in options.blocks:
        if blocks is not None:  # read as the ring's kernel is made, at its first all-reduce
            os.environ["RINGFLOW_SYMM_FUSED_BLOCKS"] = str(blocks)
        prefix = dist.PrefixStore(f"ring{blocks}", store)
        ring = RingCollective(**common, store=prefix, timeout_s=120)
        buckets = [ring.empty(numel, torch.float32, device) for _ in range(options.buckets)]
        for bucket in buckets:
            bucket.fill_(1.0)
            ring.allreduce_(bucket, op="avg")
        variants["ring" if blocks is None else f"ring{blocks}"] = (ring, buckets)
    return variants


def _fastest(variants: dict, rounds: int, step) -> dict[str, float]:
    """Each variant's fastest ``step`` in ``rounds`` interleaved rounds, after one to warm up;
    its sums checked."""
    for c, buckets in variants.values():
        step(c, buckets)
    best = {name: float("inf") for name in variants}
    for _ in range(rounds):
        for name, (c, buckets) in variants.items():
            best[name] = min(best[name], step(c, buckets))
    for name, (c, buckets) in variants.items():
        if c is not None:  # averages of ones stay ones: the sums were right
            assert all(torch.allclose(x, torch.ones_like(x)) for x in buckets), name
    return best


def _step(c, buckets, *, compute, native, late_ms: float) -> float:
    """One played backward pass, from the ranks' common start to the last all-reduce's end,
    on the slowest rank (seconds)."""
    device = buckets[0].device
    native.allreduce_(torch.zeros(1, device=device))  # line the ranks up
    _sync(device)
    started = time.perf_counter()
    _sleep(device, late_ms)
    works = []
    for bucket in buckets:
        compute()
        if c is not None:
            works.append(c.allreduce_async_(bucket, op="avg"))
    for work in works:
        work.wait()
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - started], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


_CYCLES_PER_MS: dict[int, float] = {}


def _sleep(device: torch.device, ms: float) -> None:
    """Hold this rank's stream (GPU) or host (CPU) ``ms`` milliseconds."""
    if ms <= 0:
        return
    if device.type != "cuda":
        time.sleep(ms / 1e3)
        return
    if device.index not in _CYCLES_PER_MS:  # calibrate once, warmed up
        cycles = 10_000_000
        torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS[device.index] = cycles / start.elapsed_time(end)
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS[device.index]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _print_table(rows: list[dict]) -> None:
    header = ("procs", "skew ms", "variant", "step ms", "exposed ms", "native/this")
    print("{:>5} {:>7} {:<10} {:>9} {:>10} {:>11}".format(*header))
    for row in rows:
        base = _find(rows, row, "compute")
        native = _find(rows, row, "native")
        ratio = native / row["step_ms"] if row["variant"] != "compute" else float("nan")
        print(
            f"{row['procs']:>5} {row['skew_ms']:>7g} {row['variant']:<10} {row['step_ms']:>9.2f} "
            f"{row['step_ms'] - base:>10.2f} {ratio:>11.3f}"
        )


def _find(rows: list[dict], like: dict, variant: str) -> float:
    return next(
        r["step_ms"]
        for r in rows
        if (r["procs"], r["skew_ms"], r["variant"]) == (like["procs"], like["skew_ms"], variant)
    )


def _ratios(rows: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        if row["variant"].startswith("ring"):
            by_skew = ratios.setdefault(str(row["procs"]), {}).setdefault(f"{row['skew_ms']:g}", {})
            by_skew[row["variant"]] = round(_find(rows, row, "native") / row["step_ms"], 3)
    return ratios


if __name__ == "__main__":
    main()
