"""``fit``: data-parallel training of a LightningModule on Ray workers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import DataSpec, TrainConfig
from engine.group import InProcessGroup, RayWorkerGroup
from engine.worker import evaluate_module
from storage.checkpoint import load_model
from storage.dataset import read_split

__all__ = ["EpochMetrics", "FitResult", "evaluate", "fit"]

log = logging.getLogger("ringflow.engine")

EpochCallback = Callable[["EpochMetrics"], None]


@dataclass(frozen=True, kw_only=True)
class EpochMetrics:
    """Metrics of one epoch, averaged over every sample of every worker."""

    epoch: int
    metrics: dict[str, float]
    seconds: float


@dataclass(frozen=True, kw_only=True)
class FitResult:
    """What a finished ``fit`` returns."""

    checkpoint: str
    """URL of the committed model checkpoint."""
    history: list[EpochMetrics] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """The last epoch's metrics."""
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)


def fit(
    module_cls: type[torch.nn.Module],
    *,
    hparams: dict[str, Any],
    data: DataSpec,
    config: TrainConfig,
    checkpoint_uri: str,
    in_process: bool = False,
    on_epoch: EpochCallback | None = None,
    meta: dict[str, Any] | None = None,
) -> FitResult:
    """Train ``module_cls(**hparams)`` on ``data`` with ``config.workers`` data-parallel workers.

    Every worker holds a full replica; each global batch of ``config.batch_size`` samples is
    split across the workers and their gradients are averaged through ``config.collective``
    every step, so the result does not depend on the number of workers.

    Args:
        module_cls: a ``LightningModule`` class; ``training_step`` returns the batch-mean loss.
        hparams: keyword arguments for ``module_cls``; checked here, before any worker starts.
        data: the preprocessed dataset.
        config: workers, epochs, global batch, seed, collective.
        checkpoint_uri: fsspec URL where the trained model is committed.
        in_process: run the single worker in this process instead of a Ray actor.
        on_epoch: called after every epoch with its metrics (progress display, tuning reports).
        meta: extra JSON metadata recorded in the checkpoint.

    Returns:
        The checkpoint URL, the per-epoch metrics and the final weights.
    """
    _check_module(module_cls, hparams)
    group_cls = InProcessGroup if in_process else RayWorkerGroup
    group = group_cls(module_cls, hparams=hparams, data=data, config=config)
    history: list[EpochMetrics] = []
    try:
        for epoch in range(config.epochs):
            started = time.perf_counter()
            metrics = _mean(group.call("train_epoch", epoch))
            metrics.update(_mean(group.call("evaluate", "validation")))
            history.append(
                EpochMetrics(epoch=epoch, metrics=metrics, seconds=time.perf_counter() - started)
            )
            log.info("epoch %d/%d %s", epoch + 1, config.epochs, _fmt(metrics))
            if on_epoch is not None:
                on_epoch(history[-1])
        uri = group.call_rank0(
            "save",
            checkpoint_uri,
            hparams=hparams,
            metrics=history[-1].metrics,
            meta={
                "epochs": config.epochs,
                "workers": config.workers,
                "seed": config.seed,
                "batch_size": config.batch_size,
                "collective": config.collective,
                "dataset_url": data.dataset_url,
                **(meta or {}),
            },
        )
        state = group.call_rank0("state_dict")
    finally:
        group.shutdown()
    return FitResult(checkpoint=uri, history=history, metrics=history[-1].metrics, state_dict=state)


def evaluate(
    model_uri: str, data: DataSpec, *, split: str = "test", batch_size: int = 512
) -> dict[str, float]:
    """Load the committed model at ``model_uri`` and evaluate it on ``split`` in this process."""
    module, _ = load_model(model_uri)
    x, y = read_split(data.dataset_url, split, data.schema)
    sums, count = evaluate_module(
        module, torch.from_numpy(x), torch.from_numpy(y), split=split, batch_size=batch_size
    )
    return _mean([(sums, count)])


def _check_module(module_cls: type, hparams: dict[str, Any]) -> None:
    """Build the module once here, so a bad hyperparameter fails before workers start."""
    try:
        module_cls(**hparams)
    except TypeError as err:
        raise ValueError(f"{module_cls.__name__} does not accept hparams {hparams}: {err}") from err
    for hook in ("training_step", "configure_optimizers", "validation_step"):
        if not callable(getattr(module_cls, hook, None)):
            raise TypeError(f"{module_cls.__name__} must define {hook}()")


def _mean(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Combine per-worker sums into sample-weighted means."""
    total = sum(count for _, count in parts)
    names = sorted({name for sums, _ in parts for name in sums})
    return {name: sum(s.get(name, 0.0) for s, _ in parts) / max(total, 1) for name in names}


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
