"""What each pipeline stage reads of the data.

Only two stages need rows: the first its micro-batches' inputs, the last their loss targets
(both made by ``module.pipeline_batch(features, labels)``, so both read the features and the
labels). They read their replica's part of every global batch through the same ``Samples`` a
data-parallel worker reads (``engine.data.samples_of``): with ``DataSpec.stream`` the rows
come from the shards' row groups while training runs (``storage.stream``, memory bounded by a
few row groups and ``DataSpec.prefetch_batches`` batches), else the split is read whole. The
stages between read no rows at all: the global order (``engine.data.EpochOrder``) and the
micro-batches' sizes follow from the split's layout alone, which a ``DataSpec`` reads from the
Parquet footers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ringflow.engine.config import DataSpec
from ringflow.engine.data import Layout, Samples, layout_of, samples_of

__all__ = ["SplitShape", "first_rows", "stage_split"]


@dataclass(frozen=True)
class SplitShape:
    """A split as a stage that reads no rows sees it: its length and its layout, which set the
    order and every batch's size (``engine.worker.epoch_batches`` asks nothing else)."""

    layout: Layout

    def __len__(self) -> int:
        return sum(self.layout.blocks)


def stage_split(data: Any, split: str, *, reads_rows: bool) -> Samples | SplitShape:
    """``split`` as a stage sees it: its rows (streamed or read whole, as ``data`` says) when
    the stage ``reads_rows``, else only its shape."""
    if reads_rows:
        return samples_of(data, split)
    if isinstance(data, DataSpec):
        return SplitShape(data.layout(split))  # the Parquet footers, no rows
    return SplitShape(layout_of(samples_of(data, split)))  # already in memory


def first_rows(data: Any, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features, labels)`` of the training split's first ``count`` rows (fewer if it is
    shorter): an example batch that fixes the activations' shapes, read without reading the
    split (a ``DataSpec``'s first row groups only)."""
    if isinstance(data, DataSpec):
        data = dataclasses.replace(data, stream=True)
    samples = samples_of(data, "train")
    try:
        return samples.batch(torch.arange(min(count, len(samples))))
    finally:
        close = getattr(samples, "close", None)
        if close is not None:
            close()
