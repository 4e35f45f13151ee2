"""Collectives the engine averages gradients with, chosen by name.

``native`` wraps ``torch.distributed``; ``ring`` is our pipelined ring (shared memory between
ranks on one host, gloo or NCCL otherwise), with deadlines on every collective.
``GradientBuckets`` fuses gradients into buckets reduced while backward still runs.
"""

from ringflow.engine.collective.base import (
    COMPRESSIONS,
    ENVIRONMENT_KNOBS,
    Collective,
    CollectiveWork,
    ReduceOp,
    available_collectives,
    create_collective,
    environment_overrides,
    register_collective,
    shard_numel,
    shard_of,
)
from ringflow.engine.collective.buckets import GradientBuckets
from ringflow.engine.collective.hooks import GradBucket, allreduce_hook, register_comm_hook
from ringflow.engine.collective.native import NativeCollective
from ringflow.engine.collective.ring import TRANSPORTS, RingCollective
from ringflow.engine.errors import CollectiveError, CollectiveTimeoutError, PeerLostError

__all__ = [
    "COMPRESSIONS",
    "ENVIRONMENT_KNOBS",
    "TRANSPORTS",
    "Collective",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CollectiveWork",
    "GradBucket",
    "GradientBuckets",
    "NativeCollective",
    "PeerLostError",
    "ReduceOp",
    "RingCollective",
    "allreduce_hook",
    "available_collectives",
    "create_collective",
    "environment_overrides",
    "register_collective",
    "register_comm_hook",
    "shard_numel",
    "shard_of",
]
