"""Our ring against ``torch.distributed.all_reduce``, in real processes over real transports.

Five rank processes are spawned once for the module. For each world size (1 to 5) and
transport, the first ``world_size`` of them form a ring, and hypothesis drives many tensor
lengths, dtypes and ops through it, comparing every rank's result with gloo's own
all-reduce on the same inputs. Inputs are quarter-integers, so every sum is exact in every
dtype and any difference is a bug, not rounding.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import multiprocessing as mp
import os
import pickle
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringflow.engine.errors import CollectiveError, CollectiveTimeoutError, PeerLostError
from tests.support.net import free_port

POOL_SIZE = 5
SEGMENT_BYTES = 256  # 64 float32 per segment: even short tensors take many pipelined hops
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_tags = itertools.count()


class _Pool:
    """Rank processes that run commands in lockstep; replies come back in rank order."""

    def __init__(self, size: int) -> None:
        ctx = _context()
        port = free_port()
        self._conns, self._procs = [], []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, size, port, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self.call("ping")

    def call(self, command: str, **kwargs) -> list:
        for conn in self._conns:
            conn.send((command, kwargs))
        replies = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(120):
                raise TimeoutError(f"rank {rank} did not answer {command}")
            replies.append(conn.recv())
        failures = [r[1] for r in replies if isinstance(r, tuple) and r and r[0] == "error"]
        if failures:
            raise AssertionError(f"{command} failed on a rank:\n{failures[0]}")
        return replies

    def ring(self, world_size: int, transport: str, compression: str = "none") -> None:
        self.call(
            "ring",
            world_size=world_size,
            transport=transport,
            compression=compression,
            tag=f"t{next(_tags)}",
        )

    def close(self) -> None:
        for conn in self._conns:
            conn.send(("exit", {}))
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


@pytest.fixture(scope="module")
def pool():
    pool = _Pool(POOL_SIZE)
    yield pool
    pool.close()


def _context():
    """Fork rank processes from a server that imported torch once: each starts in a moment."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "ringflow.engine.collective"])
    return ctx


# -- what each rank process runs ----------------------------------------------------------


def _rank_main(rank: int, size: int, port: int, conn) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=dt.timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=size
    )
    state = {"rank": rank, "store": store, "ring": None, "group": None, "world_size": 0}
    while True:
        command, kwargs = conn.recv()
        if command == "exit":
            break
        try:
            conn.send(_COMMANDS[command](state, **kwargs))
        except Exception:  # noqa: BLE001 - the test process reports it
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
    if state["ring"] is not None:
        state["ring"].close()
    dist.destroy_process_group()


def _ping(state) -> str:
    return "pong"


def _make_ring(state, *, world_size: int, transport: str, compression: str, tag: str):
    import torch.distributed as dist

    from ringflow.engine.collective import RingCollective

    if state["ring"] is not None:
        state["ring"].close()
    # new_group is collective over the whole world, members or not.
    state["group"] = dist.new_group(ranks=list(range(world_size)))
    state["world_size"], state["ring"] = world_size, None
    if state["rank"] < world_size:
        state["ring"] = RingCollective(
            rank=state["rank"],
            world_size=world_size,
            store=dist.PrefixStore(tag, state["store"]),
            transport=transport,
            compression=compression,
            segment_bytes=SEGMENT_BYTES,
            timeout_s=30,
        )
        return state["ring"].transport
    return None


def _input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return (torch.randint(-8, 9, (numel,), generator=g).float() / 4).to(dtype)


def _allreduce(state, *, numel: int, dtype: str, op: str, seed: int, strided: bool = False):
    import torch.distributed as dist

    if state["ring"] is None:
        return None
    x = _input(seed, state["rank"], numel, DTYPES[dtype])
    want = x.clone()
    dist.all_reduce(want, group=state["group"])
    if op == "avg":
        want /= state["world_size"]
    got = x.clone()
    if strided:  # a non-contiguous view: the result must still land in it
        got = torch.stack([got, torch.zeros_like(got)], 1)[:, 0]
    state["ring"].allreduce_(got, op=op)
    return {"equal": torch.equal(got, want), "digest": _digest(got)}


def _broadcast(state, *, numel: int, src: int, seed: int):
    if state["ring"] is None:
        return None
    x = _input(seed, state["rank"], numel, torch.float32)
    want = _input(seed, src, numel, torch.float32)
    return torch.equal(state["ring"].broadcast_(x, src=src), want)


def _all_gather(state, *, numel: int, seed: int):
    if state["ring"] is None:
        return None
    parts = state["ring"].all_gather(_input(seed, state["rank"], numel, torch.float64))
    want = [_input(seed, q, numel, torch.float64) for q in range(state["world_size"])]
    return all(torch.equal(p, w) for p, w in zip(parts, want, strict=True))


def _async_many(state, *, count: int, numel: int):
    """Several all-reduces in flight at once complete in order, each with its own result."""
    if state["ring"] is None:
        return None
    tensors = [_input(i, state["rank"], numel, torch.float32) for i in range(count)]
    works = [state["ring"].allreduce_async_(t) for t in tensors]
    results = [w.wait() for w in works]
    return [_digest(r) for r in results]


def _collective(state, name: str):
    """The rank's ring, or ``torch.distributed``'s own over the same ranks (``native``)."""
    if name == "ring":
        return state["ring"]
    from ringflow.engine.collective import NativeCollective

    return NativeCollective(
        rank=state["rank"], world_size=state["world_size"], group=state["group"]
    )


def _reduce_scatter(
    state, *, shard: int, dtype: str, op: str, seed: int, into: str, collective: str = "ring"
):
    """Each rank's shard of the reduction against ``torch.distributed.reduce_scatter_tensor``;
    ``into``: ``view`` (the shard of the flat tensor itself), ``tensor`` (one of its own),
    ``async`` (the async form, into a tensor of its own)."""
    import torch.distributed as dist

    if state["ring"] is None:
        return None
    n, rank = state["world_size"], state["rank"]
    x = _input(seed, rank, n * shard, DTYPES[dtype])
    want = torch.empty(shard, dtype=x.dtype)
    dist.reduce_scatter_tensor(want, x.clone(), group=state["group"])
    if op == "avg":
        want /= n
    group = _collective(state, collective)
    flat = x.clone()
    out = flat[rank * shard : (rank + 1) * shard] if into == "view" else torch.empty_like(want)
    if into == "async":
        got = group.reduce_scatter_async_(flat, out=out, op=op).wait()
    else:
        got = group.reduce_scatter_(flat, out=out, op=op)
    return {"equal": torch.equal(got, want) and got is out}


def _all_gather_into(state, *, shard: int, dtype: str, seed: int, into: str, collective: str):
    """Every rank's shard gathered into the flat tensor, against
    ``torch.distributed.all_gather_into_tensor``; ``into`` as for :func:`_reduce_scatter`."""
    import torch.distributed as dist

    if state["ring"] is None:
        return None
    n, rank = state["world_size"], state["rank"]
    mine = _input(seed, rank, shard, DTYPES[dtype])
    want = torch.empty(n * shard, dtype=mine.dtype)
    dist.all_gather_into_tensor(want, mine, group=state["group"])
    group = _collective(state, collective)
    out = torch.full_like(want, float("nan"))
    source = mine
    if into == "view":
        source = out[rank * shard : (rank + 1) * shard]
        source.copy_(mine)
    if into == "async":
        got = group.all_gather_into_async_(source, out=out).wait()
    else:
        got = group.all_gather_into_(source, out=out)
    return {"equal": torch.equal(got, want) and got is out}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


_COMMANDS = {
    "ping": _ping,
    "ring": _make_ring,
    "allreduce": _allreduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "async_many": _async_many,
    "reduce_scatter": _reduce_scatter,
    "all_gather_into": _all_gather_into,
}


# -- the tests ------------------------------------------------------------------------------

_lengths = st.one_of(
    st.integers(0, 12),  # shorter than the ring: empty chunks and segments
    st.integers(0, 2000),
    st.sampled_from([63, 64, 65, 127, 128, 129, 320, 321, 64 * 5 * 3 + 1]),  # segment edges
)


def _check_allreduce(pool, world_size: int, **kwargs) -> None:
    replies = pool.call("allreduce", **kwargs)[:world_size]
    assert all(r["equal"] for r in replies), f"ring != torch.distributed.all_reduce: {kwargs}"
    assert len({r["digest"] for r in replies}) == 1, "ranks hold different results"


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_allreduce_matches_torch_distributed(pool, world_size, transport):
    pool.ring(world_size, transport)

    @settings(max_examples=25, deadline=None, database=None)
    @given(
        numel=_lengths,
        dtype=st.sampled_from(sorted(DTYPES)),
        op=st.sampled_from(["sum", "avg"]),
        seed=st.integers(0, 2**20),
    )
    def check(numel, dtype, op, seed):
        _check_allreduce(pool, world_size, numel=numel, dtype=dtype, op=op, seed=seed)

    check()


@pytest.mark.parametrize(("compression", "transport"), [("bf16", "shm"), ("fp16", "gloo")])
def test_compressed_allreduce_is_exact_when_the_wire_can_hold_the_sums(
    pool, compression, transport
):
    pool.ring(4, transport, compression)  # 4 ranks: the mean, too, is exact in 8 bits
    for numel, op in [(1, "sum"), (1000, "sum"), (777, "avg")]:
        _check_allreduce(pool, 4, numel=numel, dtype="float32", op=op, seed=numel)


def test_non_contiguous_tensors_get_their_result(pool):
    pool.ring(3, "shm")
    _check_allreduce(pool, 3, numel=301, dtype="float32", op="sum", seed=1, strided=True)


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_broadcast_and_all_gather(pool, transport):
    pool.ring(4, transport)
    for numel, src in [(0, 0), (1, 3), (1000, 2)]:
        assert all(pool.call("broadcast", numel=numel, src=src, seed=numel)[:4])
    for numel in (0, 1, 333):
        assert all(pool.call("all_gather", numel=numel, seed=numel)[:4])


def test_async_allreduces_complete_in_order(pool):
    pool.ring(3, "shm")
    replies = pool.call("async_many", count=6, numel=500)[:3]
    assert replies[0] == replies[1] == replies[2]
    assert len(set(replies[0])) == 6


def test_peer_lost_errors_pickle():
    for err in (
        PeerLostError("lost", peer=2, op="allreduce", rank=1),
        CollectiveTimeoutError("late", peer=0, op="broadcast", rank=3),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err)
        assert (back.peer, back.op, back.rank, str(back)) == (err.peer, err.op, err.rank, str(err))
        assert isinstance(back, CollectiveError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_ranks_without_gpu_shared_memory_all_refuse_it_and_none_waits():
    """Every rank publishes what it has before any decides, so a rank that cannot use GPU
    shared memory makes all of them fall back (none left waiting for its answer)."""
    import threading

    import torch.distributed as dist

    from ringflow.engine.collective._symm import symm_unusable

    port = free_port()
    timeout = dt.timedelta(seconds=20)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
    stores = [server, dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)]
    answers: dict[int, str | None] = {}

    def decide(rank: int) -> None:
        answers[rank] = symm_unusable(stores[rank], rank=rank, world_size=2)

    threads = [threading.Thread(target=decide, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert answers[0] == answers[1]
    assert answers[0] is not None
    assert "no CUDA" in answers[0]


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reduce_scatter_and_all_gather_into_match_torch_distributed(pool, world_size, transport):
    pool.ring(world_size, transport)

    @settings(max_examples=15, deadline=None, database=None)
    @given(
        shard=st.one_of(st.integers(0, 5), st.integers(0, 700), st.sampled_from([63, 64, 65])),
        dtype=st.sampled_from(sorted(DTYPES)),
        op=st.sampled_from(["sum", "avg"]),
        seed=st.integers(0, 2**20),
        into=st.sampled_from(["view", "tensor", "async"]),
    )
    def check(shard, dtype, op, seed, into):
        kwargs = {"shard": shard, "dtype": dtype, "seed": seed, "into": into}
        replies = pool.call("reduce_scatter", op=op, **kwargs)[:world_size]
        assert all(r["equal"] for r in replies), f"ring != reduce_scatter_tensor: {kwargs} {op}"
        replies = pool.call("all_gather_into", collective="ring", **kwargs)[:world_size]
        assert all(r["equal"] for r in replies), f"ring != all_gather_into_tensor: {kwargs}"

    check()


def test_compressed_reduce_scatter_sums_in_float32(pool):
    pool.ring(4, "shm", "bf16")  # quarter-integers and their sums fit bf16: exact
    for shard, op in [(1, "sum"), (250, "sum"), (199, "avg")]:
        replies = pool.call(
            "reduce_scatter", shard=shard, dtype="float32", op=op, seed=shard, into="tensor"
        )[:4]
        assert all(r["equal"] for r in replies)


@pytest.mark.parametrize("into", ["view", "tensor", "async"])
def test_native_reduce_scatter_and_all_gather_into(pool, into):
    pool.ring(3, "shm")
    for shard, op in [(0, "sum"), (1, "avg"), (257, "sum"), (100, "avg")]:
        kwargs = {"shard": shard, "dtype": "float32", "seed": shard, "into": into}
        got = pool.call("reduce_scatter", op=op, collective="native", **kwargs)[:3]
        assert all(r["equal"] for r in got)
        got = pool.call("all_gather_into", collective="native", **kwargs)[:3]
        assert all(r["equal"] for r in got)


def test_shards_that_do_not_partition_the_flat_tensor_are_refused_before_any_send():
    from ringflow.engine.collective import RingCollective

    ring = RingCollective(rank=0, world_size=1)
    with pytest.raises(ValueError, match="pad it to"):
        ring.reduce_scatter_(torch.zeros(5), out=torch.zeros(4))
    with pytest.raises(ValueError, match="one dtype"):
        ring.all_gather_into_(torch.zeros(2, dtype=torch.float64), out=torch.zeros(2))
