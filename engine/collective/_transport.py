"""What a ring transport does: run a schedule's hops between neighbours before a deadline."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringflow.engine.collective._schedule import Hop, Schedule

__all__ = [
    "Completion",
    "Deadline",
    "Finisher",
    "Plan",
    "Transport",
    "keep_wire_rounding",
    "land",
]

Finisher = Callable[[torch.Tensor], None]
"""Applied to each of this rank's finished segments before they are passed on."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """When the collective ``op`` must have completed on this rank (``time.monotonic``)."""

    op: str
    expires: float
    timeout_s: float

    @classmethod
    def after(cls, timeout_s: float, *, op: str) -> Deadline:
        return cls(op=op, expires=time.monotonic() + timeout_s, timeout_s=timeout_s)

    def remaining(self) -> float:
        return self.expires - time.monotonic()


class Plan:
    """One collective on this rank: its schedule, built only when a transport asks for it.

    Args:
        build: makes the schedule.
        key: names everything the schedule depends on (operation, the tensor's address, length
            and dtype, the reduction), so a transport may reuse what it prepared for an equal
            key instead of building the schedule again; ``None``: do not reuse.
        keep: what must stay alive until the device has finished the collective.
        operand: for an all-reduce, the (flat, contiguous) tensor reduced in place and the
            reduction, for a transport that can run the whole collective otherwise than by
            the schedule.
    """

    __slots__ = ("_build", "_schedule", "keep", "key", "operand")

    def __init__(
        self,
        build: Callable[[], Schedule],
        *,
        key: tuple | None = None,
        keep: object = None,
        operand: tuple[torch.Tensor, str] | None = None,
    ) -> None:
        self._build, self._schedule = build, None
        self.key, self.keep, self.operand = key, keep, operand

    @property
    def schedule(self) -> Schedule:
        if self._schedule is None:
            self._schedule = self._build()
        return self._schedule


class Completion(abc.ABC):
    """Device work a transport enqueued and returned without waiting for."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Return once the work finished; raise ``PeerLostError`` by its deadline if not."""


class Transport(abc.ABC):
    """Moves segments to the right neighbour and from the left one.

    ``run`` raises ``PeerLostError`` (``CollectiveTimeoutError`` once ``deadline`` passed)
    naming the peer judged lost; the transport is unusable afterwards.
    """

    name: str
    wavefront: bool
    """Whether this transport wants its schedules as a wavefront (see ``_schedule``)."""
    inline: bool = False
    """``run`` only enqueues device work and returns a ``Completion``: it can run on the
    caller's thread. Otherwise ``run`` does the work itself, on a thread of its own."""
    pipeline_depth: int = 8
    """Segments per chunk wanted, so that hops overlap."""
    segment_range: tuple[int, int] = (256 << 10, 4 << 20)
    """The smallest and largest segment: below, per-segment costs outweigh pipelining."""

    @abc.abstractmethod
    def run(
        self,
        plan: Plan,
        *,
        wire: torch.dtype,
        finish: Finisher | None,
        deadline: Deadline,
    ) -> Completion | None:
        """Issue every hop of ``plan.schedule``; segments travel as ``wire``."""

    def check(self) -> None:
        """Raise the failure of device work whose completion was already waited for (see
        ``Collective.check``); transports that wait on the host have none."""
        return None

    def close(self) -> None:
        return None


def land(hop: Hop, received: torch.Tensor, finish: Finisher | None) -> None:
    """Fold a received segment into the hop's destination."""
    assert hop.recv is not None
    if hop.reduce:
        hop.recv.add_(received)
    elif received is not hop.recv:
        hop.recv.copy_(received)
    if hop.final and finish is not None:
        finish(hop.recv)


def keep_wire_rounding(hop: Hop, wired: torch.Tensor) -> None:
    """After sending a finished segment narrowed to ``wired``, hold the same values locally."""
    if hop.owned and wired.dtype != hop.send.dtype:
        hop.send.copy_(wired)
