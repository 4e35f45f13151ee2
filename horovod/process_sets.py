"""Horovod's process sets: a subset of the ranks whose collectives run on a ring of their own.

``add_process_set`` is called by every rank, in the same order (as Horovod's with
``HOROVOD_DYNAMIC_PROCESS_SETS``); the ranks of the set then form its ring, under this init's
keys of the run's rendezvous. A collective given ``process_set=`` runs within it: its ranks
and size are the set's, and only the set's ranks call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import wraps
from typing import Any

from ringflow.horovod import basics
from ringflow.horovod.basics import HorovodError

__all__ = [
    "ProcessSet",
    "add_process_set",
    "global_process_set",
    "in_process_set",
    "remove_process_set",
    "within",
]


class ProcessSet:
    """Some of the run's ranks (``ranks``, global ranks); registered by
    :func:`add_process_set`, which gives it ``process_set_id`` and, on its ranks, a ring."""

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        ranks = ranks_or_comm if isinstance(ranks_or_comm, list | tuple | range | set) else None
        if ranks is None or not all(isinstance(r, int) for r in ranks):
            raise HorovodError("ProcessSet takes a list of ranks: MPI communicators are refused")
        self._ranks = sorted(set(ranks))
        self.process_set_id: int | None = None
        self.ring: Any = None

    @property
    def ranks(self) -> list[int]:
        return self._ranks

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 outside it)."""
        me = basics._known().rank
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool:
        return basics._known().rank in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of the run (Horovod's ``global_process_set``, id 0)."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self) -> list[int]:
        return list(range(basics._known().size))


global_process_set = _GlobalProcessSet()
_added: dict[int, ProcessSet] = {}


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register ``process_set`` (or a list of ranks) on every rank, in the same order; its
    ranks form its ring. Returns the registered set.

    Raises:
        ValueError: a rank is not one of the run's, or a set of the same ranks exists.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    known = basics._known()
    if not process_set.ranks or not all(0 <= r < known.size for r in process_set.ranks):
        raise ValueError(f"a process set takes ranks of 0 to {known.size - 1}, got {process_set}")
    if any(s.ranks == process_set.ranks for s in _added.values()):
        raise ValueError(f"a process set of the ranks {process_set.ranks} exists already")
    process_set.process_set_id = max(_added, default=0) + 1
    _added[process_set.process_set_id] = process_set
    if process_set.included():
        process_set.ring = _ring_of(process_set, known)
    return process_set


def _ring_of(process_set: ProcessSet, known: Any) -> Any:
    import torch.distributed as dist

    from ringflow.engine.collective.ring import RingCollective

    store = None
    if process_set.size() > 1:
        store = dist.PrefixStore(f"set-{process_set.process_set_id}", basics._init_store)
    return RingCollective(
        rank=process_set.rank(),
        world_size=process_set.size(),
        store=store,
        timeout_s=known.timeout_s,
    )


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` and close its ring; whether it was registered."""
    if _added.pop(process_set.process_set_id or 0, None) is None:
        return False
    if process_set.ring is not None:
        process_set.ring.close()
    process_set.ring, process_set.process_set_id = None, None
    return True


def remove_every_process_set() -> None:
    """At ``shutdown``: every set's ring is closed (``init`` starts with none)."""
    for process_set in list(_added.values()):
        remove_process_set(process_set)


@contextlib.contextmanager
def within(process_set: ProcessSet | None) -> Iterator[None]:
    """Collectives on this thread run in ``process_set`` (the whole run's for ``None`` or
    the global set).

    Raises:
        ValueError: ``process_set`` is not registered, or this rank is not one of its ranks.
    """
    if process_set is None or process_set.process_set_id == 0:
        yield
        return
    if process_set.process_set_id not in _added:
        raise ValueError(f"{process_set} is not registered: call hvd.add_process_set first")
    if process_set.ring is None:
        raise ValueError(f"rank {basics._known().rank} is not one of {process_set}")
    before = getattr(basics._scope, "set", None)
    basics._scope.set = process_set
    try:
        yield
    finally:
        basics._scope.set = before


def current() -> ProcessSet | None:
    """The process set collectives on this thread run in (``None``: the whole run)."""
    return getattr(basics._scope, "set", None)


def in_process_set(collective: Callable[..., Any]) -> Callable[..., Any]:
    """``collective`` takes Horovod's ``process_set=`` keyword and runs within that set."""

    @wraps(collective)
    def run(*args: Any, process_set: ProcessSet | None = None, **kwargs: Any) -> Any:
        with within(process_set):
            return collective(*args, **kwargs)

    return run
