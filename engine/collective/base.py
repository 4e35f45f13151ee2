"""The interface every collective implements (the registry that names them is
``engine.collective.registry``, re-exported here)."""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Literal

import torch

from ringflow.engine.collective.registry import (
    available_collectives,
    create_collective,
    register_collective,
)
from ringflow.engine.config import WIRE_FORMATS, SymmConfig

__all__ = [
    "COMPRESSIONS",
    "ENVIRONMENT_KNOBS",
    "Collective",
    "CollectiveWork",
    "CompletedWork",
    "ReduceOp",
    "check_reduce_op",
    "available_collectives",
    "create_collective",
    "environment_overrides",
    "register_collective",
    "check_shards",
    "shard_numel",
    "shard_of",
    "wire_dtype",
]

ReduceOp = Literal["sum", "avg"]

COMPRESSIONS: dict[str, torch.dtype | None] = dict(
    zip(WIRE_FORMATS, (None, torch.bfloat16, torch.float16), strict=True)
)
"""Wire formats for float32 all-reduces (``none``, ``bf16``, ``fp16``: the names
``TrainConfig.compression`` takes) and the dtype each travels as."""


class CollectiveWork:
    """A collective in flight. ``wait()`` returns its result, or raises what it raised.

    For CUDA tensors, as with ``torch.distributed``'s own works, the result is ready in the
    order of the caller's current stream once ``wait()`` returns; the host need not block.
    """

    def wait(self) -> torch.Tensor:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError


class CompletedWork(CollectiveWork):
    """The work of a collective that completed before it was returned."""

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result

    def is_completed(self) -> bool:
        return True


class Collective(abc.ABC):
    """Collective operations over a fixed group of ``world_size`` ranks.

    Implementations are created on every rank with the same arguments and must be called in
    the same order on every rank. Every implementation accepts the keyword arguments
    ``rank``, ``world_size``, ``init_method``, ``timeout_s``, ``connect_timeout_s`` and
    ``compression``, so the engine can create any of them by name.
    """

    def __init__(self, *, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size

    @abc.abstractmethod
    def allreduce_async_(self, tensor: torch.Tensor, *, op: ReduceOp = "sum") -> CollectiveWork:
        """Start replacing ``tensor`` on every rank by its sum (or mean) over all ranks.

        ``tensor`` must not be touched until the returned work's ``wait()`` returns.
        """

    @abc.abstractmethod
    def broadcast_(self, tensor: torch.Tensor, *, src: int = 0) -> torch.Tensor:
        """Replace ``tensor`` on every rank by rank ``src``'s; return it."""

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on all ranks), in rank order."""

    def reduce_scatter_async_(
        self, tensor: torch.Tensor, *, out: torch.Tensor, op: ReduceOp = "sum"
    ) -> CollectiveWork:
        """Start reducing the flat ``tensor`` over all ranks into ``out``, this rank's shard.

        ``tensor`` (contiguous, ``world_size * out.numel()`` elements: pad it, see
        :func:`shard_numel`) is cut into ``world_size`` contiguous shards; rank ``r``'s
        ``out`` receives the sum (or mean) of shard ``r``, as ``torch.distributed``'s
        ``reduce_scatter_tensor``. ``out`` may be a view of that shard of ``tensor``. The
        rest of ``tensor`` is scratch: neither may be touched until ``wait()`` returns.

        This default all-reduces ``tensor`` whole; implementations move only the shards.
        """
        check_shards(tensor, out, self.world_size, what="tensor")
        check_reduce_op(op, tensor)
        work = self.allreduce_async_(tensor, op=op)
        return _ShardOf(work, tensor=tensor, out=out, rank=self.rank, world_size=self.world_size)

    def reduce_scatter_(
        self, tensor: torch.Tensor, *, out: torch.Tensor, op: ReduceOp = "sum"
    ) -> torch.Tensor:
        """:meth:`reduce_scatter_async_`, waited for; returns ``out``."""
        return self.reduce_scatter_async_(tensor, out=out, op=op).wait()

    def all_gather_into_async_(self, shard: torch.Tensor, *, out: torch.Tensor) -> CollectiveWork:
        """Start gathering every rank's ``shard`` into the flat ``out``, in rank order.

        ``out`` (contiguous, ``world_size * shard.numel()`` elements) receives rank ``r``'s
        ``shard`` as its ``r``-th contiguous shard, as ``torch.distributed``'s
        ``all_gather_into_tensor``; ``shard`` may be a view of this rank's shard of ``out``.

        This default gathers through :meth:`all_gather`; implementations override it.
        """
        check_shards(out, shard, self.world_size, what="out")
        gathered = [part.clone() for part in self.all_gather(shard.view(-1))]
        for rank, part in enumerate(gathered):
            shard_of(out, rank, self.world_size).copy_(part)
        return CompletedWork(out)

    def all_gather_into_(self, shard: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        """:meth:`all_gather_into_async_`, waited for; returns ``out``."""
        return self.all_gather_into_async_(shard, out=out).wait()

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed flat tensor this collective all-reduces again and again (a gradient
        bucket); an implementation may place it where it reduces fastest. Collective: every
        rank asks for the same tensors in the same order."""
        return torch.zeros(numel, dtype=dtype, device=device)

    def allreduce_(self, tensor: torch.Tensor, *, op: ReduceOp = "sum") -> torch.Tensor:
        """Replace ``tensor`` on every rank by its sum (or mean) over all ranks; return it."""
        return self.allreduce_async_(tensor, op=op).wait()

    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` on every rank by the sum over all ranks; return it."""
        return self.allreduce_(tensor, op="sum")

    def check(self) -> None:
        """Raise the failure of a collective whose ``wait`` already returned.

        On GPUs ``wait`` only orders the caller's stream after the collective: the host goes
        on, and a collective may pass its deadline (its kernels then aborted, its sums
        meaningless) afterwards. Called once the device finished everything waited for, this
        raises what such a collective found (``PeerLostError``); nothing otherwise.
        """
        return None

    def close(self) -> None:
        """Release the group's resources. Safe to call twice."""
        return None


class _ShardOf(CollectiveWork):
    """An all-reduce of which only this rank's shard is wanted, copied into ``out``."""

    def __init__(
        self,
        work: CollectiveWork,
        *,
        tensor: torch.Tensor,
        out: torch.Tensor,
        rank: int,
        world_size: int,
    ) -> None:
        self._work, self._out = work, out
        self._mine = shard_of(tensor, rank, world_size)

    def wait(self) -> torch.Tensor:
        self._work.wait()
        if self._mine.data_ptr() != self._out.data_ptr():
            self._out.view(-1).copy_(self._mine)
        return self._out

    def is_completed(self) -> bool:
        return self._work.is_completed()


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of each of ``world_size`` equal shards of ``numel`` elements, padded: a flat
    buffer of ``world_size * shard_numel(...)`` elements takes a reduce-scatter."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    return -(-numel // world_size)


def shard_of(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous shard of the flat ``flat`` (a view)."""
    size = flat.numel() // world_size
    return flat.view(-1)[rank * size : (rank + 1) * size]


def check_shards(flat: torch.Tensor, shard: torch.Tensor, world_size: int, *, what: str) -> None:
    """Refuse a flat buffer and shard that do not partition, before any rank starts."""
    if not flat.is_contiguous() or not shard.is_contiguous():
        raise ValueError(f"{what} and its shard must be contiguous")
    if flat.dtype != shard.dtype or flat.device != shard.device:
        raise ValueError(
            f"{what} ({flat.dtype}, {flat.device}) and its shard ({shard.dtype}, "
            f"{shard.device}) must have one dtype and device"
        )
    if flat.numel() != world_size * shard.numel():
        raise ValueError(
            f"{what} has {flat.numel()} elements, not world_size ({world_size}) x the shard's "
            f"{shard.numel()}: pad it to {world_size} x shard_numel(numel, world_size)"
        )


def wire_dtype(compression: str) -> torch.dtype | None:
    """The dtype float32 all-reduces travel in for ``compression``; ``None`` for ``"none"``.

    Raises:
        ValueError: unknown ``compression``; the message lists the known ones.
    """
    try:
        return COMPRESSIONS[compression]
    except KeyError:
        raise ValueError(
            f"compression must be one of {sorted(COMPRESSIONS)}, got {compression!r}"
        ) from None


def check_reduce_op(op: str, tensor: torch.Tensor) -> None:
    """Refuse an op the tensor's dtype cannot take, before any rank starts sending."""
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if op == "avg" and not tensor.is_floating_point():
        raise ValueError(f"op 'avg' needs a floating-point tensor, got {tensor.dtype}")


ENVIRONMENT_KNOBS = tuple(SymmConfig.variable(f.name) for f in dataclasses.fields(SymmConfig))
"""The environment variables that override ``SymmConfig``'s fields where they are set: how
the ring's GPU transport runs (``engine.collective._symm``, ``engine.collective._fused``)."""


def environment_overrides() -> dict[str, str]:
    """Those of :data:`ENVIRONMENT_KNOBS` set in this process: a run records what its workers
    had (``engine.trainer``), since each changes how the gradients are reduced."""
    return {name: os.environ[name] for name in ENVIRONMENT_KNOBS if name in os.environ}
