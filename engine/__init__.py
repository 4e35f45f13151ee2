"""The distributed engine: data-parallel training of LightningModules on Ray actors.

Never imports Prefect. ``engine.collective`` holds the gradient collectives.
"""

from engine.config import DataSpec, TrainConfig
from engine.errors import EngineError, WorkerFailedError
from engine.trainer import EpochMetrics, FitResult, evaluate, fit

__all__ = [
    "DataSpec",
    "EngineError",
    "EpochMetrics",
    "FitResult",
    "TrainConfig",
    "WorkerFailedError",
    "evaluate",
    "fit",
]
