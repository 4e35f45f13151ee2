"""``torch.distributed``'s own collectives (gloo on CPU, NCCL on GPU), as the baseline."""

from __future__ import annotations

import datetime as dt

import torch
import torch.distributed as dist

from engine.collective.base import Collective, register_collective

__all__ = ["NativeCollective"]


@register_collective("native")
class NativeCollective(Collective):
    """Joins a ``torch.distributed`` process group through a TCP rendezvous.

    Args:
        rank: this process's rank.
        world_size: number of ranks.
        init_method: ``tcp://host:port`` of rank 0's rendezvous; unused for one rank.
        backend: ``gloo`` or ``nccl``.
        timeout_s: how long a collective may wait for its peers.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        init_method: str = "",
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size)
        self._group = None
        if world_size > 1:
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=dt.timedelta(seconds=timeout_s),
            )
            self._group = dist.group.WORLD

    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._group is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, *, src: int = 0) -> torch.Tensor:
        if self._group is not None:
            dist.broadcast(tensor, src=src)
        return tensor

    def close(self) -> None:
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self._group = None
