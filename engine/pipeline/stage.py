"""One pipeline stage's compute: its layers, the micro-batches in flight, the loss on the last.

``PipelineStage`` knows nothing about processes or transport; ``engine.pipeline.execute``
drives it through a schedule over a ``StageLink``. It runs in any process: a Ray actor for
training, a spawned process for the GPU benchmark, or a thread in tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from ringflow.engine.pipeline.partition import Partition, model_layers, trim_to_stage

__all__ = ["LossFn", "PipelineStage"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(output, target)``: the mean loss over the micro-batch."""


@dataclass
class _InFlight:
    """What backward needs of a micro-batch that went forward."""

    input: torch.Tensor
    output: torch.Tensor | None  # None when recomputing: rebuilt in backward
    target: torch.Tensor | None
    weight: float
    rng: tuple[torch.Tensor, list[torch.Tensor]] | None


class PipelineStage:
    """Stage ``stage`` of ``partition`` over ``module``, which it trims in place.

    Build ``module`` identically (same seed) on every stage, as the unsplit model would be:
    the stage then starts from exactly the unsplit model's weights for the layers it owns.

    Args:
        module: the whole model; layers this stage does not own become ``nn.Identity``.
        partition: which layers each stage owns.
        stage: this stage's index.
        example: a first-stage input batch (one sample is enough): fixes the per-sample
            shape and dtype of the activations this stage receives and sends.
        loss_fn: applied by the last stage to its output and the micro-batch's target.
        recompute: keep only inputs in forward; recompute the activations in backward.
        device: where the stage's layers and activations live.
        context: what every forward runs in (autocast, for mixed precision); it also fixes
            the dtypes of the activations sent between stages.
        scale: applied by the last stage to its weighted loss before backward (a gradient
            scaler's ``scale``, for ``16-mixed``).

    Attributes:
        in_flight: micro-batches whose activations this stage holds now.
        peak_in_flight: the most it held at once since the last ``reset_peak()``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        partition: Partition,
        stage: int,
        example: torch.Tensor,
        loss_fn: LossFn | None = None,
        recompute: bool = False,
        device: str | torch.device = "cpu",
        context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if not 0 <= stage < partition.stages:
            raise ValueError(f"stage must be in [0, {partition.stages}), got {stage}")
        self.stage, self.stages = stage, partition.stages
        self.is_first, self.is_last = stage == 0, stage == partition.stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn")
        self.loss_fn, self.recompute = loss_fn, recompute
        self.context, self.scale = context, scale
        self.device = torch.device(device)
        with context():
            self.input_spec, self.output_spec = _boundary_specs(module, partition, stage, example)
        self.layers = trim_to_stage(module, partition, stage)
        self.module = module.to(self.device)
        self._in_flight: dict[int, _InFlight] = {}
        self.peak_in_flight = 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def drop_in_flight(self) -> None:
        """Forget the micro-batches of a step that will not finish (the run rolls back)."""
        self._in_flight.clear()

    def reset_peak(self) -> None:
        self.peak_in_flight = len(self._in_flight)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward(
        self,
        micro: int,
        x: torch.Tensor,
        *,
        target: torch.Tensor | None = None,
        weight: float = 1.0,
    ) -> torch.Tensor:
        """Run micro-batch ``micro`` forward and keep what its backward needs.

        Returns:
            The activation to send on (detached), or on the last stage the micro-batch's mean
            loss (detached, unweighted).
        """
        if micro in self._in_flight:
            raise RuntimeError(f"stage {self.stage}: micro-batch {micro} is already in flight")
        if not self.is_first and x.is_floating_point():
            x.requires_grad_(True)
        rng = _rng_state(self.device) if self.recompute else None
        with torch.set_grad_enabled(not self.recompute), self.context():
            out = self._run(x)
            if self.is_last:
                loss = self.loss_fn(out, target)
                out = self._scaled(loss * weight)
        self._in_flight[micro] = _InFlight(
            input=x, output=None if self.recompute else out, target=target, weight=weight, rng=rng
        )
        self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))
        return loss.detach() if self.is_last else out.detach()

    def backward(self, micro: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """Backpropagate micro-batch ``micro``; gradients accumulate into the parameters.

        Args:
            grad: the gradient of this stage's output (from the next stage); ``None`` on the
                last stage, whose output is the loss.

        Returns:
            The gradient of this stage's input, for the previous stage; ``None`` on the first.
        """
        entry = self._in_flight.pop(micro)
        out = entry.output if entry.output is not None else self._recomputed(entry)
        if self.is_last:
            out.backward()
        else:
            out.backward(grad)
        return None if self.is_first else entry.input.grad

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Forward only (evaluation): nothing is kept."""
        with self.context():
            return self._run(x)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scale is None else self.scale(loss)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def _recomputed(self, entry: _InFlight) -> torch.Tensor:
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), self.context():
            _set_rng_state(self.device, entry.rng)  # dropout draws the same masks again
            out = self._run(entry.input)
            if self.is_last:
                out = self._scaled(self.loss_fn(out, entry.target) * entry.weight)
        return out


def _boundary_specs(
    module: nn.Module, partition: Partition, stage: int, example: torch.Tensor
) -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]:
    """Per-sample shape and dtype of the stage's input and output, from one sample."""
    x = example[:1]
    start, stop = partition.bounds[stage], partition.bounds[stage + 1]
    spec_in = spec_out = (tuple(x.shape[1:]), x.dtype)
    with torch.no_grad():
        for index, (_, layer) in enumerate(model_layers(module)[:stop]):
            if index == start:
                spec_in = (tuple(x.shape[1:]), x.dtype)
            x = layer(x)
    spec_out = (tuple(x.shape[1:]), x.dtype)
    return spec_in, spec_out


def _rng_state(device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda = [torch.cuda.get_rng_state(device)] if device.type == "cuda" else []
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1][0], device)
