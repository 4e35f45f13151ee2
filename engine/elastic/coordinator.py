"""The elastic coordinator: who is in the group, and what to do when that changes.

A pure state machine, so tests drive it without a cluster. The driver feeds it what it saw
(a chunk of steps committed, workers lost, a new worker ready) and carries out its decision
on the Ray actors; the coordinator alone decides membership, so every survivor gets the same
answer and no split decision is possible.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ringflow.engine.errors import EngineError

__all__ = [
    "Continue",
    "Coordinator",
    "ElasticEvent",
    "FailurePolicy",
    "GiveUp",
    "Phase",
    "WaitForWorkers",
]


class Phase(enum.Enum):
    RUNNING = "running"
    """Every member trains."""
    RECOVERING = "recovering"
    """Workers were lost; the members roll back to the last commit."""
    WAITING = "waiting"
    """Fewer than the minimum survived; waiting for replacements."""
    FAILED = "failed"
    """The failure budget is spent, or no replacement came in time."""


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    """How many failures a run absorbs, and how fast it retries growing back.

    Args:
        max_failures: worker losses the run survives; one more fails it (``None``: any
            number, where ``max_resets`` is the budget).
        max_resets: membership changes the run goes through, each a reset of the group (a
            loss or a stall, however many workers it took, and a join, however many joined;
            Horovod's ``reset_limit``): one more fails it, and no replacement starts whose
            join would pass it. ``None``: no limit.
        backoff_s: wait before the first attempt to start a replacement; doubled after each
            replacement that fails to start, up to ``max_backoff_s``.
        max_backoff_s: the longest wait between replacement attempts.
    """

    max_failures: int | None = 3
    max_resets: int | None = None
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_failures", "max_resets"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer or None, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be 0 or more, got {value}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"need 0 <= backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}"
            )


@dataclass(frozen=True, kw_only=True)
class ElasticEvent:
    """One membership change, rollback or resume, as logged and reported."""

    kind: str
    """``lost``, ``stalled`` (a deadline passed with every member alive), ``rollback``,
    ``went_on`` (the survivors went on from the step that failed, nothing redone),
    ``recovered`` (the first commit after a loss), ``joined``, ``resumed`` or ``gave_up``."""
    step: int
    """The training step the group is at after the event."""
    workers: int
    """Members after the event."""
    cause: str
    steps_lost: int = 0
    """Steps done since the last commit and redone after it."""
    at: float = field(default_factory=time.time)

    def describe(self) -> str:
        """The event in one line, as runs report it."""
        return (
            f"{self.kind} at step {self.step}: {self.cause} ({self.workers} workers, "
            f"{self.steps_lost} steps lost)"
        )


@dataclass(frozen=True)
class Continue:
    """Roll the members back to ``step`` and train on with them; with ``went_on``, ``step`` is
    where they failed, and they go on from there as they are."""

    members: tuple[str, ...]
    step: int
    went_on: bool = False


@dataclass(frozen=True)
class WaitForWorkers:
    """Too few survived: start ``count`` replacements and wait for them before going on."""

    members: tuple[str, ...]
    count: int
    step: int


@dataclass(frozen=True)
class GiveUp:
    reason: str


Decision = Continue | WaitForWorkers | GiveUp


class Coordinator:
    """Membership and failure policy of one elastic worker group.

    Args:
        members: the starting workers' ids, in rank order.
        min_workers: the fewest members training may go on with.
        max_workers: the most members; a lost worker's place is refilled up to it.
        policy: the failure budget and replacement backoff.
        clock: seconds, for the backoff (tests pass a fake one).
    """

    def __init__(
        self,
        members: Iterable[str],
        *,
        min_workers: int,
        max_workers: int,
        policy: FailurePolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= min_workers <= max_workers:
            raise ValueError(
                f"need 1 <= min_workers <= max_workers, got {min_workers} and {max_workers}"
            )
        self.members = tuple(members)
        if len(self.members) != max_workers or len(set(self.members)) != max_workers:
            raise ValueError(f"start with {max_workers} distinct members, got {self.members}")
        self.min_workers, self.max_workers = min_workers, max_workers
        self.policy = policy or FailurePolicy()
        self.phase = Phase.RUNNING
        self.committed_step = 0
        self.failures = 0
        self.resets = 0
        self.events: list[ElasticEvent] = []
        self._clock = clock
        self._next_spawn_at = 0.0
        self._spawn_failures = 0
        self._recovering = False

    # ------------------------------------------------------------------------ events

    def committed(self, step: int) -> None:
        """Every member finished the steps up to ``step`` and committed them."""
        if self.phase is not Phase.RUNNING:
            raise EngineError(f"commit at step {step} while {self.phase.value}")
        if step < self.committed_step:
            raise EngineError(f"commit at step {step} is behind the last, {self.committed_step}")
        self.committed_step = step
        if self._recovering and step > self.events[-1].step:
            self._recovering = False
            self._record("recovered", len(self.members), "first steps done after the loss")

    def lost(
        self, workers: Iterable[str], *, at_step: int, cause: str, reached: int | None = None
    ) -> Decision:
        """``workers`` died or stopped answering while the group worked towards ``at_step``.

        ``reached``: the step every survivor failed at with nothing of it kept (the steps
        before it done by all), where they can go on from instead of rolling back.

        Returns:
            What the driver must do: go on with the survivors from the last commit (or from
            ``reached``, past it, while enough of them are left), wait for replacements
            first, or give up.
        """
        gone = [w for w in dict.fromkeys(workers) if w in self.members]
        if not gone:
            raise EngineError(f"lost workers {list(workers)} are not members {self.members}")
        self.members = tuple(w for w in self.members if w not in gone)
        self.failures += len(gone)
        self.resets += 1
        go_on = (
            reached is not None
            and reached > self.committed_step
            and len(self.members) >= self.min_workers
        )
        lost_steps = 0 if go_on else max(0, at_step - self.committed_step)
        self._record("lost", len(self.members), f"{', '.join(gone)}: {cause}", lost_steps)
        if self._over(self.failures, self.policy.max_failures):
            return self._give_up(
                f"{self.failures} workers lost, more than max_failures="
                f"{self.policy.max_failures}; last: {cause}"
            )
        if self._over(self.resets, self.policy.max_resets):
            return self._give_up(self._resets_spent(cause))
        if not self.members:
            return self._give_up(f"every worker was lost; last: {cause}")
        if len(self.members) < self.min_workers and self.resets_left() == 0:
            return self._give_up(
                f"only {len(self.members)} of the minimum {self.min_workers} workers left, and "
                f"max_resets={self.policy.max_resets} lets no replacement join; last: {cause}"
            )
        if go_on:
            self._recovering = True
            self._record(
                "went_on",
                len(self.members),
                f"from step {reached}, where the survivors were: the steps since the commit "
                f"at step {self.committed_step} keep what the survivors logged",
                step=reached,
            )
            return Continue(self.members, reached, went_on=True)
        self._record(
            "rollback",
            len(self.members),
            f"back to the commit at step {self.committed_step}",
            lost_steps,
        )
        self._recovering = True
        if len(self.members) < self.min_workers:
            self.phase = Phase.WAITING
            count = self.min_workers - len(self.members)
            return WaitForWorkers(self.members, count, self.committed_step)
        self.phase = Phase.RUNNING
        return Continue(self.members, self.committed_step)

    def stalled(self, *, at_step: int, cause: str) -> Decision:
        """A collective passed its deadline while every member was alive and answered: they
        blame each other, so nobody is lost. All roll back to the last commit and go on, as
        after a loss (it counts against the failure budget: a deadline too short for the
        load would otherwise stall the run for ever).
        """
        self.failures += 1
        self.resets += 1
        lost_steps = max(0, at_step - self.committed_step)
        self._record("stalled", len(self.members), cause, lost_steps)
        if self._over(self.resets, self.policy.max_resets):
            return self._give_up(self._resets_spent(cause))
        if self._over(self.failures, self.policy.max_failures):
            return self._give_up(
                f"{self.failures} failures, more than max_failures={self.policy.max_failures}; "
                f"last: every worker was alive but a collective passed its deadline ({cause}): "
                "raise collective_timeout_s if the workers are this slow"
            )
        self._record(
            "rollback",
            len(self.members),
            f"back to the commit at step {self.committed_step}",
            lost_steps,
        )
        self._recovering = True
        return Continue(self.members, self.committed_step)

    def joined(self, workers: Iterable[str], *, cause: str = "capacity came back") -> None:
        """New workers adopted the last commit and are members from now on."""
        new = [w for w in workers if w not in self.members]
        if len(self.members) + len(new) > self.max_workers:
            raise EngineError(
                f"{len(self.members)} members + {len(new)} joining exceed max_workers "
                f"{self.max_workers}"
            )
        if self.resets_left() == 0:
            raise EngineError(f"{', '.join(new)} joining would pass max_resets")
        self.members = self.members + tuple(new)
        self.resets += 1
        self._spawn_failures = 0
        if self.phase is Phase.WAITING and len(self.members) >= self.min_workers:
            self.phase = Phase.RUNNING
        self._record("joined", len(self.members), f"{', '.join(new)}: {cause}")

    def resize(self, max_workers: int) -> None:
        """The group may have ``max_workers`` members from now on (capacity came or went):
        :meth:`vacancies` refill it up to that. Members past it stay until they leave."""
        if max_workers < self.min_workers:
            raise ValueError(
                f"need max_workers >= min_workers ({self.min_workers}), got {max_workers}"
            )
        self.max_workers = max_workers

    def spawn_failed(self, cause: str) -> None:
        """A replacement could not start; back off before the next attempt."""
        self._spawn_failures += 1
        delay = min(
            self.policy.max_backoff_s, self.policy.backoff_s * 2 ** (self._spawn_failures - 1)
        )
        self._next_spawn_at = self._clock() + delay

    def wait_failed(self, cause: str) -> GiveUp:
        """Replacements did not come in time while below the minimum."""
        return self._give_up(
            f"only {len(self.members)} of the minimum {self.min_workers} workers left, and no "
            f"replacement started: {cause}"
        )

    def resumed(self, step: int, *, cause: str) -> None:
        """The run started from a persistent checkpoint at ``step``."""
        self.committed_step = step
        self._record("resumed", len(self.members), cause)

    # ------------------------------------------------------------------------ queries

    def vacancies(self) -> int:
        """How many replacements to start now (0 while backing off, or where no join may
        happen within ``max_resets``)."""
        if self.phase is Phase.FAILED or self._clock() < self._next_spawn_at:
            return 0
        if self.resets_left() == 0:
            return 0
        return max(0, self.max_workers - len(self.members))

    def resets_left(self) -> int | None:
        """Membership changes the run may still go through (``None``: any number)."""
        if self.policy.max_resets is None:
            return None
        return max(0, self.policy.max_resets - self.resets)

    @staticmethod
    def _over(count: int, limit: int | None) -> bool:
        return limit is not None and count > limit

    def _resets_spent(self, cause: str) -> str:
        return (
            f"{self.resets} resets of the group (each loss and each join is one), more than "
            f"max_resets={self.policy.max_resets} (Horovod's reset_limit); last: {cause}"
        )

    def _give_up(self, reason: str) -> GiveUp:
        self.phase = Phase.FAILED
        self._record("gave_up", len(self.members), reason)
        return GiveUp(reason)

    def _record(
        self, kind: str, workers: int, cause: str, steps_lost: int = 0, *, step: int | None = None
    ) -> None:
        self.events.append(
            ElasticEvent(
                kind=kind,
                step=self.committed_step if step is None else step,
                workers=workers,
                cause=cause,
                steps_lost=steps_lost,
            )
        )
