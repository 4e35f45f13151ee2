"""A deployed train-pipeline run comes back by itself after its process or its host is killed.

The e2e tests start the real stack (Prefect server, Ray head, process worker) through
deployments/start.sh and deploy.sh on ports and state of their own, submit a
``train-pipeline/local`` run, kill it mid-training with SIGKILL and then only watch: the
automations that deploy.sh applies must bring the same flow run back, and it must end with
the weights of an uninterrupted run, bit for bit. The loop guards are tested without a server.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]

EPOCHS, CHECKPOINT_EVERY, HIDDEN = 60, 5, 32
PARAMS = {
    "tune_trials": 0,
    "serve": "false",
    "epochs": EPOCHS,
    "checkpoint_every": CHECKPOINT_EVERY,
    "hparams": json.dumps({"hidden": HIDDEN}),
    "workers": 1,
}


class Stack:
    """The stack of one test: its environment, and calls into its scripts and API."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.storage = state / "storage"
        port = free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = {
            **{
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("PREFECT_", "RAY_ADDRESS", "RINGFLOW_"))
            },
            "RINGFLOW_STATE": str(state),
            "RINGFLOW_POOL": "ringflow-preemption-test",
            "RINGFLOW_PREFECT_PORT": str(port),
            "RINGFLOW_RAY_PORT": str(free_port(6)),
            "RINGFLOW_CPUS": "2",
            "PREFECT_UI_ENABLED": "false",
            # Prefect's shortest heartbeat; a lost host is noticed after two missed ones.
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
            "RINGFLOW_HEARTBEAT_GRACE_SECONDS": "60",
            "COLUMNS": "250",
        }

    def script(self, name: str, timeout: float = 300) -> str:
        done = subprocess.run(
            [f"./deployments/{name}"],
            cwd=ROOT,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        return done.stdout

    def prefect(self, *args: str) -> str:
        done = subprocess.run(
            ["bash", "-c", '. deployments/env.sh && exec prefect "$@"', "prefect", *args],
            cwd=ROOT,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    def submit(self) -> str:
        params = [a for k, v in PARAMS.items() for a in ("--param", f"{k}={v}")]
        out = self.prefect("deployment", "run", "train-pipeline/local", *params)
        return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)

    def flow_run(self, run_id: str) -> dict:
        return httpx.get(f"{self.api}/flow_runs/{run_id}", timeout=30).raise_for_status().json()

    def states(self, run_id: str) -> list[dict]:
        reply = httpx.get(f"{self.api}/flow_run_states/", params={"flow_run_id": run_id})
        return sorted(reply.raise_for_status().json(), key=lambda s: s["timestamp"])

    def artifact(self, run_id: str, key: str) -> str:
        body = {"artifacts": {"flow_run_id": {"any_": [run_id]}, "key": {"any_": [key]}}}
        reply = httpx.post(f"{self.api}/artifacts/filter", json=body, timeout=30)
        found = reply.raise_for_status().json()
        assert found, f"flow run {run_id} has no {key!r} artifact"
        return found[0]["data"]

    def worker(self) -> int:
        return int((self.state / "run" / "prefect-worker.pid").read_text())

    def automations(self) -> list[dict]:
        reply = httpx.post(f"{self.api}/automations/filter", json={}, timeout=30)
        return reply.raise_for_status().json()

    def logs(self) -> str:
        return "".join(
            f"\n--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}"
            for log in sorted((self.state / "logs").glob("*.log"))
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One stack for the module's tests: starting and deploying it takes over a minute."""
    stack = Stack(tmp_path_factory.mktemp("preemption") / "state")
    try:
        stack.script("start.sh")
        stack.script("deploy.sh")
        yield stack
    finally:
        subprocess.run(["./deployments/stop.sh"], cwd=ROOT, env=stack.env, timeout=180)


def _wait_for_first_checkpoint(stack: Stack, run_id: str) -> None:
    from ringflow.storage import CheckpointStore

    store = CheckpointStore(str(stack.storage / "checkpoints"))
    deadline = time.monotonic() + 180
    while not store.checkpoints(run_id):
        state = stack.flow_run(run_id)["state"]
        assert state["type"] in {"SCHEDULED", "PENDING", "RUNNING"}, state
        assert time.monotonic() < deadline, "no checkpoint within 3 minutes" + stack.logs()
        time.sleep(0.2)
    # A random point in training, not just the first checkpoint.
    time.sleep(random.uniform(0, 2))


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, parents before children (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def _flow_process(stack: Stack, run_id: str) -> int:
    """The process the worker started for ``run_id`` (the outermost one with its id)."""
    wanted = f"PREFECT__FLOW_RUN_ID={run_id}".encode()
    for pid in _descendants(stack.worker()):
        try:
            if wanted in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no process of flow run {run_id} under the worker")


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants at once, as a preempted machine would."""
    procs = [pid, *_descendants(pid)]
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() and not _is_zombie(p) for p in procs):
        assert time.monotonic() < deadline, f"processes {procs} outlived SIGKILL"
        time.sleep(0.1)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_until_completed(stack: Stack, run_id: str, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        run = stack.flow_run(run_id)
        if run["state"]["type"] == "COMPLETED":
            return run
        assert run["state"]["type"] not in {"FAILED", "CANCELLED"}, run["state"]
        assert time.monotonic() < deadline, (
            f"flow run {run_id} still {run['state']['name']} after {seconds} s; states "
            f"{[s['name'] for s in stack.states(run_id)]}" + stack.logs()
        )
        time.sleep(2)


def _summary(stack: Stack, run_id: str) -> dict[str, str]:
    rows = re.findall(r"^\| (\w+) \| `(.*)` \|$", stack.artifact(run_id, "run-summary"), re.M)
    return dict(rows)


def _assert_resumed_bit_for_bit(stack: Stack, run_id: str, tmp_path: Path) -> dict[str, str]:
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.models.digits import DigitsClassifier
    from ringflow.storage import load_model

    summary = _summary(stack, run_id)
    assert summary["run_key"] == run_id
    assert int(summary["resumed_from_step"]) >= CHECKPOINT_EVERY
    assert int(summary["run_count"]) >= 2
    resume = stack.artifact(run_id, "resume")
    assert "resumed from step" in resume
    assert "Crashed" in resume, resume

    reference = fit(
        DigitsClassifier,
        hparams=ast.literal_eval(summary["hparams"]),
        data=DataSpec(dataset_url=summary["dataset_url"]),
        config=TrainConfig(
            workers=1, epochs=EPOCHS, batch_size=64, seed=0, checkpoint_every=CHECKPOINT_EVERY
        ),
        checkpoint_uri=str(tmp_path / "reference"),
        in_process=True,
    )
    resumed, _ = load_model(summary["checkpoint"])
    for name, tensor in reference.state_dict.items():
        assert torch.equal(resumed.state_dict()[name], tensor), name
    return summary


@pytest.mark.e2e
def test_a_killed_flow_process_is_rescheduled_and_resumes_bit_for_bit(stack, tmp_path):
    run_id = stack.submit()
    _wait_for_first_checkpoint(stack, run_id)
    _kill_tree(_flow_process(stack, run_id))

    run = _wait_until_completed(stack, run_id, 180)
    assert run["run_count"] >= 2
    names = [s["name"] for s in stack.states(run_id)]
    assert "Crashed" in names, names
    assert "AwaitingRetry" in names, names
    _assert_resumed_bit_for_bit(stack, run_id, tmp_path)
    resume = stack.artifact(run_id, "resume")
    assert "SIGKILL" in resume, resume
    assert re.search(r"\| steps lost \| about \d+", resume), resume

    # Applying the automations again (a second deploy) updates them, never duplicates them.
    before = {a["name"]: a["id"] for a in stack.automations()}
    stack.script("deploy.sh")
    after = [(a["name"], a["id"]) for a in stack.automations()]
    assert sorted(after) == sorted(before.items()), after
    assert len(after) == 2, after
    # Every worker gives the flow process the heartbeat the automations count on.
    deployment = httpx.get(f"{stack.api}/deployments/name/train-pipeline/local").json()
    assert deployment["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
    assert deployment["tags"] == ["auto-resume"]


@pytest.mark.e2e
def test_a_run_on_a_lost_host_is_crashed_rescheduled_and_resumes_bit_for_bit(stack, tmp_path):
    run_id = stack.submit()
    _wait_for_first_checkpoint(stack, run_id)
    _kill_tree(stack.worker())  # the worker and the flow process with it: the host is gone
    assert stack.flow_run(run_id)["state"]["type"] == "RUNNING"
    stack.script("start.sh")  # a new worker, standing for a replacement host

    run = _wait_until_completed(stack, run_id, 240)
    assert run["run_count"] >= 2
    crashed = [s for s in stack.states(run_id) if s["type"] == "CRASHED"]
    assert crashed, [s["name"] for s in stack.states(run_id)]
    assert "No heartbeat" in crashed[0]["message"], crashed[0]
    _assert_resumed_bit_for_bit(stack, run_id, tmp_path)
    assert "No heartbeat" in stack.artifact(run_id, "resume")


def _automations_module():
    """deployments/automations.py, a script rather than a package module, imported by path."""
    name = "ringflow_deployment_automations"
    if name not in sys.modules:
        path = ROOT / "deployments" / "automations.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_the_reschedule_automation_stops_after_max_restarts():
    automations = _automations_module()
    policy = automations.ResumePolicy(max_restarts=2)
    crash_silent, reschedule = automations.automations(policy)
    allowed = reschedule.trigger.match.root["prefect.run-count"]
    # A run that never started (0) or has already started 1 + max_restarts times stays Crashed.
    assert allowed == ["1", "2"]
    assert reschedule.actions[0].name == "AwaitingRetry"
    assert crash_silent.trigger.within.total_seconds() == policy.grace_seconds
    for bad in ({"heartbeat_seconds": 10}, {"grace_seconds": 30}, {"max_restarts": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            automations.ResumePolicy(**bad)


def test_the_flow_refuses_a_start_beyond_max_restarts(monkeypatch, tmp_path):
    import ringflow.flows.train_pipeline as pipeline

    monkeypatch.setattr(pipeline.flow_run, "get_run_count", lambda: 4)
    refused = pipeline.train_pipeline.fn(storage_url=str(tmp_path), max_restarts=2)
    assert refused.is_failed()
    assert "max_restarts" in refused.message
    assert not any(tmp_path.iterdir()), "the refused run did work"
