"""A peer killed or stopped in the middle of an all-reduce: every survivor raises, on time.

Three ranks all-reduce 16 MiB in a loop; the test SIGKILLs or SIGSTOPs some of them and
checks that each survivor raises ``PeerLostError`` (``CollectiveTimeoutError`` for a
stopped peer) naming a victim and the operation, within the collective deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from tests.support.net import free_port

WORLD = 3
DEADLINE_S = 2.0
SLACK_S = 1.0  # scheduling on a loaded 2-core machine


def _context():
    """Fork rank processes from a server that imported torch once: each starts in a moment."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "ringflow.engine.collective"])
    return ctx


def _rank_main(rank: int, port: int, transport: str, queue, op: str = "allreduce") -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    from ringflow.engine.collective import PeerLostError, RingCollective

    ring = RingCollective(
        rank=rank,
        world_size=WORLD,
        init_method=f"tcp://127.0.0.1:{port}",
        transport=transport,
        timeout_s=DEADLINE_S,
        connect_timeout_s=60,
    )
    tensor = torch.zeros((4 << 20) - (4 << 20) % WORLD)
    shard = tensor[: tensor.numel() // WORLD].clone()
    collectives = {
        "allreduce": lambda: ring.allreduce_(tensor),
        "reduce_scatter": lambda: ring.reduce_scatter_(tensor, out=shard),
        "all_gather": lambda: ring.all_gather_into_(shard, out=tensor),
    }
    collectives[op]()
    queue.put((rank, "ready", os.getpid()))
    try:
        while True:
            collectives[op]()
    except PeerLostError as err:
        queue.put((rank, "raised", (type(err).__name__, err.peer, err.op, time.time(), str(err))))
    except BaseException as err:  # noqa: BLE001 - reported as a failure below
        queue.put((rank, "other", repr(err)))
    # A survivor's process lives on after it raised, as a worker's does while its group
    # recovers: another survivor still waiting must blame the victim, not a rank that ended.
    time.sleep(DEADLINE_S + 60)


@pytest.mark.parametrize(
    ("transport", "signals"),
    [
        ("shm", {1: signal.SIGKILL}),
        ("shm", {1: signal.SIGSTOP}),
        ("shm", {1: signal.SIGKILL, 2: signal.SIGSTOP}),
        ("gloo", {1: signal.SIGKILL}),
        ("gloo", {0: signal.SIGSTOP}),  # rank 0 also hosts the rendezvous store
    ],
    ids=["shm-kill", "shm-stop", "shm-kill-and-stop", "gloo-kill", "gloo-stop-store-host"],
)
def test_survivors_raise_a_typed_error_within_the_deadline(transport, signals):
    _kill_and_check(transport, signals, "allreduce")


@pytest.mark.parametrize(
    ("transport", "signals", "op"),
    [
        ("shm", {1: signal.SIGKILL}, "reduce_scatter"),
        ("gloo", {2: signal.SIGSTOP}, "reduce_scatter"),
        ("shm", {2: signal.SIGSTOP}, "all_gather"),
        ("gloo", {1: signal.SIGKILL}, "all_gather"),
    ],
    ids=["shm-kill-rs", "gloo-stop-rs", "shm-stop-ag", "gloo-kill-ag"],
)
def test_reduce_scatter_and_all_gather_survivors_raise_a_typed_error(transport, signals, op):
    """The two halves of the all-reduce on their own (sharded data parallel's collectives)
    carry its deadline: a lost peer is an error naming it and the operation, not a hang."""
    _kill_and_check(transport, signals, op)


def _kill_and_check(transport: str, signals: dict, op: str) -> None:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, transport, queue, op), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        pids = {}
        while len(pids) < WORLD:
            rank, what, pid = queue.get(timeout=60)
            assert what == "ready", (rank, what, pid)
            pids[rank] = pid
        time.sleep(0.3)  # well inside the loop of all-reduces
        for rank, sig in signals.items():
            os.kill(pids[rank], sig)
        signalled_at = time.time()
        survivors = sorted(set(range(WORLD)) - set(signals))
        reports = {}
        for _ in survivors:
            rank, what, payload = queue.get(timeout=DEADLINE_S + 10)
            assert what == "raised", f"rank {rank} ended with {payload}"
            reports[rank] = payload
        _check(reports, survivors, signals, signalled_at, op=op)
    finally:
        for p in procs:
            p.kill()  # SIGKILL ends stopped processes too
            p.join(5)


def _check(
    reports: dict, survivors: list[int], signals: dict, signalled_at: float, *, op: str
) -> None:
    assert sorted(reports) == survivors
    stopped_only = all(sig == signal.SIGSTOP for sig in signals.values())
    for rank, (name, peer, reported, raised_at, message) in reports.items():
        assert name in ("PeerLostError", "CollectiveTimeoutError"), message
        if stopped_only:
            assert name == "CollectiveTimeoutError", message
        assert peer in signals, f"rank {rank} blamed {peer}: {message}"
        assert reported == op
        assert raised_at - signalled_at < DEADLINE_S + SLACK_S, f"rank {rank} raised late"


def test_survivors_that_time_out_together_blame_the_dead_rank_not_a_late_store_host():
    """Ranks 2 and 3 of 4 time out while rank 1 is dead and rank 0, whose process holds the
    store (so it runs), is slow to say it is alive: the verdict is rank 1, whichever rank's
    left neighbour each survivor waited on (a fused kernel waits on every rank alike)."""
    import datetime as dt
    import threading

    import torch.distributed as dist

    from ringflow.engine.collective._p2p import _StoreArbiter
    from ringflow.engine.collective._transport import Deadline
    from ringflow.engine.errors import CollectiveTimeoutError

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    verdicts: dict[int, object] = {}

    def survivor(rank: int, suspect: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=dt.timedelta(seconds=5))
        arbiter = _StoreArbiter(store, rank=rank, world_size=4, timeout_s=3.0)
        try:
            arbiter.fail(
                timed_out=True,
                suspect=suspect,
                deadline=Deadline.after(0.6, op="allreduce"),
                cause="a hop hung",
            )
        except CollectiveTimeoutError as err:
            verdicts[rank] = err.peer

    threads = [threading.Thread(target=survivor, args=(r, (r + 1) % 4)) for r in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    host.set("alive/0", b"1")  # rank 0 arrives once they decided
    assert verdicts == {2: 1, 3: 1}


def test_a_failure_the_device_found_after_wait_is_raised_by_check_and_kept():
    """``check`` raises what a transport's device work found after its collective's wait
    returned, and the ring stays failed: every later collective raises it too."""
    from ringflow.engine.collective import RingCollective
    from ringflow.engine.collective._transport import Transport
    from ringflow.engine.errors import PeerLostError

    class Aborted(Transport):  # its last collective's kernels were aborted at the deadline
        name, wavefront, inline = "aborted", False, True

        def run(self, plan, *, wire, finish, deadline):
            raise AssertionError("no collective may start on a failed ring")

        def check(self) -> None:
            raise PeerLostError("rank 1 is lost", peer=1, op="allreduce", rank=0)

    ring = RingCollective(rank=0, world_size=1)
    ring.check()  # nothing failed: nothing raised
    ring._transport = Aborted()
    with pytest.raises(PeerLostError, match="rank 1 is lost"):
        ring.check()
    with pytest.raises(PeerLostError, match="rank 1 is lost"):
        ring.allreduce_(torch.ones(4))
    ring._transport = None
