"""What is checked of a pipeline before any worker starts: ``check_pipeline`` checks a model
for pipelining and cuts it into stages (``engine.layout.Pipeline`` calls it; ``engine.fit``
with a ``PipelineConfig`` trains it), ``check_micro_batches`` that every micro-batch has rows.
"""

from __future__ import annotations

from typing import Any

import torch

from ringflow.engine.config import DataSpec, TensorData, TrainConfig
from ringflow.engine.errors import ModelError
from ringflow.engine.module import check_manual_optimisation
from ringflow.engine.pipeline.config import PipelineConfig
from ringflow.engine.pipeline.data import first_rows
from ringflow.engine.pipeline.partition import Partition, model_layers, partition_model
from ringflow.engine.pipeline.step import pipeline_batch
from ringflow.engine.spec import build_module

__all__ = ["check_micro_batches", "check_pipeline"]


def check_micro_batches(config: TrainConfig, pipeline: PipelineConfig) -> None:
    """Every micro-batch of every replica needs a sample.

    Raises:
        ValueError: ``batch_size`` is below ``micro_batches`` x ``workers``.
    """
    if config.batch_size < pipeline.micro_batches * config.workers:
        raise ValueError(
            f"batch_size ({config.batch_size}) is smaller than micro_batches "
            f"({pipeline.micro_batches}) x replicas (workers={config.workers}): a micro-batch "
            "would be empty; raise batch_size or lower micro_batches"
        )


def check_pipeline(
    module_cls: type[torch.nn.Module],
    *,
    hparams: dict[str, Any],
    data: DataSpec | TensorData,
    config: TrainConfig,
    pipeline: PipelineConfig,
) -> Partition:
    """Check everything that can be checked before a worker starts; return the partition.

    Raises:
        ValueError: hparams the module refuses, a module that is not a layer sequence or has
            no ``pipeline_loss``, more stages than layers, bad split points, or a global batch
            too small for ``micro_batches`` micro-batches on each of ``workers`` replicas.
    """
    check_micro_batches(config, pipeline)
    module = build_module(module_cls, hparams)
    check_manual_optimisation(module, config, pipeline=True)
    if any(torch.nn.parameter.is_lazy(p) for p in module.parameters()):
        raise ModelError(
            f"{module_cls.__name__} has lazy layers, whose sizes a pipeline needs before it "
            "cuts the module into stages: give them their sizes, or train without stages"
        )
    for hook in ("pipeline_loss", "configure_optimizers"):
        if not callable(getattr(module, hook, None)):
            raise ValueError(f"{module_cls.__name__} must define {hook}() to train as a pipeline")
    model_layers(module)  # not a layer sequence: say so before profiling anything
    example = None
    if pipeline.balance == "time":
        size = max(1, config.batch_size // (config.workers * pipeline.micro_batches))
        example, _ = pipeline_batch(module, *first_rows(data, size))
    return partition_model(module, pipeline, example=example)
