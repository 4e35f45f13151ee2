"""Batch normalisation over the batch of every data-parallel rank (Lightning's
``Trainer(sync_batchnorm=True)``, torch's ``SyncBatchNorm``, Horovod's ``hvd.SyncBatchNorm``).

In training, each rank's per-channel sums travel over the ranks once forward (sum, sum of
squares, count: in float64, so the variance keeps its digits) and once backward (the two sums
the input gradient needs), so every rank normalises with the mean and variance of the global
batch, updates its running statistics alike, and its input gradient is the one of the global
batch. The weight and bias gradients stay local: the gradient all-reduce sums them with the
others. The ranks' losses must then be weighted by their share of the global batch before
backward, as ``engine.data_parallel`` does where parts differ in size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ringflow.engine.errors import ModelError

if TYPE_CHECKING:
    from ringflow.engine.collective import Collective

__all__ = ["RankBatchNorm", "SyncBatchNorm", "attach_collective", "convert_sync_batchnorm"]

Summed = Callable[[torch.Tensor], torch.Tensor]
"""A flat tensor summed over the ranks (every rank calls it with its own, in the same order)."""


class RankBatchNorm(_BatchNorm):
    """``BatchNorm1d/2d/3d`` (any input of 2 or more dimensions, channels second) whose batch
    statistics in training are those of every rank's batch. Subclasses say how many ranks
    there are and how a tensor is summed over them."""

    def _ranks(self) -> int:
        raise NotImplementedError

    def _summed(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _syncs(self, batch_stats: bool) -> bool:
        """Whether this forward uses every rank's statistics: in training, as torch's
        ``SyncBatchNorm`` (evaluation may see different batch counts on each rank)."""
        return batch_stats and self.training and self._ranks() > 1

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 (torch's name)
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's name)
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as torch's
                momentum = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or not self.track_running_stats
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not self._syncs(batch_stats):
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                batch_stats,
                momentum,
                self.eps,
            )
        return _SyncBatchNorm.apply(
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            momentum,
            self._summed,
        )


class SyncBatchNorm(RankBatchNorm):
    """The engine's: statistics summed over the collective its data-parallel worker joined
    (:func:`attach_collective`); plain ``BatchNorm`` while it has none or one rank."""

    collective: Collective | None = None

    def _ranks(self) -> int:
        return 1 if self.collective is None else self.collective.world_size

    def _summed(self, flat: torch.Tensor) -> torch.Tensor:
        # Gathered, then added in rank order: uncompressed, and bit for bit alike on every
        # rank, so the running statistics stay identical.
        return torch.stack(self.collective.all_gather(flat)).sum(0)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("collective", None)  # a copy of the module is not a member of the ring
        return state


def convert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every ``BatchNorm*d`` replaced by a :class:`SyncBatchNorm` holding the
    same parameters and buffers (``torch.nn.SyncBatchNorm.convert_sync_batchnorm``'s
    conversion, which Lightning's ``sync_batchnorm=True`` applies).

    Raises:
        ModelError: a lazy BatchNorm has no size yet.
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, RankBatchNorm):
        return _converted(module)
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child)
        if converted is not child:
            module.add_module(name, converted)
    return module


def _converted(layer: _BatchNorm) -> SyncBatchNorm:
    if layer.weight is not None and isinstance(layer.weight, torch.nn.UninitializedParameter):
        raise ModelError(
            f"{type(layer).__name__} has no size yet and sync_batchnorm converts it before "
            "the first batch: give it num_features (BatchNorm1d/2d/3d)"
        )
    converted = SyncBatchNorm(
        layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats
    )
    if layer.affine:
        converted.weight, converted.bias = layer.weight, layer.bias  # the optimizer's
    converted.running_mean = layer.running_mean
    converted.running_var = layer.running_var
    converted.num_batches_tracked = layer.num_batches_tracked
    converted.training = layer.training
    if hasattr(layer, "qconfig"):
        converted.qconfig = layer.qconfig
    return converted


def attach_collective(module: torch.nn.Module, collective: Collective | None) -> None:
    """Make ``module``'s :class:`SyncBatchNorm` layers sum over ``collective`` (``None``:
    none, as before a worker joins its ring and after it leaves it)."""
    for layer in module.modules():
        if isinstance(layer, SyncBatchNorm):
            layer.collective = collective


def _summed_apart(summed: Summed, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``tensors`` summed over the ranks, in one call of ``summed``."""
    flat = summed(torch.cat([t.reshape(-1) for t in tensors]))
    return list(flat.split([t.numel() for t in tensors]))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, running_mean, running_var, eps, momentum, summed):
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        stats = x.detach().double()
        count = torch.tensor([x.numel() // x.size(1)], dtype=torch.float64, device=x.device)
        total, squares, n = _summed_apart(summed, stats.sum(dims), (stats * stats).sum(dims), count)
        mean = total / n
        var = (squares / n - mean * mean).clamp_min(0)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            unbiased = var * n / (n - 1).clamp_min(1)
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        invstd = (var + eps).rsqrt().to(x.dtype)
        mean = mean.to(x.dtype)
        ctx.save_for_backward(x, weight, mean, invstd, n)
        ctx.dims, ctx.shape, ctx.summed = dims, shape, summed
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
        if weight is not None:  # local: the gradient all-reduce sums them with the others
            grad_weight, grad_bias = sum_dy_xmu * invstd, sum_dy
        grad_x = None
        if ctx.needs_input_grad[0]:
            all_dy, all_dy_xmu = _summed_apart(ctx.summed, sum_dy, sum_dy_xmu)
            n = n.to(dy.dtype)
            scale = invstd if weight is None else invstd * weight
            grad_x = dy - (all_dy / n).view(shape)
            grad_x = grad_x - xmu * (invstd * invstd * all_dy_xmu / n).view(shape)
            grad_x = grad_x * scale.view(shape)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None
