"""What a pipeline-parallel run asks of the engine, besides ``TrainConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from ringflow.engine.pipeline.schedule import available_schedules

__all__ = ["BALANCES", "PipelineConfig"]

BALANCES = ("time", "params", "module")
"""Named ways to split the layers: by profiled time, by parameter count, or at the split
points the module declares (``pipeline_split_points``)."""

SplitPoint = int | str


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How the model is cut into stages and how micro-batches flow through them.

    Every field is validated on construction; the error names the field. Data parallelism
    on top (D replicas of the pipeline) comes from ``TrainConfig.workers``.
    """

    stages: int = 2
    """Pipeline stages P, one process (Ray actor) each per replica."""
    micro_batches: int = 4
    """Micro-batches M each replica's part of a global batch is cut into (M < P is allowed;
    the last micro-batch may be smaller)."""
    schedule: str = "1f1b"
    """``gpipe`` (every forward, then every backward: M micro-batches of activations live)
    or ``1f1b`` (PipeDream-Flush: at most P in flight); see ``available_schedules()``."""
    balance: str | tuple[SplitPoint, ...] = "params"
    """``params`` (equal parameter counts), ``time`` (equal profiled forward+backward time),
    ``module`` (the module's ``pipeline_split_points``), or explicit split points: P-1 layer
    names or indices at which stages 1..P-1 begin."""
    recompute: bool = False
    """Keep only each micro-batch's stage input during forward and recompute the stage's
    activations in backward (less memory, about one more forward of compute)."""

    def __post_init__(self) -> None:
        for name in ("stages", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.schedule not in available_schedules():
            raise ValueError(
                f"schedule must be one of {available_schedules()}, got {self.schedule!r}"
            )
        if isinstance(self.balance, list):
            object.__setattr__(self, "balance", tuple(self.balance))
        _check_balance(self.balance, self.stages)
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute must be True or False, got {self.recompute!r}")


def _check_balance(balance: object, stages: int) -> None:
    if isinstance(balance, str):
        if balance not in BALANCES:
            raise ValueError(
                f"balance must be one of {BALANCES} or a tuple of {stages - 1} split points, "
                f"got {balance!r}"
            )
        return
    if not isinstance(balance, tuple) or not all(
        isinstance(p, str | int) and not isinstance(p, bool) for p in balance
    ):
        raise ValueError(f"balance split points must be layer names or indices, got {balance!r}")
    if len(balance) != stages - 1:
        raise ValueError(
            f"balance has {len(balance)} split points; {stages} stages need {stages - 1} "
            "(the layer each of stages 1..P-1 begins with)"
        )
