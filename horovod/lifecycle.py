"""``hvd.init`` and ``hvd.shutdown``: a rank joins its run's ring, then its process sets'
rings (``ringflow.horovod.process_sets``), and leaves them in the other order."""

from __future__ import annotations

from typing import Any

from ringflow.horovod import basics, coordinator
from ringflow.horovod.basics import HorovodError
from ringflow.horovod.process_sets import add_process_set, remove_every_process_set

__all__ = ["init", "shutdown"]


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the ring of this run's ranks (one rank of one without the launcher), and add
    ``process_sets`` (each a ``ProcessSet`` or a list of ranks). Safe to call again; an MPI
    ``comm`` is refused."""
    if comm is not None:
        raise HorovodError("ringflow.horovod.init takes no MPI communicator: MPI is not supported")
    if basics.join_ring():
        for process_set in process_sets or ():
            add_process_set(process_set)


def shutdown() -> None:
    """Leave the ring and every process set's: their connections, shared memory and threads
    are released; ``init`` forms a new ring of the same ranks. Operations still waiting for
    other ranks fail."""
    coordinator.forget()
    remove_every_process_set()
    basics.leave_ring()
