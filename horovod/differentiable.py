"""The tensor collectives as autograd functions, with Horovod's gradients: a script may
backpropagate through ``hvd.allreduce``, ``allgather``, ``broadcast``, ``alltoall`` and
``reducescatter`` as under Horovod (each backward is itself a collective, so every rank
runs backward through the same collectives in the same order).
"""

from __future__ import annotations

from typing import Any

import torch

from ringflow.horovod import collectives
from ringflow.horovod.basics import Average, Sum, _known, rank, size
from ringflow.horovod.process_sets import current, within

__all__ = ["Allgather", "Allreduce", "Alltoall", "Broadcast", "Reducescatter"]


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
            reduced = collectives.allreduce(grad, average, None, None, op, pre, post)
            return reduced, None, None, None, None, None


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
            averaged = collectives.allreduce(grad, op=Average)
            rows = ctx.shape[0] if ctx.shape else 1
            every = collectives.allgather(torch.tensor([rows], dtype=torch.int64))
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
            averaged = collectives.allreduce(grad, op=Average)
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
            returned, _ = collectives.alltoall(grad.contiguous(), splits=ctx.counts)
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
            return collectives.allgather(grad * ctx.scale), None, None, None, None
