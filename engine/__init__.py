"""The distributed engine: training LightningModules on Ray actors.

``fit`` is the one driver: data parallel by default, pipeline stages with a
``PipelineConfig`` (``engine.layout``). ``engine.spec`` names models by import path,
``engine.collective`` holds the gradient collectives. Never imports Prefect.

Each name is imported when first used: ``ringflow.engine.config`` (what the flow's
command line checks) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringflow.engine.config import DataSpec, SymmConfig, TensorData, TrainConfig
    from ringflow.engine.data import DatasetData
    from ringflow.engine.errors import (
        CollectiveError,
        CollectiveTimeoutError,
        EngineError,
        ModelError,
        PeerLostError,
        WorkerFailedError,
    )
    from ringflow.engine.ray_data import RayDatasetData
    from ringflow.engine.spec import ModelRef
    from ringflow.engine.trainer import EpochMetrics, FitResult, evaluate, fit

_WHERE = {
    "DataSpec": "config",
    "SymmConfig": "config",
    "TensorData": "config",
    "TrainConfig": "config",
    "DatasetData": "data",
    "CollectiveError": "errors",
    "CollectiveTimeoutError": "errors",
    "EngineError": "errors",
    "ModelError": "errors",
    "PeerLostError": "errors",
    "WorkerFailedError": "errors",
    "RayDatasetData": "ray_data",
    "ModelRef": "spec",
    "EpochMetrics": "trainer",
    "FitResult": "trainer",
    "evaluate": "trainer",
    "fit": "trainer",
}

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "DataSpec",
    "DatasetData",
    "EngineError",
    "EpochMetrics",
    "FitResult",
    "ModelError",
    "ModelRef",
    "PeerLostError",
    "RayDatasetData",
    "SymmConfig",
    "TensorData",
    "TrainConfig",
    "WorkerFailedError",
    "evaluate",
    "fit",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
