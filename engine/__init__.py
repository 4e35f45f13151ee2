"""The distributed engine: training LightningModules on Ray actors.

``fit`` is the one driver: data parallel by default, pipeline stages with a
``PipelineConfig`` (``engine.layout``). ``engine.spec`` names models by import path,
``engine.collective`` holds the gradient collectives. Never imports Prefect.
"""

from ringflow.engine.config import DataSpec, TensorData, TrainConfig
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
    "TensorData",
    "TrainConfig",
    "WorkerFailedError",
    "evaluate",
    "fit",
]
