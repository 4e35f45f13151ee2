"""Driving one stage through a schedule: compute on this stage, transfers with its neighbours.

Every receive the schedule will need is known in advance, so each is posted a couple of
actions before it is needed and the transfer overlaps the compute in between.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ringflow.engine.pipeline.p2p import BACKWARD, FORWARD, PendingReceive, StageLink
from ringflow.engine.pipeline.schedule import Action
from ringflow.engine.pipeline.stage import PipelineStage

__all__ = ["MicroBatches", "StepTiming", "run_forward", "run_schedule"]

_EVAL_TAG = 1 << 20
"""Tags of evaluation transfers start here, apart from training ones."""


@dataclass(frozen=True, kw_only=True)
class MicroBatches:
    """One step's micro-batches as this stage sees them."""

    sizes: tuple[int, ...]
    """Samples in each micro-batch (every stage knows them: they fix the transfer shapes)."""
    inputs: list[torch.Tensor] | None = None
    """First-stage input of each micro-batch (first stage only)."""
    targets: list[torch.Tensor] | None = None
    """Loss target of each micro-batch (last stage only)."""
    weights: tuple[float, ...] = ()
    """Each micro-batch's share of the global batch; its mean loss is scaled by it, so the
    summed gradients are those of the global-batch mean."""


@dataclass
class StepTiming:
    """Where a stage's step went: compute, and the rest (waiting on neighbours)."""

    started: float = 0.0
    finished: float = 0.0
    busy_s: float = 0.0
    actions: list[tuple[str, float, float]] = field(default_factory=list)


def run_schedule(
    stage: PipelineStage,
    actions: list[Action],
    *,
    link: StageLink,
    micro: MicroBatches,
    timing: StepTiming | None = None,
    sync: bool = False,
) -> list[float]:
    """Run ``actions`` on ``stage``: forwards and backwards with their transfers.

    Args:
        stage: this stage.
        actions: the stage's schedule for this step.
        link: connections to the neighbouring stages.
        micro: the step's micro-batches.
        timing: filled with the compute time and the step's span when given.
        sync: synchronise CUDA around each action so ``timing`` measures the device (slower).

    Returns:
        The last stage's mean loss of each micro-batch (in micro-batch order); ``[]`` elsewhere.
    """
    inbox = _Inbox(stage, actions, link, micro.sizes, window=link.prepost)
    losses: dict[int, torch.Tensor] = {}
    if timing is not None:
        timing.started = time.perf_counter()
    for action in actions:
        received = inbox.take(action)
        began = _now(stage, sync)
        out = _compute(stage, action, received, micro)
        ended = _now(stage, sync)
        if timing is not None:
            timing.busy_s += ended - began
            timing.actions.append((repr(action), began, ended))
        if action.kind == "F" and stage.is_last:
            # Kept on the device: reading it now would make the host wait for the GPU
            # after every forward and leave the GPU idle while the next kernels launch.
            losses[action.micro] = out.detach()
        elif action.kind == "F":
            link.send(out, what=FORWARD, micro=action.micro)
        elif not stage.is_first:
            link.send(out, what=BACKWARD, micro=action.micro)
    link.flush()
    if timing is not None:
        timing.finished = _now(stage, sync)
    if not losses:
        return []
    return torch.stack([losses[i] for i in sorted(losses)]).float().cpu().tolist()


def run_forward(
    stage: PipelineStage, *, link: StageLink, micro: MicroBatches
) -> list[torch.Tensor]:
    """Forward only (evaluation) of every micro-batch; the last stage returns its outputs."""
    outputs = []
    for i, size in enumerate(micro.sizes):
        if stage.is_first:
            x = micro.inputs[i].to(stage.device)
        else:
            shape, dtype = stage.input_spec
            pending = link.post_receive(
                (size, *shape), dtype, stage.device, what=FORWARD, micro=_EVAL_TAG + i
            )
            x = link.wait(pending)
        out = stage.predict(x)
        if stage.is_last:
            outputs.append(out)
        else:
            link.send(out, what=FORWARD, micro=_EVAL_TAG + i)
    link.flush()
    return outputs


def _compute(
    stage: PipelineStage, action: Action, received: torch.Tensor | None, micro: MicroBatches
) -> torch.Tensor | None:
    i = action.micro
    if action.kind == "B":
        return stage.backward(i, received)
    x = micro.inputs[i].to(stage.device) if stage.is_first else received
    target = micro.targets[i].to(stage.device) if stage.is_last else None
    return stage.forward(i, x, target=target, weight=micro.weights[i])


class _Inbox:
    """Posts each receive the schedule needs up to ``window`` actions ahead of its use."""

    def __init__(
        self,
        stage: PipelineStage,
        actions: list[Action],
        link: StageLink,
        sizes: tuple[int, ...],
        window: int = 2,
    ) -> None:
        self._stage, self._link, self._sizes, self._window = stage, link, sizes, window
        self._needed = deque(a for a in actions if self._receives(a))
        self._posted: deque[tuple[Action, PendingReceive]] = deque()
        self._fill()

    def _receives(self, action: Action) -> bool:
        return not self._stage.is_first if action.kind == "F" else not self._stage.is_last

    def take(self, action: Action) -> torch.Tensor | None:
        if not self._receives(action):
            return None
        if not self._posted:  # nothing posted ahead (window 0): post it now
            self._post(self._needed.popleft())
        expected, pending = self._posted.popleft()
        assert expected == action, f"receive for {expected} taken by {action}"
        self._fill()
        return self._link.wait(pending)

    def _fill(self) -> None:
        while self._needed and len(self._posted) < self._window:
            self._post(self._needed.popleft())

    def _post(self, action: Action) -> None:
        what = FORWARD if action.kind == "F" else BACKWARD
        shape, dtype = self._stage.input_spec if what == FORWARD else self._stage.output_spec
        size = self._sizes[action.micro]
        pending = self._link.post_receive(
            (size, *shape), dtype, self._stage.device, what=what, micro=action.micro
        )
        self._posted.append((action, pending))


def _now(stage: PipelineStage, sync: bool) -> float:
    if sync and stage.device.type == "cuda":
        torch.cuda.synchronize(stage.device)
    return time.perf_counter()
