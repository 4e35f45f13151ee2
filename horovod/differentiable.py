"""The tensor collectives that return new tensors (``hvd.allreduce``, ``allgather``,
``broadcast``, ``alltoall``, ``reducescatter`` and their grouped forms), as autograd
functions over the collectives' handles (``ringflow.horovod.collectives``), with Horovod's
gradients: a script may backpropagate through them as under Horovod (each backward is
itself a collective, so every rank runs backward through the same collectives in the same
order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringflow.horovod import collectives
from ringflow.horovod.basics import Average, Sum, _known, rank, size
from ringflow.horovod.collectives import _member
from ringflow.horovod.process_sets import current, in_process_set, within

__all__ = [
    "Allgather",
    "Allreduce",
    "Alltoall",
    "Broadcast",
    "Reducescatter",
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "reducescatter",
]


class Allreduce(torch.autograd.Function):
    """The gradient is reduced as the tensor was (the same op and scale factors)."""

    @staticmethod
    def forward(ctx: Any, tensor, average, name, op, prescale_factor, postscale_factor):
        ctx.process_set = current()  # the backward runs in the same set
        ctx.reduction = (average, op, prescale_factor, postscale_factor)
        handle = collectives.allreduce_async(
            tensor,
            average,
            name,
            op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
        return collectives.synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with within(ctx.process_set):
            average, op, pre, post = ctx.reduction
            handle = collectives.allreduce_async(
                grad, average, None, op, prescale_factor=pre, postscale_factor=post
            )
            return collectives.synchronize(handle), None, None, None, None, None


class Allgather(torch.autograd.Function):
    """Each rank's gradient is its own rows of the gradients averaged over the ranks."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None):
        ctx.process_set = current()  # the backward runs in the same set
        ctx.shape = tensor.shape
        return collectives.synchronize(collectives.allgather_async(tensor, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with within(ctx.process_set):
            averaged = _averaged(grad)
            rows = ctx.shape[0] if ctx.shape else 1
            counts = torch.tensor([rows], dtype=torch.int64)
            every = collectives.synchronize(collectives.allgather_async(counts))
            start = int(every[: rank()].sum())
            return averaged.narrow(0, start, rows).reshape(ctx.shape), None


class Broadcast(torch.autograd.Function):
    """The root's gradient is the average of every rank's; the others' are zeros."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None):
        ctx.process_set = current()  # the backward runs in the same set
        ctx.root_rank = root_rank
        return collectives.synchronize(collectives.broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with within(ctx.process_set):
            averaged = _averaged(grad)
            if _known().rank != ctx.root_rank:  # the run's rank: root_rank is one
                averaged = torch.zeros_like(averaged)
            return averaged, None, None


class Alltoall(torch.autograd.Function):
    """The gradient goes back by the alltoall the other way (the received splits)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None):
        ctx.process_set = current()  # the backward runs in the same set
        received, counts = collectives.synchronize(collectives.alltoall_async(tensor, splits, name))
        ctx.counts = counts
        ctx.mark_non_differentiable(counts)
        return received, counts

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _counts: Any):
        with within(ctx.process_set):
            handle = collectives.alltoall_async(grad.contiguous(), ctx.counts)
            returned, _ = collectives.synchronize(handle)
            return returned, None, None


class Reducescatter(torch.autograd.Function):
    """The gradient is every rank's gradient gathered (times the ranks for a sum, and the
    scale factors), as Horovod's."""

    @staticmethod
    def forward(ctx: Any, tensor, name, op, prescale_factor, postscale_factor):
        ctx.process_set = current()  # the backward runs in the same set
        ctx.scale = prescale_factor * postscale_factor * (size() if op == Sum else 1)
        handle = collectives.reducescatter_async(
            tensor, name, op, prescale_factor=prescale_factor, postscale_factor=postscale_factor
        )
        return collectives.synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with within(ctx.process_set):
            gathered = collectives.synchronize(collectives.allgather_async(grad * ctx.scale))
            return gathered, None, None, None, None


def _averaged(grad: torch.Tensor) -> torch.Tensor:
    return collectives.synchronize(collectives.allreduce_async(grad, op=Average))


@in_process_set
def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """The average (or sum, min, max, product) of ``tensor`` over the ranks, as a new
    tensor; differentiable (the gradient is reduced the same way, as Horovod's)."""
    wire, ctx = compression.compress(tensor) if compression else (tensor, None)
    reduced = Allreduce.apply(wire, average, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx) if compression else reduced


@in_process_set
def grouped_allreduce(
    tensors: Sequence[torch.Tensor], average=None, name=None, compression=None, op=None, **kw
):
    """:func:`allreduce` of each tensor, in order; a list of the results."""
    return [
        allreduce(t, average, _member(name, i), compression, op, **kw)
        for i, t in enumerate(tensors)
    ]


@in_process_set
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Rank ``root_rank``'s ``tensor``, as a new tensor on every rank; differentiable (the
    root's gradient is the average of every rank's, the others' zero, as Horovod's)."""
    return Broadcast.apply(tensor, root_rank, name)


@in_process_set
def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order; the
    first dimension may differ between ranks, the others may not. Differentiable."""
    return Allgather.apply(tensor, name)


@in_process_set
def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None
) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor, in order."""
    return [allgather(t, _member(name, i)) for i, t in enumerate(tensors)]


@in_process_set
def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None) -> Any:
    """Rank ``r`` gets part ``r`` of every rank's ``tensor``, concatenated in rank order: the
    first dimension cut into ``splits`` rows per rank (equal parts by default). With
    ``splits``, ``(tensor, received_splits)``: how many rows came from each rank, as
    Horovod's. Differentiable."""
    received, counts = Alltoall.apply(tensor, splits, name)
    return received if splits is None else (received, counts)


@in_process_set
def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = None,
    op: str = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Rank ``r``'s part of the average (``op=Average``, the default) or sum of ``tensor``
    over the ranks: the first dimension cut into ``size()`` parts, the first ones a row
    longer where it does not divide, as Horovod's. Differentiable."""
    wire, ctx = compression.compress(tensor) if compression else (tensor, None)
    reduced = Reducescatter.apply(wire, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx) if compression else reduced


@in_process_set
def grouped_reducescatter(
    tensors: Sequence[torch.Tensor], name=None, compression=None, op=Average, **kw
):
    """:func:`reducescatter` of each tensor, in order."""
    return [
        reducescatter(t, _member(name, i), compression, op, **kw) for i, t in enumerate(tensors)
    ]
