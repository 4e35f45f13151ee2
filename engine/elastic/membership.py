"""How a layout's workers live through losing one: the layout says which (``Layout.membership``),
the worker group (``engine.group``) carries it out, and neither the group nor ``fit`` asks which
layout it runs.

- :class:`Elastic` (data-parallel workers; a pipeline's replicas on CPU): the members commit
  in memory, a lost unit leaves and the others go on or roll back to their last commit, a
  replacement joins at a later commit, and a restarted driver of the run may adopt them.
- :class:`Fixed` (a pipeline's replicas on GPUs, which share one NCCL world that is not
  rebuilt around a lost one): nothing is committed in memory, and a lost worker fails the run
  naming it; a retried run resumes from its last checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ringflow.engine.elastic.coordinator import Coordinator, FailurePolicy

if TYPE_CHECKING:
    from ringflow.engine.config import TrainConfig

__all__ = ["Elastic", "Fixed", "Group", "Membership"]


class Group(Protocol):
    """What a membership asks of the worker group (``engine.group.RayWorkerGroup``)."""

    def commit_in_memory(self, step: int) -> None: ...

    def on_commit(self, step: int, *, admit: bool) -> None: ...

    def rebuild(self, lost: Any, *, at_step: int) -> Any: ...

    def failed(self, lost: Any) -> Exception: ...


class Membership:
    """What a worker group does when its membership changes; see the module docstring."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    def coordinator(self, units: list[str]) -> Coordinator:
        """The coordinator that decides who the members are, over the first ``units``."""
        raise NotImplementedError

    def adoptable(self, run: str | None) -> str | None:
        """The run whose workers, left by a lost driver, this group may adopt (``None``:
        none)."""
        raise NotImplementedError

    def step_options(self, *, commit_at: int | None, run_next: bool) -> dict[str, Any]:
        """What ``Worker.train_steps`` is told besides its steps: where to commit, and
        whether to run the next call's first step before it waits for this one."""
        raise NotImplementedError

    def commit(self, group: Group, step: int) -> None:
        """The members' state at ``step`` kept to go on from (where it is kept)."""

    def committed(self, group: Group, step: int, *, admit: bool) -> None:
        """The members committed ``step`` at the end of their steps (``step_options``);
        ``admit``: ready replacements may join there."""

    def recover(self, group: Group, lost: Any, *, at_step: int) -> Any:
        """Go on after ``lost`` (``engine.group.MembershipLost``) at ``at_step``: where
        training goes on (``engine.group.Recovery``), or raise why it cannot."""
        raise NotImplementedError


class Elastic(Membership):
    """Lost units leave, the others go on (or roll back to their last in-memory commit),
    replacements join; a restarted driver of the run may adopt the workers."""

    def coordinator(self, units: list[str]) -> Coordinator:
        return Coordinator(
            units,
            min_workers=self.config.min_workers or self.config.workers,
            max_workers=self.config.workers,
            policy=FailurePolicy(max_failures=self.config.max_failures),
        )

    def adoptable(self, run: str | None) -> str | None:
        return run

    def step_options(self, *, commit_at: int | None, run_next: bool) -> dict[str, Any]:
        options: dict[str, Any] = {} if commit_at is None else {"commit_at": commit_at}
        return {**options, "run_next": True} if run_next else options

    def commit(self, group: Group, step: int) -> None:
        group.commit_in_memory(step)
        group.on_commit(step, admit=True)

    def committed(self, group: Group, step: int, *, admit: bool) -> None:
        group.on_commit(step, admit=admit)

    def recover(self, group: Group, lost: Any, *, at_step: int) -> Any:
        return group.rebuild(lost, at_step=at_step)


class Fixed(Membership):
    """Every worker is needed to the end: a lost one fails the run, naming it."""

    def coordinator(self, units: list[str]) -> Coordinator:
        return Coordinator(
            units,
            min_workers=len(units),
            max_workers=self.config.workers,
            policy=FailurePolicy(max_failures=0),
        )

    def adoptable(self, run: str | None) -> str | None:
        return None

    def step_options(self, *, commit_at: int | None, run_next: bool) -> dict[str, Any]:
        return {}

    def recover(self, group: Group, lost: Any, *, at_step: int) -> Any:
        raise group.failed(lost) from lost
