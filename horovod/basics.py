"""The ranks and the ring under ``ringflow.horovod``: ``init`` and what it knows."""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass
from typing import Any

from ringflow.engine.errors import CollectiveError
from ringflow.horovod.membership import SOCKET, ask
from ringflow.horovod.timeline import TIMELINE, TimedRing

__all__ = [
    "Average",
    "HorovodError",
    "HorovodInternalError",
    "Max",
    "Min",
    "Product",
    "Sum",
    "cross_rank",
    "cross_size",
    "is_initialized",
    "join_ring",
    "leave_ring",
    "local_rank",
    "local_size",
    "rank",
    "ring",
    "size",
]

Average, Sum = "avg", "sum"
"""Horovod's reduction ops, as ringflow's ring spells them (``op=hvd.Average``)."""
Min, Max, Product = "min", "max", "product"
"""Horovod's elementwise reductions: every rank's tensor gathered, then reduced on each rank."""
OPS = (Average, Sum, Min, Max, Product)

VARIABLES = {
    "rank": "RINGFLOW_HOROVOD_RANK",
    "size": "RINGFLOW_HOROVOD_SIZE",
    "local_rank": "RINGFLOW_HOROVOD_LOCAL_RANK",
    "local_size": "RINGFLOW_HOROVOD_LOCAL_SIZE",
    "cross_rank": "RINGFLOW_HOROVOD_CROSS_RANK",
    "cross_size": "RINGFLOW_HOROVOD_CROSS_SIZE",
    "address": "RINGFLOW_HOROVOD_ADDRESS",
    "timeout_s": "RINGFLOW_HOROVOD_TIMEOUT_S",
    "job": "RINGFLOW_HOROVOD_JOB",
}
"""What the launcher (:func:`ringflow.horovod.run`) tells each rank, by variable: its place
among the ranks, rank 0's rendezvous, every collective's deadline and the run's own token
(a rank joins only a rendezvous of its own run)."""


class HorovodError(RuntimeError):
    """What a Horovod script asked for that ringflow.horovod cannot do, or did before ``init``."""


HorovodInternalError = CollectiveError
"""What a collective raises when a rank died or missed its deadline (Horovod's name for
ringflow's :class:`~ringflow.engine.errors.CollectiveError`, ``PeerLostError`` among them):
``@hvd.elastic.run`` rolls back to the last commit on it and goes on with the ranks left."""


@dataclass(frozen=True)
class _Ranks:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    address: str
    timeout_s: float
    generation: int = 0
    job: str = ""


_ranks: _Ranks | None = None
_ring: Any = None
_generation = 0  # the last generation of an elastic run this process was a rank of
_rendezvous: dict[str, Any] = {}  # this process's store at the run's address (rank 0 hosts it)
_rings_formed: dict[str, int] = {}  # rings formed at each address: each init has its own keys
_init_store: Any = None  # this init's keys in the rendezvous (process sets form rings under it)
_scope = threading.local()
"""The process set a collective runs in on this thread (``scope.set``): ``ring``, ``rank``
and ``size`` are then its own (``ringflow.horovod.process_sets.within``)."""


def join_ring() -> bool:
    """Join the ring of this run's ranks (one rank of one without the launcher); whether it
    joined (``False``: it is in one already). ``hvd.init`` (``ringflow.horovod.lifecycle``)
    calls it, then adds the process sets."""
    global _ranks, _ring, _generation, _init_store
    if _ranks is not None:
        return False
    ranks = _from_membership() if SOCKET in os.environ else _from_environment()
    _generation = ranks.generation
    from ringflow.engine.collective.ring import RingCollective

    _init_store = _store_for(ranks)
    _ring = RingCollective(
        rank=ranks.rank,
        world_size=ranks.size,
        store=_init_store,
        timeout_s=ranks.timeout_s,
    )
    if os.environ.get(TIMELINE):
        _ring = TimedRing(_ring, ranks.rank, os.environ[TIMELINE], ranks.generation)
    _ranks = ranks
    atexit.unregister(_at_exit)  # registered once, however often init is called
    atexit.register(_at_exit)
    return True


def _from_environment() -> _Ranks:
    def number(key: str, default: str) -> int:
        value = os.environ.get(VARIABLES[key], default)
        if not value.isdigit():
            raise HorovodError(f"{VARIABLES[key]} must be a whole number, got {value!r}")
        return int(value)

    size, rank = number("size", "1"), number("rank", "0")
    if not 0 <= rank < size:
        raise HorovodError(f"the rank ({rank}) must be below the number of ranks ({size})")
    address = os.environ.get(VARIABLES["address"], "")
    if size > 1 and not address:
        raise HorovodError(
            f"{size} ranks but no rendezvous address for rank 0: start the script with "
            "ringflow.horovod.run"
        )
    return _Ranks(
        rank=rank,
        size=size,
        local_rank=number("local_rank", str(rank)),
        local_size=number("local_size", str(size)),
        cross_rank=number("cross_rank", "0"),
        cross_size=number("cross_size", "1"),
        address=address,
        timeout_s=float(os.environ.get(VARIABLES["timeout_s"], "30")),
        job=os.environ.get(VARIABLES["job"], ""),
    )


def _from_membership() -> _Ranks:
    """This worker's place in the next generation of an elastic run (waits for it)."""
    place = ask({"op": "join", "after": _generation})
    return _Ranks(
        **{
            key: place[key]
            for key in _Ranks.__dataclass_fields__
            if key not in ("timeout_s", "job")
        },
        timeout_s=float(os.environ.get(VARIABLES["timeout_s"], "30")),
        job=os.environ.get(VARIABLES["job"], ""),
    )


def _store_for(ranks: _Ranks) -> Any:
    """The keys this init's ring forms under, in the run's rendezvous store.

    The store is opened once per address and kept for the process's life, as ``horovodrun``'s
    rendezvous server lives for the job: rank 0 never gives up the address while its ranks
    may re-init, so neither a stale store nor another run can take it in between. Each init
    forms its ring under keys of its own (the ranks init in step, as Horovod's do).

    Raises:
        HorovodError: the store at the address is another run's.
    """
    if ranks.size == 1:
        return None
    import torch.distributed as dist

    from ringflow.engine.collective._rendezvous import open_store

    for address in [a for a in _rendezvous if a != ranks.address]:  # an elastic run's last
        del _rendezvous[address], _rings_formed[address]
    if ranks.address not in _rendezvous:
        store = open_store(
            ranks.address,
            rank=ranks.rank,
            world_size=ranks.size,
            timeout_s=max(60.0, ranks.timeout_s),
        )
        _check_run(store, ranks)
        _rendezvous[ranks.address], _rings_formed[ranks.address] = store, 0
    _rings_formed[ranks.address] += 1
    return dist.PrefixStore(f"init-{_rings_formed[ranks.address]}", _rendezvous[ranks.address])


def _check_run(store: Any, ranks: _Ranks) -> None:
    """Rank 0 marks its store with the run's token; every other rank checks the mark."""
    if ranks.rank == 0:
        store.set("run", ranks.job)
        return
    theirs = store.get("run").decode()
    if theirs != ranks.job:
        raise HorovodError(
            f"the rendezvous at {ranks.address} belongs to another run: start every rank with "
            "the same ringflow-run (or ringflow.horovod.run)"
        )


def worker_waiting(*, committed: bool = False) -> bool:
    """On rank 0 of an elastic run, whether a worker waits to join its ranks (``False`` on
    every other rank and outside one: ``hvd.elastic`` broadcasts rank 0's answer);
    ``committed``: asked at a commit, which the run counts as its step."""
    known = _known()
    if known.rank != 0 or SOCKET not in os.environ:
        return False
    request = {"op": "updated", "generation": known.generation, "committed": committed}
    return bool(ask(request))


def _at_exit() -> None:
    """A script need not call ``shutdown``: its timeline is written at exit anyway. The ring
    stays open until the process ends, so the others see this rank's exit, not a shutdown
    racing it (the launcher reports the rank that exited first)."""
    if isinstance(_ring, TimedRing):
        _ring.write()


def run_ring() -> Any:
    """The ring of this run's ranks (outside any process set)."""
    _known()
    return _ring


def replace_ring(ring: Any) -> None:
    """Put ``ring`` in place of this run's ring (the timeline times the ring it wraps)."""
    global _ring
    _known()
    _ring = ring


def leave_ring() -> None:
    """Leave the ring: its connections, shared memory and thread are released (after the
    process sets' rings, by ``hvd.shutdown``); ``join_ring`` forms a new ring of the same
    ranks."""
    global _ranks, _ring, _init_store
    if _ring is not None:
        _ring.close()
    _ranks, _ring, _init_store = None, None, None


def is_initialized() -> bool:
    return _ranks is not None


def _known() -> _Ranks:
    if _ranks is None:
        raise HorovodError("ringflow.horovod is not initialized: call hvd.init() first")
    return _ranks


def ring() -> Any:
    """The ring the collectives run over (``engine.collective.RingCollective``): the process
    set's where a collective runs in one."""
    _known()
    process_set = getattr(_scope, "set", None)
    return _ring if process_set is None else process_set.ring


def rank() -> int:
    process_set = getattr(_scope, "set", None)
    return _known().rank if process_set is None else process_set.rank()


def size() -> int:
    process_set = getattr(_scope, "set", None)
    return _known().size if process_set is None else process_set.size()


def local_rank() -> int:
    return _known().local_rank


def local_size() -> int:
    return _known().local_size


def cross_rank() -> int:
    return _known().cross_rank


def cross_size() -> int:
    return _known().cross_size
