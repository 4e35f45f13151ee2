"""Communication hooks: what happens to each gradient bucket between backward and the step.

A hook is DDP's ``register_comm_hook`` on our ring: ``hook(state, bucket)`` is called once
per bucket as soon as backward has filled it (:class:`~ringflow.engine.collective.GradientBuckets`
calls it in the same order on every rank), and returns a future of the reduced bucket:
anything with ``wait()`` that returns the tensor (a ``CollectiveWork`` from
``bucket.collective``, or a ``torch.futures.Future``). The engine waits for it before the
optimizer steps and copies the result into the bucket where it is another tensor. The sums
reach ``.grad`` through the bucket (each gradient is a view of it).

The built-in path is :func:`allreduce_hook`: float32 on the wire (``compression="none"``) or
the collective's own wire format (``bf16``, ``fp16``: cast per chunk, summed in float32).
A user's hook is registered by name and chosen by ``TrainConfig.compression``::

    from ringflow.engine.collective import register_comm_hook

    @register_comm_hook("clipped_sum")
    def clipped_sum(state, bucket):
        bucket.buffer.clamp_(-1.0, 1.0)
        return bucket.collective.allreduce_async_(bucket.buffer, op=bucket.op)

Register it in the module that defines the model, so that every worker, which imports the
model, knows the name. ``state`` is what ``register_comm_hook(name, state=factory)``'s
``factory(rank, world_size)`` built once per worker (``None`` without one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ringflow.engine.collective.base import Collective, CollectiveWork, ReduceOp
from ringflow.engine.collective.registry import comm_hook, register_comm_hook
from ringflow.engine.errors import ModelError

__all__ = ["GradBucket", "allreduce_hook", "comm_hook", "register_comm_hook"]


@dataclass(frozen=True, eq=False)
class GradBucket:
    """One bucket of gradients, as a hook gets it."""

    index: int
    """Its place in the order buckets are reduced (0: the last layers', first ready)."""
    buffer: torch.Tensor
    """The flat gradients of :attr:`params`, each already weighted by this rank's share of
    the global batch where shares differ."""
    params: tuple[torch.Tensor, ...]
    """The parameters whose gradients it holds, in the buffer's order."""
    op: ReduceOp
    """``avg`` (every rank's share alike: the mean of the sums) or ``sum``: what the
    reduced bucket must be."""
    collective: Collective
    """The ring (or the collective ``TrainConfig.collective`` names) to reduce it over."""
    last: bool = False
    """Whether it is the step's last bucket (the first layers')."""

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, a view of :attr:`buffer` shaped as the parameter."""
        views, start = [], 0
        for param in self.params:
            views.append(self.buffer[start : start + param.numel()].view_as(param))
            start += param.numel()
        return views


def allreduce_hook(state: Any, bucket: GradBucket) -> CollectiveWork:
    """The bucket summed (or averaged) over the ranks, in the collective's wire format."""
    return bucket.collective.allreduce_async_(bucket.buffer, op=bucket.op)


class Reduced(CollectiveWork):
    """A hook's future, waited for into its bucket."""

    def __init__(self, future: Any, buffer: torch.Tensor, name: str) -> None:
        self._future, self._buffer, self._name = future, buffer, name

    def wait(self) -> torch.Tensor:
        result = self._future.wait()
        if not isinstance(result, torch.Tensor) or result.shape != self._buffer.shape:
            raise ModelError(
                f"communication hook {self._name!r} must return a future of the reduced "
                f"bucket (a tensor of shape {tuple(self._buffer.shape)}), got "
                f"{type(result).__name__}"
                + (f" {tuple(result.shape)}" if hasattr(result, "shape") else "")
            )
        if result.data_ptr() != self._buffer.data_ptr():
            self._buffer.copy_(result)
        return self._buffer

    def is_completed(self) -> bool:
        done = getattr(self._future, "is_completed", None) or self._future.done
        return bool(done())
