"""Why a flow run resumed, and roughly how much work it lost: logged and kept as an artifact."""

from __future__ import annotations

from datetime import datetime

from prefect import get_client
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from ringflow.storage import CommittedCheckpoint

__all__ = ["report_resume"]


def report_resume(
    checkpoints: list[CommittedCheckpoint], run_key: str, step: int, attempt: int
) -> None:
    """Log why this run resumed and roughly how many steps it lost; add a ``resume`` artifact."""
    cause, crashed_at = _last_failure()
    lost = _steps_lost(checkpoints, step, crashed_at)
    lost_text = "unknown" if lost is None else f"about {lost} (step rate x time to the crash)"
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


def _last_failure() -> tuple[str, datetime | None]:
    """What ended this flow run's previous start (a Crashed, Failed or AwaitingRetry state)."""
    run_id = flow_run.get_id()
    states = []
    if run_id is not None:
        with get_client(sync_client=True) as client:
            states = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
    current = max((i for i, s in enumerate(states) if s.is_running()), default=len(states))
    # Back from the current start: the newest crash or failure before it (the worker's and
    # the automations' states are timestamped by different processes, so do not assume they
    # sit between two Running states), else the newest rescheduling.
    earlier = states[:current]
    for state in reversed(earlier):
        if state.is_crashed() or state.is_failed():
            return f"{state.name}: {state.message}", state.timestamp
    for state in reversed(earlier):
        if state.is_scheduled() and state.name != "Scheduled":
            return f"{state.name}: {state.message}", state.timestamp
    return "an earlier run under the same run key stopped", None


def _steps_lost(
    checkpoints: list[CommittedCheckpoint], step: int, ended: datetime | None
) -> int | None:
    """Steps trained after checkpoint ``step`` and lost, from the step rate between checkpoints.

    An upper bound where the crash was noticed late (a lost host is marked Crashed only after
    its heartbeats have been missing for a while).
    """
    before = [c for c in checkpoints if c.step <= step]
    if ended is None or len(before) < 2:
        return None
    (a, b) = (before[-2], before[-1])
    times = [datetime.fromisoformat(c.created) for c in (a, b)]
    rate = (b.step - a.step) / max((times[1] - times[0]).total_seconds(), 1e-3)
    return max(0, round(rate * (ended - times[1]).total_seconds()))
