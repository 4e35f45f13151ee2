"""The distributed engine: data-parallel training of LightningModules on Ray actors.

Never imports Prefect. ``engine.collective`` holds the gradient collectives.
"""

from ringflow.engine.config import DataSpec, TrainConfig
from ringflow.engine.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    EngineError,
    PeerLostError,
    WorkerFailedError,
)
from ringflow.engine.trainer import EpochMetrics, FitResult, evaluate, fit

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "DataSpec",
    "EngineError",
    "EpochMetrics",
    "FitResult",
    "PeerLostError",
    "TrainConfig",
    "WorkerFailedError",
    "evaluate",
    "fit",
]
