"""Horovod's PyTorch API on ringflow's ring: ``import ringflow.horovod as hvd`` in place of
``import horovod.torch as hvd``.

A script written for Horovod runs unchanged apart from that import, started by
:func:`ringflow.horovod.run` (``horovod.run``'s form: each rank a Ray actor, on a local Ray or
the cluster ``RAY_ADDRESS`` names). Its collectives travel over ringflow's ring (the same
transports, deadlines and typed errors as ``engine.fit``: a dead peer is a
``PeerLostError`` within ``collective_timeout_s``, not a hang). Run without the launcher a
script is one rank of one, as under Horovod.

What Horovod has and ringflow does not (TensorFlow, Keras, MXNet, MPI, Adasum)
raises a one-line error naming it; Horovod's build queries answer for ringflow's ring.
"""

from __future__ import annotations

from ringflow.horovod import checkpoint, elastic
from ringflow.horovod.basics import (
    Average,
    HorovodError,
    HorovodInternalError,
    Max,
    Min,
    Product,
    Sum,
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from ringflow.horovod.build import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from ringflow.horovod.collectives import (
    allgather_async,
    allgather_object,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_parameters,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from ringflow.horovod.differentiable import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from ringflow.horovod.elastic import HostsUpdatedInterrupt
from ringflow.horovod.lifecycle import init, shutdown
from ringflow.horovod.optimizer import (
    Compression,
    DistributedOptimizer,
    broadcast_optimizer_state,
)
from ringflow.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from ringflow.horovod.recording import start_timeline, stop_timeline
from ringflow.horovod.runner import RankFailedError, run
from ringflow.horovod.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "RankFailedError",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "checkpoint",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "run",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]

_LEFT_OUT = {"Adasum": "Adasum reduction"}


def __getattr__(name: str):
    if name in _LEFT_OUT:
        raise HorovodError(f"ringflow.horovod has no {name}: {_LEFT_OUT[name]} is not supported")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
