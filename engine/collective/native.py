"""``torch.distributed``'s own collectives (gloo on CPU, NCCL on GPU), as the baseline."""

from __future__ import annotations

import datetime as dt

import torch
import torch.distributed as dist

from ringflow.engine.collective.base import (
    Collective,
    CollectiveWork,
    CompletedWork,
    ReduceOp,
    check_reduce_op,
    check_shards,
    register_collective,
    shard_of,
    wire_dtype,
)
from ringflow.engine.errors import PeerLostError

__all__ = ["NativeCollective"]


@register_collective("native")
class NativeCollective(Collective):
    """Joins the default ``torch.distributed`` process group through a TCP rendezvous.

    Args:
        rank: this process's rank.
        world_size: number of ranks.
        init_method: ``tcp://host:port`` of rank 0's rendezvous; unused for one rank.
        backend: ``gloo`` or ``nccl``.
        timeout_s: how long a collective may wait for its peers.
        connect_timeout_s: how long joining may wait for every rank (default ``timeout_s``).
        compression: ``none``, ``bf16`` or ``fp16``: float32 all-reduces travel (and are
            summed) in that dtype, like DDP's compression hooks.
        group: a process group of exactly these ranks to run over instead of joining the
            default one (a pipeline's stages on GPUs share one default group).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        init_method: str = "",
        backend: str = "gloo",
        timeout_s: float = 60.0,
        connect_timeout_s: float | None = None,
        compression: str = "none",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size)
        self._wire = wire_dtype(compression)
        # NCCL averages as it reduces; gloo has no average, so its sums are divided after.
        self._averages = (group is not None and dist.get_backend(group) == "nccl") or (
            group is None and backend == "nccl"
        )
        self._group, self._owns_group = group, group is None
        if group is None and world_size > 1:
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=dt.timedelta(seconds=connect_timeout_s or timeout_s),
            )
            self._group = dist.group.WORLD
            # Joining may wait for slow starters; a collective waits only timeout_s.
            dist.distributed_c10d._set_pg_timeout(dt.timedelta(seconds=timeout_s), self._group)

    def allreduce_async_(self, tensor: torch.Tensor, *, op: ReduceOp = "sum") -> CollectiveWork:
        check_reduce_op(op, tensor)
        if self._group is None:
            return CompletedWork(tensor)
        wire = self._wire if tensor.dtype == torch.float32 else None
        buffer = tensor if wire is None else tensor.to(wire)
        average = op == "avg" and self._averages
        reduce = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        work = dist.all_reduce(buffer, op=reduce, group=self._group, async_op=True)
        divisor = self.world_size if op == "avg" and not average else 1
        return _NativeWork(work, tensor=tensor, buffer=buffer, divisor=divisor)

    def reduce_scatter_async_(
        self, tensor: torch.Tensor, *, out: torch.Tensor, op: ReduceOp = "sum"
    ) -> CollectiveWork:
        """``torch.distributed``'s reduce-scatter (gloo sums, then divides for ``avg``)."""
        check_shards(tensor, out, self.world_size, what="tensor")
        check_reduce_op(op, tensor)
        if self._group is None:
            if out.data_ptr() != tensor.data_ptr():
                out.view(-1).copy_(tensor.view(-1))
            return CompletedWork(out)
        wire = self._wire if tensor.dtype == torch.float32 else None
        source = tensor.view(-1) if wire is None else tensor.view(-1).to(wire)
        mine = shard_of(tensor, self.rank, self.world_size)
        overlaps = wire is None and mine.data_ptr() == out.data_ptr()
        buffer = out if wire is None and not overlaps else mine.to(source.dtype)
        average = op == "avg" and self._averages
        reduce = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        work = _REDUCE_SCATTER(buffer.view(-1), source, op=reduce, group=self._group, async_op=True)
        divisor = self.world_size if op == "avg" and not average else 1
        return _NativeWork(work, tensor=out, buffer=buffer, divisor=divisor, op="reduce_scatter")

    def all_gather_into_async_(self, shard: torch.Tensor, *, out: torch.Tensor) -> CollectiveWork:
        check_shards(out, shard, self.world_size, what="out")
        if self._group is None:
            if out.data_ptr() != shard.data_ptr():
                out.view(-1).copy_(shard.view(-1))
            return CompletedWork(out)
        mine = shard_of(out, self.rank, self.world_size)
        source = shard.clone() if mine.data_ptr() == shard.data_ptr() else shard
        work = _ALL_GATHER(out.view(-1), source.view(-1), group=self._group, async_op=True)
        return _NativeWork(work, tensor=out, buffer=out, divisor=1, op="all_gather")

    def broadcast_(self, tensor: torch.Tensor, *, src: int = 0) -> torch.Tensor:
        if self._group is not None:
            dist.broadcast(tensor, group_src=src, group=self._group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self._group is None:
            return [tensor.clone()]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self._group)
        return out

    def close(self) -> None:
        if self._owns_group and self._group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self._group = None


_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""The flat-tensor forms, by their names in this torch (older ones lack ``*_single``)."""


class _NativeWork(CollectiveWork):
    """An async ``torch.distributed`` collective; the result lands in ``tensor`` when waited
    for."""

    def __init__(
        self,
        work: dist.Work,
        *,
        tensor: torch.Tensor,
        buffer: torch.Tensor,
        divisor: int,
        op: str = "allreduce",
    ) -> None:
        self._work, self._tensor, self._buffer, self._divisor = work, tensor, buffer, divisor
        self._op = op
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            try:
                self._work.wait()
            except RuntimeError as err:
                raise PeerLostError(
                    f"native {self._op} failed: {err}", peer=None, op=self._op
                ) from err
            if self._divisor != 1:
                self._buffer.div_(self._divisor)
            if self._buffer is not self._tensor:
                self._tensor.copy_(self._buffer.view_as(self._tensor))
            self._done = True
        return self._tensor

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()
