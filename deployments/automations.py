"""The automations that bring a preempted ``train-pipeline`` run back: run by deploy.sh.

Prefect retries a flow run whose code raised (``retries=`` on the flow), but not one whose
process or host died: a killed flow process is marked Crashed by its worker and never retried
(PrefectHQ/prefect#10211), a run whose worker died with it stays Running forever, and one
whose worker died after taking it, before its flow process ran, stays Pending forever (run
count 0: no worker looks at a Pending run again; PrefectHQ/prefect#20485, #22664). Five
automations close these gaps for the deployments tagged ``RINGFLOW_RESUME_TAG``:

* ``ringflow: crash silent runs``: a run that sent a heartbeat and then neither another one
  nor a final state within ``RINGFLOW_HEARTBEAT_GRACE_SECONDS`` is marked Crashed.
* ``ringflow: crash runs lost before they started``: a run that entered a Pending state
  (``Pending``, ``Submitting``, ``InfrastructurePending``) and then sent no further event (no
  Running, no heartbeat, no other state) within ``RINGFLOW_HEARTBEAT_GRACE_SECONDS`` is
  marked Crashed: the worker that took it died before or while it started the flow process.
* ``ringflow: reschedule killed runs``: when a worker reports that the process of a run
  ended by a signal (SIGKILL, SIGTERM: the ``prefect.worker.executed-flow-run`` event with
  status code -9, -15, 137 or 143), the run is put back to Scheduled (``AwaitingRetry``).
  The worker sends that event once per process, after its last report of the crash: the
  process worker reports a crash twice (once at the exit, again after loading the flow to
  look for ``on_crashed`` hooks), and acting on the Crashed states would restart the run a
  second time beside the first restart. By then the run is Crashed, a final state that the
  late report cannot change.
* ``ringflow: reschedule silent runs``: a run the first automation marked Crashed (no worker
  is left to report it) is put back to Scheduled, while it has started at most
  ``RINGFLOW_MAX_RESTARTS`` times: that is the server's guard against a crash loop.
* ``ringflow: reschedule runs lost before they started``: a run the Pending automation marked
  Crashed is put back to Scheduled, while it has started at most ``RINGFLOW_MAX_RESTARTS``
  times (a run lost before its first start has started 0 times).

The reschedules act without ``force``: the server refuses to reschedule a Completed run.
The same flow run, with the same id and so the same checkpoints, then runs again on any
worker of its pool; its ``train`` task holds the run key's lease (``storage.lease``), so a
start of it that finds another one alive steps aside instead of training beside it.

Applying them is idempotent: an automation of the same name is updated in place, duplicates
are deleted, and ones of this script's older versions are removed. Run
``python deployments/automations.py --help`` for the settings.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

from prefect import get_client
from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

__all__ = ["ResumePolicy", "apply", "automations", "retire_old", "unwatched"]

CRASH_SILENT = "ringflow: crash silent runs"
CRASH_UNSTARTED = "ringflow: crash runs lost before they started"
RESCHEDULE_KILLED = "ringflow: reschedule killed runs"
RESCHEDULE_SILENT = "ringflow: reschedule silent runs"
RESCHEDULE_UNSTARTED = "ringflow: reschedule runs lost before they started"
RETIRED = ("ringflow: reschedule crashed runs",)
"""Names this script used before; applying removes them."""
KILLED_STATUS_CODES = ["-*", "137", "143"]
"""Exit statuses of a flow process ended by a signal: negative (the process worker), or
128 + SIGKILL/SIGTERM (container runtimes). A process that exits 1 failed in its code."""
SILENT_MESSAGE = "No heartbeat for"
UNSTARTED_MESSAGE = "Lost before it started"
PENDING_STATES = ("Pending", "Submitting", "InfrastructurePending")
"""The names of Prefect's Pending states: a worker took the run (``Pending``) and starts its
flow process (``Submitting``, ``InfrastructurePending``); the process then proposes Running."""
_FINAL_EVENTS = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}


@dataclass(frozen=True, kw_only=True)
class ResumePolicy:
    """When a run counts as lost, and how often it is brought back."""

    tag: str = "auto-resume"
    """Only flow runs of deployments with this tag are watched and rescheduled."""
    heartbeat_seconds: int = 30
    """``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` of the flow processes (Prefect's minimum is 30)."""
    grace_seconds: int = 90
    """A run silent for this long after a heartbeat is marked Crashed."""
    max_restarts: int = 3
    """A run marked Crashed for its silence is rescheduled only while it has started at most
    this many times; a killed one, by the flow's own ``max_restarts`` check."""

    def __post_init__(self) -> None:
        if not self.tag:
            raise ValueError("tag (RINGFLOW_RESUME_TAG) must not be empty")
        if self.heartbeat_seconds < 30:
            raise ValueError(
                f"heartbeat_seconds (PREFECT_FLOWS_HEARTBEAT_FREQUENCY) must be at least 30, "
                f"got {self.heartbeat_seconds}"
            )
        if self.grace_seconds <= self.heartbeat_seconds:
            raise ValueError(
                f"grace_seconds (RINGFLOW_HEARTBEAT_GRACE_SECONDS, {self.grace_seconds}) must be "
                f"longer than heartbeat_seconds ({self.heartbeat_seconds}); 3x is a safe margin"
            )
        if not 0 <= self.max_restarts <= 100:
            raise ValueError(
                f"max_restarts (RINGFLOW_MAX_RESTARTS) must be in 0..100, got {self.max_restarts}"
            )

    @classmethod
    def from_env(cls) -> ResumePolicy:
        """The policy that deployments/env.sh describes."""
        heartbeat = int(os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30"))
        return cls(
            tag=os.environ.get("RINGFLOW_RESUME_TAG", "auto-resume"),
            heartbeat_seconds=heartbeat,
            grace_seconds=int(os.environ.get("RINGFLOW_HEARTBEAT_GRACE_SECONDS", 3 * heartbeat)),
            max_restarts=int(os.environ.get("RINGFLOW_MAX_RESTARTS", "3")),
        )


def automations(policy: ResumePolicy) -> list[Automation]:
    """The five automations of ``policy``, ready to apply."""
    tagged = ResourceSpecification({"prefect.resource.id": f"prefect.tag.{policy.tag}"})
    crash_silent = _crash_when_quiet(
        CRASH_SILENT,
        tagged,
        policy,
        description=(
            f"Marks a flow run tagged {policy.tag!r} Crashed when it sends no heartbeat for "
            f"{policy.grace_seconds} s: its process or host is gone. Created by "
            "deployments/automations.py."
        ),
        after={"prefect.flow-run.heartbeat"},
        expect={"prefect.flow-run.heartbeat", *_FINAL_EVENTS},
        message=(
            f"{SILENT_MESSAGE} {policy.grace_seconds} s: the flow run's process or its "
            "host was lost (ringflow automation)"
        ),
    )
    crash_unstarted = _crash_when_quiet(
        CRASH_UNSTARTED,
        tagged,
        policy,
        description=(
            f"Marks a flow run tagged {policy.tag!r} Crashed when it stays in a Pending state "
            f"for {policy.grace_seconds} s with no sign of its flow process: the worker that "
            "took it was lost before the process ran. Created by deployments/automations.py."
        ),
        # Each Pending state starts the wait again; any later event of the run (Running,
        # a heartbeat, a final or a Scheduled state) ends it.
        after={f"prefect.flow-run.{name}" for name in PENDING_STATES},
        expect={"prefect.flow-run.*"},
        message=(
            f"{UNSTARTED_MESSAGE}: Pending for {policy.grace_seconds} s and no flow "
            "process ran it; the worker that took it was lost (ringflow automation)"
        ),
    )
    reschedule_killed = Automation(
        name=RESCHEDULE_KILLED,
        description=(
            f"Puts a flow run tagged {policy.tag!r} whose process a signal ended back to "
            "Scheduled, once per process, after its worker has reported the crash, so it "
            "resumes from its checkpoints. Created by deployments/automations.py."
        ),
        trigger=EventTrigger(
            posture=Posture.Reactive,
            expect={"prefect.worker.executed-flow-run"},
            match=ResourceSpecification({"prefect.resource.id": "prefect.worker.*"}),
            match_related=[
                tagged,
                ResourceSpecification(
                    {
                        "prefect.resource.role": "flow-run",
                        "prefect.infrastructure.status-code": KILLED_STATUS_CODES,
                    }
                ),
            ],
            for_each={"related:flow-run:prefect.resource.id"},
            threshold=1,
            within=timedelta(0),
        ),
        actions=[_reschedule(policy, "after its process was killed")],
    )
    reschedule_silent = _reschedule_crashed(
        RESCHEDULE_SILENT,
        tagged,
        policy,
        description=(
            f"Puts a flow run tagged {policy.tag!r} that was marked Crashed for its silence "
            f"back to Scheduled, while it has started at most {policy.max_restarts} times. "
            "Created by deployments/automations.py."
        ),
        message=f"{SILENT_MESSAGE} *",
        # The loop guard, on the server: a run that crashed before it ever ran (run count 0)
        # or has used its restarts is left Crashed.
        run_counts=range(1, policy.max_restarts + 1),
        why="after its heartbeats stopped",
    )
    reschedule_unstarted = _reschedule_crashed(
        RESCHEDULE_UNSTARTED,
        tagged,
        policy,
        description=(
            f"Puts a flow run tagged {policy.tag!r} that was marked Crashed before it started "
            f"back to Scheduled, while it has started at most {policy.max_restarts} times. "
            "Created by deployments/automations.py."
        ),
        message=f"{UNSTARTED_MESSAGE}: *",
        # Lost before its first start (0), or before a restart of one that has restarts left.
        run_counts=range(policy.max_restarts + 1),
        why="after its worker was lost before it started",
    )
    return [
        crash_silent,
        crash_unstarted,
        reschedule_killed,
        reschedule_silent,
        reschedule_unstarted,
    ]


def _crash_when_quiet(
    name: str,
    tagged: ResourceSpecification,
    policy: ResumePolicy,
    *,
    description: str,
    after: set[str],
    expect: set[str],
    message: str,
) -> Automation:
    """Marks a tagged flow run Crashed (``message``) when, after one of the events ``after``,
    none of ``expect`` follows within the grace period."""
    return Automation(
        name=name,
        description=description,
        trigger=EventTrigger(
            posture=Posture.Proactive,
            after=after,
            expect=expect,
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=tagged,
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(seconds=policy.grace_seconds),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=message)],
    )


def _reschedule_crashed(
    name: str,
    tagged: ResourceSpecification,
    policy: ResumePolicy,
    *,
    description: str,
    message: str,
    run_counts: range,
    why: str,
) -> Automation:
    """Puts a tagged flow run back to Scheduled once it is marked Crashed with a state
    message matching ``message`` while its run count is one of ``run_counts``."""
    return Automation(
        name=name,
        description=description,
        trigger=EventTrigger(
            posture=Posture.Reactive,
            expect={"prefect.flow-run.Crashed"},
            match=ResourceSpecification(
                {
                    "prefect.resource.id": "prefect.flow-run.*",
                    "prefect.state-message": message,
                    "prefect.run-count": [str(n) for n in run_counts],
                }
            ),
            match_related=tagged,
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(0),
        ),
        actions=[_reschedule(policy, why)],
    )


def _reschedule(policy: ResumePolicy, why: str) -> ChangeFlowRunState:
    return ChangeFlowRunState(
        state=StateType.SCHEDULED,
        name="AwaitingRetry",
        message=(
            f"Rescheduled {why}, to resume from its latest checkpoint (ringflow automation; "
            f"at most {policy.max_restarts} restarts)"
        ),
    )


WATCHED_FLOWS = ("train-pipeline", "horovod-train", "score-pipeline")
"""ringflow's flows: a deployment of one of them is checked for what resuming needs."""


def unwatched(deployments: list[dict], policy: ResumePolicy, names: set[str]) -> list[str]:
    """One warning per deployment of a ringflow flow (or named in ``names``: a project's
    own) whose runs a preemption would leave Crashed: without ``policy.tag``, which the
    automations watch, or without ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` in its job variables'
    ``env``, by which a lost host is noticed. Each deployment is a dict with ``flow``,
    ``name``, ``tags`` and ``job_variables``."""
    warnings = []
    for deployment in deployments:
        if deployment["flow"] not in WATCHED_FLOWS and deployment["name"] not in names:
            continue
        env = (deployment.get("job_variables") or {}).get("env") or {}
        missing = [f"the tag {policy.tag!r}"] if policy.tag not in deployment["tags"] else []
        if "PREFECT_FLOWS_HEARTBEAT_FREQUENCY" not in env:
            missing.append("job_variables.env.PREFECT_FLOWS_HEARTBEAT_FREQUENCY")
        if missing:
            warnings.append(
                f"warning: deployment {deployment['flow']}/{deployment['name']} lacks "
                f"{' and '.join(missing)}: a preempted run of it is not brought back "
                "(docs/own-model.md has a prefect.yaml that has both)"
            )
    return warnings


def deployed() -> list[dict]:
    """The server's deployments, as :func:`unwatched` reads them."""
    with get_client(sync_client=True) as client:
        flows = {flow.id: flow.name for flow in client.read_flows()}
        return [
            {
                "flow": flows.get(d.flow_id, ""),
                "name": d.name,
                "tags": list(d.tags or []),
                "job_variables": dict(d.job_variables or {}),
            }
            for d in client.read_deployments()
        ]


def names_in(prefect_file: str | None) -> set[str]:
    """The deployments a ``prefect.yaml`` defines, by name."""
    if prefect_file is None:
        return set()
    import yaml

    with open(prefect_file) as f:
        return {d["name"] for d in (yaml.safe_load(f) or {}).get("deployments") or []}


def retire_old() -> list[str]:
    """Delete the automations of this script's older versions; return their names."""
    removed = []
    with get_client(sync_client=True) as client:
        for name in RETIRED:
            for automation in client.read_automations_by_name(name):
                client.delete_automation(automation.id)
                removed.append(name)
    return removed


def apply(automation: Automation) -> Automation:
    """Create ``automation``, or update the one of the same name; delete any duplicates."""
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(automation.name)
        for duplicate in existing[1:]:
            client.delete_automation(duplicate.id)
    if not existing:
        return automation.create()
    automation.id = existing[0].id
    automation.update()
    return automation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python deployments/automations.py",
        description="Create or update the automations that resume preempted runs.",
        epilog="Settings come from the environment (deployments/env.sh): RINGFLOW_RESUME_TAG, "
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY, RINGFLOW_HEARTBEAT_GRACE_SECONDS, "
        "RINGFLOW_MAX_RESTARTS.",
    )
    parser.add_argument(
        "--prefect-file",
        help="a project's prefect.yaml just deployed: its deployments are checked too",
    )
    args = parser.parse_args(argv)
    try:
        policy = ResumePolicy.from_env()
    except ValueError as err:
        parser.error(str(err))
    for name in retire_old():
        print(f"automation {name!r}: removed (replaced)")
    for automation in automations(policy):
        applied = apply(automation)
        print(f"automation {applied.name!r}: {applied.id}")
    for warning in unwatched(deployed(), policy, names_in(args.prefect_file)):
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
