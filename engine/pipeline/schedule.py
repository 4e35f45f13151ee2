"""Pipeline schedules: the order in which one stage runs its micro-batches' forwards and
backwards, by name.

A schedule is a pure function of (stage, stages, micro-batches), so every stage derives its
own order without talking to the others, and the orders of neighbouring stages always match:
what stage s sends, stage s+1 receives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Action",
    "ScheduleFn",
    "available_schedules",
    "gpipe",
    "max_in_flight",
    "one_f_one_b",
    "register_schedule",
    "stage_actions",
]


@dataclass(frozen=True)
class Action:
    """Run the forward (``F``) or backward (``B``) of micro-batch ``micro`` on this stage."""

    kind: Literal["F", "B"]
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}"


ScheduleFn = Callable[..., list[Action]]
_REGISTRY: dict[str, ScheduleFn] = {}


def register_schedule(name: str) -> Callable[[ScheduleFn], ScheduleFn]:
    """Decorator that makes a schedule function selectable by ``name``."""

    def decorate(fn: ScheduleFn) -> ScheduleFn:
        _REGISTRY[name] = fn
        return fn

    return decorate


def available_schedules() -> list[str]:
    return sorted(_REGISTRY)


def stage_actions(name: str, *, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """The actions of ``stage`` (0-based) of ``stages`` under schedule ``name``.

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones), or a count out of range.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown schedule {name!r}; choose one of {available_schedules()}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage}")
    if micro_batches < 0:
        raise ValueError(f"micro_batches must not be negative, got {micro_batches}")
    return _REGISTRY[name](stage=stage, stages=stages, micro_batches=micro_batches)


@register_schedule("gpipe")
def gpipe(*, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """GPipe: every forward, then every backward (all M micro-batches' activations live)."""
    del stage, stages  # the same order on every stage
    return [Action("F", i) for i in range(micro_batches)] + [
        Action("B", i) for i in range(micro_batches)
    ]


@register_schedule("1f1b")
def one_f_one_b(*, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """PipeDream-Flush: ``P - 1 - stage`` warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards. At most ``P - stage`` micro-batches are in flight.

    With fewer micro-batches than stages the warm-up simply takes all of them.
    """
    warmup = min(stages - 1 - stage, micro_batches)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", i) for i in range(micro_batches - warmup, micro_batches)]
    return actions


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches forwarded but not yet backwarded at any point of ``actions``."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak
