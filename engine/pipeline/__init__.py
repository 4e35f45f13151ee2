"""Pipeline parallelism: a layer-sequence model cut into stages on Ray actors, micro-batches
scheduled by GPipe or 1F1B, activations and gradients sent point to point between
neighbouring stages, optionally replicated data-parallel (DP x PP).

Layout: ``partition`` (which layers each stage owns), ``schedule`` (the order of forwards
and backwards), ``stage`` (one stage's compute), ``p2p`` (transfers with deadlines),
``execute`` (a stage through a schedule), ``step`` (what a stage's worker does), ``checks`` (what
is checked before any worker starts). ``engine.fit`` with a ``PipelineConfig`` trains one.
"""

from ringflow.engine.config import TensorData
from ringflow.engine.pipeline.checks import check_pipeline
from ringflow.engine.pipeline.config import BALANCES, PipelineConfig
from ringflow.engine.pipeline.execute import MicroBatches, StepTiming, run_forward, run_schedule
from ringflow.engine.pipeline.p2p import StageLink
from ringflow.engine.pipeline.partition import (
    Partition,
    balanced_bounds,
    model_layers,
    partition_model,
    trim_to_stage,
)
from ringflow.engine.pipeline.schedule import (
    Action,
    available_schedules,
    max_in_flight,
    register_schedule,
    stage_actions,
)
from ringflow.engine.pipeline.stage import PipelineStage
from ringflow.engine.pipeline.step import PipelineStep, StagePlan

__all__ = [
    "BALANCES",
    "Action",
    "MicroBatches",
    "Partition",
    "PipelineConfig",
    "PipelineStage",
    "PipelineStep",
    "StageLink",
    "StagePlan",
    "StepTiming",
    "TensorData",
    "available_schedules",
    "balanced_bounds",
    "check_pipeline",
    "max_in_flight",
    "model_layers",
    "partition_model",
    "register_schedule",
    "run_forward",
    "run_schedule",
    "stage_actions",
    "trim_to_stage",
]
