"""The ring over NCCL, one process per GPU: same results as NCCL's own, and deadlines hold.

Needs 2 CUDA devices (``-m gpu`` on the lent GPU machine); skipped elsewhere. With
``RINGFLOW_GPU_WORLD=4`` (4 devices) the same tests run 4 ranks.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

from tests.support.net import free_port

WORLD = int(os.environ.get("RINGFLOW_GPU_WORLD", "2"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices"),
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _spawn(target, *args, reports: int = WORLD, timeout_s: float = 240) -> list:
    """Start one ``target(rank, *args, queue)`` process per rank; the first ``reports``
    things they put on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        return [queue.get(timeout=timeout_s) for _ in range(reports)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _setup(rank: int, port: int, transport: str):
    import torch.distributed as dist

    from ringflow.engine.collective import RingCollective

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=dt.timedelta(seconds=60))
    dist.init_process_group(
        "nccl", store=dist.PrefixStore("native", store), rank=rank, world_size=WORLD
    )
    rings = {
        c: RingCollective(
            rank=rank,
            world_size=WORLD,
            backend="nccl",
            store=dist.PrefixStore(c, store),
            compression=c,
            timeout_s=20,
            transport=transport,
        )
        for c in ("none", "bf16")
    }
    return dist, store, rings


def _input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return (torch.randint(-8, 9, (numel,), generator=g).float() / 4).to(dtype).cuda()


def _correctness_main(rank: int, port: int, transport: str, queue) -> None:
    try:
        dist, _, rings = _setup(rank, port, transport)
        failures = [] if rings["none"].transport == transport else ["transport"]
        for numel in (0, 1, 3, 1000, (1 << 20) + 3, (8 << 20) + 1, 40 << 20):
            for dtype in DTYPES:
                for op in ("sum", "avg"):
                    x = _input(numel, rank, numel, dtype)
                    want = x.clone()
                    dist.all_reduce(want)
                    if op == "avg":
                        want /= WORLD
                    for name, ring in rings.items():
                        got = ring.allreduce_(x.clone(), op=op)
                        if not torch.equal(got, want):
                            failures.append((numel, str(dtype), op, name))
        ring = rings["none"]
        y = torch.arange(5000, device="cuda", dtype=torch.float32) * (rank + 1)
        ring.broadcast_(y, src=1)
        if not torch.equal(y, torch.arange(5000, device="cuda", dtype=torch.float32) * 2):
            failures.append("broadcast")
        parts = ring.all_gather(torch.full((7, 3), float(rank), device="cuda"))
        if not all(
            torch.equal(p, torch.full((7, 3), float(q), device="cuda")) for q, p in enumerate(parts)
        ):
            failures.append("all_gather")
        works = [
            ring.allreduce_async_(torch.full((1 << 20,), float(i), device="cuda")) for i in range(5)
        ]
        if [float(w.wait()[0]) for w in works] != [WORLD * float(i) for i in range(5)]:
            failures.append("async")
        failures += _reused_buffer_failures(dist, ring, rank, transport)
        failures += _side_stream_failures(ring, rank)
        _close(dist, rings)
        queue.put((rank, failures))
    except Exception:  # noqa: BLE001 - the test reports it
        queue.put((rank, [traceback.format_exc()]))


def _close(dist, rings) -> None:
    for ring in rings.values():
        ring.close()
    dist.destroy_process_group()


def _own_buffers_main(rank: int, port: int, queue) -> None:
    """Buffers the ring allocated (symmetric memory), reduced in place again and again as
    gradient buckets are, against NCCL's all-reduce."""
    os.environ["RINGFLOW_SYMM_PIECE_MB"] = "16"  # the last size goes in 3 and in 5 pieces
    try:
        dist, _, rings = _setup(rank, port, "symm")
        ring, failures = rings["none"], []
        for numel in (1000, (3 << 20) + 5, (20 << 20) + 3):
            for dtype in (torch.float32, torch.bfloat16):
                own = ring.empty(numel, dtype, torch.device("cuda", rank))
                if ring._transport._symmetric.peers(own) is None:
                    failures.append(f"{numel} {dtype}: not in symmetric memory")
                for op in ("sum", "avg"):  # avg: the gradient buckets' mean, in the kernel
                    label = f"{numel} {dtype} {op}"
                    failures += _rounds_failures(dist, ring, rank, own, label, seed=0, op=op)
        _close(dist, rings)
        queue.put((rank, failures))
    except Exception:  # noqa: BLE001 - the test reports it
        queue.put((rank, [traceback.format_exc()]))


def test_gpu_ring_reduces_buffers_it_allocated_in_place():
    replies = dict(_spawn(_own_buffers_main, free_port()))
    assert replies == dict.fromkeys(range(WORLD), [])


def _reused_buffer_failures(dist, ring, rank: int, transport: str) -> list[str]:
    """The same buffer again and again, as gradient buckets are: the symm transport (unless
    RINGFLOW_SYMM_GRAPHS=0) replays what it recorded the first time, and each replay must sum the
    buffer's new values."""
    bucket = torch.empty((3 << 20) + 5, device="cuda")
    failures = _rounds_failures(dist, ring, rank, bucket, "reused buffer", seed=100)
    graphs = os.environ.get("RINGFLOW_SYMM_GRAPHS", "1") == "1"
    if transport == "symm" and graphs and not ring._transport._graphs:
        failures.append("no collective was recorded as a CUDA graph")
    return failures


def _rounds_failures(
    dist, ring, rank: int, buffer, label: str, *, seed: int, op: str = "sum"
) -> list[str]:
    """``buffer`` filled anew and all-reduced in place three times, each against NCCL's."""
    failures = []
    for round_ in range(3):
        buffer.copy_(_input(seed + round_, rank, buffer.numel(), buffer.dtype))
        want = buffer.clone()
        dist.all_reduce(want)
        if op == "avg":
            want /= WORLD
        if not torch.equal(ring.allreduce_(buffer, op=op), want):
            failures.append(f"{label}, round {round_}")
    return failures


def _side_stream_failures(ring, rank: int) -> list[str]:
    """The ring runs beside the caller's stream, and results land where they belong."""
    failures = []
    total = float(sum(range(1, WORLD + 1)))
    grid = torch.full((512, 768), float(rank + 1), device="cuda").t()  # not contiguous
    if not torch.equal(ring.allreduce_(grid), torch.full_like(grid, total)):
        failures.append("non-contiguous")
    x = torch.full((16 << 20,), float(rank + 1), device="cuda")
    work = ring.allreduce_async_(x)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the caller's stream, launched after the ring
    started = time.monotonic()
    ring._transport._stream.synchronize()
    beside = time.monotonic() - started
    if beside > 0.5:
        failures.append(f"the ring waited for the caller's later work ({beside:.2f} s)")
    if not torch.equal(work.wait(), torch.full_like(x, total)):
        failures.append("beside")
    return failures


TRANSPORTS = ("symm", "nccl")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gpu_ring_matches_nccl_all_reduce(transport: str):
    replies = dict(_spawn(_correctness_main, free_port(), transport))
    assert replies == dict.fromkeys(range(WORLD), [])


@pytest.mark.parametrize("rounds", [2, 3])
def test_gpu_fused_kernel_in_rounds_matches_nccl_all_reduce(rounds: int, monkeypatch):
    """Plain tensors through the kernel in rounds (each round's copy-out beside the next
    round's pushes), an even and an odd count of barriers, bit for bit as NCCL's."""
    monkeypatch.setenv("RINGFLOW_SYMM_ROUNDS", str(rounds))  # the spawned ranks inherit it
    monkeypatch.setenv("RINGFLOW_SYMM_ROUNDS_FROM_MB", "0")  # every size, the smallest too
    replies = dict(_spawn(_correctness_main, free_port(), "symm"))
    assert replies == dict.fromkeys(range(WORLD), [])


def _failure_main(rank: int, port: int, transport: str, numel: int, queue) -> None:
    import faulthandler

    from ringflow.engine.collective import PeerLostError, RingCollective

    folder = os.environ.get("RINGFLOW_TRACE_DIR", "/tmp")
    trace = open(os.path.join(folder, f"rank{rank}.txt"), "w")  # noqa: SIM115 - process-long
    faulthandler.enable(trace)  # a crash shows where it crashed
    faulthandler.dump_traceback_later(30, exit=True, file=trace)  # and a hang where it hangs
    torch.cuda.set_device(rank)
    ring = RingCollective(
        rank=rank,
        world_size=WORLD,
        backend="nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        timeout_s=3,
        transport=transport,
    )
    tensor = torch.zeros(numel, device="cuda")
    ring.allreduce_(tensor)
    started = time.time()
    try:
        while True:
            if rank == 1 and time.time() - started > 1.0:
                os._exit(0)  # dies between two hops, as a crash would
            ring.allreduce_(tensor)
            torch.cuda.current_stream().synchronize()  # as training does, once a step
            print(f"{time.time() - started:.3f} step done", file=trace, flush=True)
    except PeerLostError as err:
        print(f"{time.time() - started:.3f} raised {err!r}", file=trace, flush=True)
        late_s = time.time() - started - 1.0
        queue.put((rank, (type(err).__name__, err.peer, err.op, late_s, str(err))))
    except BaseException as err:  # noqa: BLE001
        print(f"{time.time() - started:.3f} other {err!r}", file=trace, flush=True)
        queue.put((rank, (repr(err), None, None, None, "")))
    queue.close()
    queue.join_thread()  # put() only hands the report to a feeder thread: let it finish
    os._exit(0)  # NCCL teardown after an abort can block: the verdict is what matters


# A large collective through the fused kernel (pieces) and through the ring's schedule
# (segments overlapped, as compression travels), and a small one.
SIZES = {"fused": 64 << 20, "ring": 64 << 20, "small": 1 << 20}


def _route(size: str, monkeypatch) -> None:
    if size == "ring":  # the spawned ranks inherit it
        monkeypatch.setenv("RINGFLOW_SYMM_FUSED_BELOW", "0")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gpu_survivor_raises_within_the_deadline(transport: str, size: str, monkeypatch):
    if transport == "nccl" and size == "fused":
        pytest.skip("the fused kernel is the symm transport's")
    _route(size, monkeypatch)
    reports = _spawn(
        _failure_main, free_port(), transport, SIZES[size], reports=WORLD - 1, timeout_s=45
    )
    assert sorted(rank for rank, _ in reports) == [r for r in range(WORLD) if r != 1]
    for _, (name, peer, op, late_s, _) in reports:
        assert name in ("PeerLostError", "CollectiveTimeoutError"), reports
        assert (peer, op) == (1, "allreduce"), reports  # the messages say what each rank saw
        assert late_s < 3 + 1.5, reports


def _stall_main(rank: int, port: int, numel: int, queue) -> None:
    from ringflow.engine.collective import PeerLostError, RingCollective

    torch.cuda.set_device(rank)
    ring = RingCollective(
        rank=rank,
        world_size=WORLD,
        backend="nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        timeout_s=3,
        transport="symm",
    )
    tensor = torch.zeros(numel, device="cuda")
    ring.allreduce_(tensor)
    torch.cuda.current_stream().synchronize()
    if rank == 1:
        time.sleep(12)  # alive but not answering, as a stopped or wedged process
        os._exit(0)
    started = time.time()
    try:
        for _ in range(1000):
            ring.allreduce_(tensor)
            torch.cuda.current_stream().synchronize()
        report = ("finished", None, None, None)
    except PeerLostError as err:
        usable = float(torch.ones(10, device="cuda").sum())  # the CUDA context survived
        report = (type(err).__name__, err.peer, usable, time.time() - started)
    queue.put((rank, report))
    queue.close()
    queue.join_thread()
    os._exit(0)


@pytest.mark.parametrize("size", SIZES)
def test_symm_survivor_of_a_stalled_peer_raises_within_the_deadline_and_keeps_its_gpu(
    size: str, monkeypatch
):
    _route(size, monkeypatch)
    reports = _spawn(_stall_main, free_port(), SIZES[size], reports=WORLD - 1, timeout_s=60)
    assert sorted(rank for rank, _ in reports) == [r for r in range(WORLD) if r != 1]
    for _, (name, peer, usable, after_s) in reports:
        # Which rank is blamed is a guess when one is alive but silent; what matters is the
        # typed error by the deadline, with this process's GPU still usable.
        assert (name, usable) == ("CollectiveTimeoutError", 10.0)
        assert peer in range(WORLD)
        assert after_s < 3 + 1.5
