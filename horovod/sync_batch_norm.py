"""Horovod's ``hvd.SyncBatchNorm``: batch normalisation over the batch of every rank.

In training, each rank's per-channel sums travel over the ring once forward (sum, sum of
squares, count) and once backward (the sums the input gradient needs), so every rank
normalises with the mean and variance of the global batch and its input gradient is the one
of the global batch. In evaluation it is ``BatchNorm`` with the running statistics. Unlike
Horovod's, it also runs on CPU tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ringflow.horovod.basics import Sum, size
from ringflow.horovod.collectives import _reduce, synchronize
from ringflow.horovod.negotiation import agree

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """``BatchNorm1d/2d/3d`` (any input of 2 or more dimensions, channels second) with the
    statistics of every rank's batch, as Horovod's ``SyncBatchNorm``."""

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 (torch's name)
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's name)
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        batch_stats = self.training or not self.track_running_stats
        if not batch_stats or size() == 1:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                batch_stats,
                self.momentum if self.momentum is not None else 0.0,
                self.eps,
            )
        momentum = self.momentum
        if momentum is None:  # a cumulative moving average, as torch's
            momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNorm.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, momentum
        )


def _summed(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``tensors`` summed over the ranks, in one all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    agree("allreduce", flat, None, op=Sum)  # a joined rank takes part with zeros
    summed = synchronize(_reduce(flat, Sum, 1.0, 1.0))
    return list(summed.split([t.numel() for t in tensors]))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, running_mean, running_var, eps, momentum):
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        stats = x.detach().double()
        count = torch.tensor([x.numel() // x.size(1)], dtype=torch.float64, device=x.device)
        total, squares, n = _summed(stats.sum(dims), (stats * stats).sum(dims), count)
        mean = total / n
        var = (squares / n - mean * mean).clamp_min(0)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            unbiased = var * n / (n - 1).clamp_min(1)
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        invstd = (var + eps).rsqrt().to(x.dtype)
        mean = mean.to(x.dtype)
        ctx.save_for_backward(x, weight, mean, invstd, n)
        ctx.dims, ctx.shape = dims, shape
        y = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.view(shape) + bias.view(shape)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x, weight, mean, invstd, n = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        xmu = x - mean.view(shape)
        sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
        grad_weight = grad_bias = None
        if weight is not None:  # local: DistributedOptimizer reduces them with the others
            grad_weight, grad_bias = sum_dy_xmu * invstd, sum_dy
        grad_x = None
        if ctx.needs_input_grad[0]:
            all_dy, all_dy_xmu = _summed(sum_dy, sum_dy_xmu)
            n = n.to(dy.dtype)
            scale = invstd if weight is None else invstd * weight
            grad_x = dy - (all_dy / n).view(shape)
            grad_x = grad_x - xmu * (invstd * invstd * all_dy_xmu / n).view(shape)
            grad_x = grad_x * scale.view(shape)
        return grad_x, grad_weight, grad_bias, None, None, None, None
