"""Horovod's ``hvd.SyncBatchNorm``: batch normalisation over the batch of every rank.

The statistics and gradients are ``engine.sync_batchnorm``'s (the engine's
``sync_batchnorm=True``), summed over Horovod's ring. Unlike torch's, it normalises with every
rank's statistics whenever it uses batch statistics (also in evaluation without running
statistics), as Horovod's does; unlike Horovod's, it also runs on CPU tensors.
"""

from __future__ import annotations

import torch

from ringflow.engine.sync_batchnorm import RankBatchNorm
from ringflow.horovod.basics import Sum, size
from ringflow.horovod.collectives import allreduce_async_, synchronize

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(RankBatchNorm):
    """``BatchNorm1d/2d/3d`` (any input of 2 or more dimensions, channels second) with the
    statistics of every rank's batch, as Horovod's ``SyncBatchNorm``."""

    def _ranks(self) -> int:
        return size()

    def _syncs(self, batch_stats: bool) -> bool:
        return batch_stats and size() > 1

    def _summed(self, flat: torch.Tensor) -> torch.Tensor:
        return synchronize(allreduce_async_(flat, op=Sum))  # a joined rank gives zeros
