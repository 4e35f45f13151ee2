"""Cutting a model given as an ordered sequence of layers into contiguous stages.

The layer convention (see docs/pipeline.md):

- an ``nn.Sequential`` is its own layer sequence;
- any other module defines ``pipeline_layers()``, returning its layers in the order the
  forward pass runs them; each layer's output (one tensor, batch first) is the next one's
  input. Every parameter of the module must belong to one of these layers.
- optionally ``pipeline_split_points`` (a tuple, or a method returning one) names the layers
  at which stages 1..P-1 begin; ``PipelineConfig(balance="module")`` uses it.

Layers are named by their path in the whole model (``blocks.2``), so a stage's parameters
keep their full names (``blocks.2.attn.weight``) and per-stage checkpoints load into any
other number of stages.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ringflow.engine.pipeline.config import PipelineConfig

__all__ = [
    "Partition",
    "balanced_bounds",
    "layer_costs",
    "model_layers",
    "partition_model",
    "trim_to_stage",
]


@dataclass(frozen=True, kw_only=True)
class Partition:
    """Which contiguous layers each stage owns."""

    names: tuple[str, ...]
    """Every layer's path in the whole model, in forward order."""
    bounds: tuple[int, ...]
    """P+1 indices into ``names``: stage s owns layers ``bounds[s]`` to ``bounds[s+1] - 1``."""

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def layers_of(self, stage: int) -> tuple[str, ...]:
        return self.names[self.bounds[stage] : self.bounds[stage + 1]]


def model_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in forward order, each with its path in the model.

    Raises:
        ValueError: the model is not an ``nn.Sequential`` and has no ``pipeline_layers()``,
            a layer is not a submodule of the model, or a parameter belongs to no layer.
    """
    if callable(getattr(model, "pipeline_layers", None)):
        layers = list(model.pipeline_layers())
    elif isinstance(model, nn.Sequential):
        layers = list(model)
    else:
        raise ValueError(
            f"{type(model).__name__} is not a layer sequence: make it an nn.Sequential or "
            "define pipeline_layers() returning its layers in forward order (docs/pipeline.md)"
        )
    paths = {id(module): name for name, module in model.named_modules() if name}
    missing = [type(layer).__name__ for layer in layers if id(layer) not in paths]
    if missing:
        raise ValueError(f"pipeline_layers() returned modules that are not submodules: {missing}")
    named = [(paths[id(layer)], layer) for layer in layers]
    _check_covered(model, named)
    return named


def _check_covered(model: nn.Module, layers: Sequence[tuple[str, nn.Module]]) -> None:
    owned = {id(p) for _, layer in layers for p in layer.parameters()}
    stray = [name for name, p in model.named_parameters() if id(p) not in owned]
    if stray:
        raise ValueError(
            f"parameters {stray[:5]} belong to no pipeline layer; every parameter must live in "
            "one of the modules pipeline_layers() returns"
        )


def partition_model(
    model: nn.Module, config: PipelineConfig, *, example: torch.Tensor | None = None
) -> Partition:
    """Decide each stage's layers, once, before any stage starts.

    Args:
        model: the whole model (a layer sequence, see the module docstring).
        config: stages and balance.
        example: a batch of first-stage input; needed for ``balance="time"``.

    Raises:
        ValueError: more stages than layers, bad split points, or ``balance="time"``
            without an example.
    """
    layers = model_layers(model)
    names = tuple(name for name, _ in layers)
    if config.stages > len(layers):
        raise ValueError(
            f"stages ({config.stages}) exceeds the model's {len(layers)} layers; lower stages "
            "or expose finer layers in pipeline_layers()"
        )
    if config.balance in ("params", "time"):
        costs = layer_costs(layers, by=config.balance, example=example)
        bounds = balanced_bounds(costs, config.stages)
    else:
        points = _declared_points(model) if config.balance == "module" else config.balance
        bounds = _bounds_from_points(points, names, config.stages)
    return Partition(names=names, bounds=bounds)


def layer_costs(
    layers: Sequence[tuple[str, nn.Module]], *, by: str, example: torch.Tensor | None = None
) -> list[float]:
    """Each layer's cost: its parameter count, or its measured forward+backward seconds."""
    if by == "params":
        # One unit per layer keeps parameter-free layers (activations) from piling up.
        return [1.0 + sum(p.numel() for p in layer.parameters()) for _, layer in layers]
    if example is None:
        raise ValueError('balance="time" needs an example batch to profile the layers with')
    return _profile(layers, example)


def _profile(layers: Sequence[tuple[str, nn.Module]], example: torch.Tensor) -> list[float]:
    """Median of 3 forward+backward timings per layer, on the activations it really gets."""
    costs, x = [], example
    for _, layer in layers:
        x = x.detach().requires_grad_(x.is_floating_point())
        timings = []
        for _ in range(3):
            started = time.perf_counter()
            out = layer(x)
            out.float().sum().backward()
            timings.append(time.perf_counter() - started)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(timings)[1])
        x = out
    return costs


def balanced_bounds(costs: Sequence[float], stages: int) -> tuple[int, ...]:
    """Contiguous split of ``costs`` into ``stages`` non-empty parts minimising the largest
    part (exact dynamic programme; layers number in the hundreds at most)."""
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[k][i]: the smallest possible largest part when the first i layers form k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [n], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return tuple(reversed(bounds))


def _declared_points(model: nn.Module) -> tuple[int | str, ...]:
    points = getattr(model, "pipeline_split_points", None)
    if callable(points):
        points = points()
    if points is None:
        raise ValueError(
            f'balance="module" but {type(model).__name__} declares no pipeline_split_points'
        )
    return tuple(points)


def _bounds_from_points(
    points: Sequence[int | str], names: tuple[str, ...], stages: int
) -> tuple[int, ...]:
    if len(points) != stages - 1:
        raise ValueError(f"{stages} stages need {stages - 1} split points, got {list(points)}")
    starts = []
    for point in points:
        if isinstance(point, str):
            if point not in names:
                raise ValueError(f"split point {point!r} is not a layer; layers are {names}")
            point = names.index(point)
        starts.append(point)
    bounds = (0, *starts, len(names))
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(
            f"split points {list(points)} must be increasing layer indices in (0, {len(names)}) "
            "so that every stage gets at least one layer"
        )
    return bounds


def trim_to_stage(model: nn.Module, partition: Partition, stage: int) -> list[nn.Module]:
    """Replace, in place, every layer ``stage`` does not own by ``nn.Identity``.

    The model keeps its structure, so the remaining parameters keep their full names.

    Returns:
        The stage's layers in forward order.
    """
    owned = set(partition.layers_of(stage))
    layers = []
    for name, layer in model_layers(model):
        if name in owned:
            layers.append(layer)
        else:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, nn.Identity())  # registers under the same key
    return layers
