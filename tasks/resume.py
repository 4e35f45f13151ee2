"""Why a flow run resumed, and how many steps it lost: logged and kept as an artifact."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import get_client
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from ringflow.storage import CommittedCheckpoint
from ringflow.storage.lease import LeaseError, LeaseRecord, read_lease

__all__ = ["StepsLost", "report_resume", "steps_lost"]


@dataclass(frozen=True, kw_only=True)
class StepsLost:
    """Steps the start that ended trained after the checkpoint resumed from, by step counts."""

    at_least: int
    """Steps up to the newest checkpoint the ended start began writing."""
    at_most: int
    """``at_least`` plus the steps before its next checkpoint was due."""
    reached: int
    """The newest step the ended start began a checkpoint of."""
    every: int
    """Steps between its checkpoints."""

    def __str__(self) -> str:
        span = (
            f"{self.at_least}"
            if self.at_least == self.at_most
            else f"{self.at_least} to {self.at_most}"
        )
        return (
            f"{span} (the stopped start had begun a checkpoint at step {self.reached} and "
            f"none later; checkpoints every {self.every} steps)"
        )


def report_resume(
    checkpoints: list[CommittedCheckpoint], run_key: str, step: int, attempt: int
) -> None:
    """Log why this run resumed and how many steps it lost; add a ``resume`` artifact.

    Args:
        checkpoints: the run key's committed checkpoints, listed before training.
        step: the step training resumed from.
        attempt: this start's number (the flow run's ``run_count``).
    """
    cause = _cause()
    lease = _lease(checkpoints)
    lost = steps_lost(checkpoints, step, lease)
    lost_text = "unknown (no record of the stopped start)" if lost is None else str(lost)
    get_run_logger().warning(
        "start %d of run %s resumed at step %d after: %s; steps lost: %s",
        attempt,
        run_key,
        step,
        cause,
        lost_text,
    )
    create_markdown_artifact(
        key="resume",
        markdown=f"| | |\n|---|---|\n| start | {attempt} |\n| cause | {cause} |\n"
        f"| resumed from step | {step} |\n| steps lost | {lost_text} |\n",
        description=f"Why start {attempt} of this run resumed, and from where",
    )


def steps_lost(
    checkpoints: list[CommittedCheckpoint], step: int, lease: LeaseRecord | None
) -> StepsLost | None:
    """Steps trained after checkpoint ``step`` and lost, from the step counts the lease of
    this start recorded when it took the run key over (``tasks.train``).

    The stopped start had reached at least the newest step it began a checkpoint of, and
    was killed before its next checkpoint was begun. A checkpoint it had asked for but not
    yet begun writing (storage slower than the interval) is not seen.
    """
    took_over = (lease.note.get("took_over") if lease is not None else None) or {}
    if not took_over:
        return None
    reached = max(step, took_over.get("reached_step") or step)
    every = lease.note.get("checkpoint_every") or _steps_per_epoch(checkpoints, step)
    if not every:
        return None
    return StepsLost(
        at_least=reached - step, at_most=reached - step + every - 1, reached=reached, every=every
    )


def _steps_per_epoch(checkpoints: list[CommittedCheckpoint], step: int) -> int | None:
    for checkpoint in checkpoints:
        if checkpoint.step == step:
            return checkpoint.metadata.get("steps_per_epoch")
    return None


def _lease(checkpoints: list[CommittedCheckpoint]) -> LeaseRecord | None:
    if not checkpoints:
        return None
    try:
        return read_lease(checkpoints[-1].url.rsplit("/", 1)[0])
    except (LeaseError, OSError) as err:
        get_run_logger().warning("the run key's lease could not be read: %s", err)
        return None


def _cause() -> str:
    """What ended this flow run's previous start: the first Crashed or Failed state after
    that start began, i.e. the report of the crash itself, not a later duplicate of it."""
    run_id = flow_run.get_id()
    states = []
    if run_id is not None:
        with get_client(sync_client=True) as client:
            states = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
    starts = [i for i, s in enumerate(states) if s.is_running()]
    current = starts[-1] if starts else len(states)
    previous = starts[-2] if len(starts) > 1 else -1
    between = states[previous + 1 : current]
    ended = [s for s in between if s.is_crashed() or s.is_failed()]
    ended = ended or [s for s in between if s.is_scheduled() and s.name != "Scheduled"]
    # A state another process timestamped out of order: the newest such before this start.
    ended = ended or [s for s in states[:current] if s.is_crashed() or s.is_failed()][-1:]
    if ended:
        return f"{ended[0].name}: {ended[0].message}"
    return "an earlier run under the same run key stopped"
