"""Horovod's PyTorch API on ringflow's ring: ``import ringflow.horovod as hvd`` in place of
``import horovod.torch as hvd``.

A script written for Horovod runs unchanged apart from that import, started by
:func:`ringflow.horovod.run` (``horovod.run``'s form: each rank a Ray actor, on a local Ray or
the cluster ``RAY_ADDRESS`` names). Its collectives travel over ringflow's ring (the same
transports, deadlines and typed errors as ``engine.fit``: a dead peer is a
``PeerLostError`` within ``collective_timeout_s``, not a hang). Run without the launcher a
script is one rank of one, as under Horovod.

What Horovod has and ringflow does not (TensorFlow, Keras, MXNet, MPI, Adasum, process sets,
reductions other than sum and average) raises a one-line error naming it.
"""

from __future__ import annotations

from ringflow.horovod import checkpoint, elastic
from ringflow.horovod.basics import (
    Average,
    HorovodError,
    HorovodInternalError,
    Sum,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from ringflow.horovod.collectives import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
    poll,
    reducescatter,
    synchronize,
)
from ringflow.horovod.elastic import HostsUpdatedInterrupt
from ringflow.horovod.optimizer import Compression, DistributedOptimizer
from ringflow.horovod.runner import RankFailedError, run
from ringflow.horovod.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "RankFailedError",
    "Sum",
    "SyncBatchNorm",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "checkpoint",
    "cross_rank",
    "cross_size",
    "elastic",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "poll",
    "rank",
    "reducescatter",
    "run",
    "shutdown",
    "size",
    "synchronize",
]

_LEFT_OUT = {
    "Adasum": "Adasum reduction",
    "Min": "a min reduction (ringflow's ring sums and averages)",
    "Max": "a max reduction (ringflow's ring sums and averages)",
    "Product": "a product reduction (ringflow's ring sums and averages)",
    "ProcessSet": "process sets",
    "add_process_set": "process sets",
    "remove_process_set": "process sets",
    "global_process_set": "process sets",
    "mpi_threads_supported": "MPI",
    "mpi_enabled": "MPI",
    "mpi_built": "MPI",
    "gloo_enabled": "Horovod's gloo controller (ringflow has its own rendezvous)",
    "nccl_built": "Horovod's NCCL build flag (ringflow's ring uses NCCL on GPUs by itself)",
}


def __getattr__(name: str):
    if name in _LEFT_OUT:
        raise HorovodError(f"ringflow.horovod has no {name}: {_LEFT_OUT[name]} is not supported")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
