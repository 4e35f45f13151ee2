"""The one real stack of a test run: Prefect server, Ray head and process worker.

Started once for the run by the project's own scripts (``deployments/start.sh`` and
``deploy.sh``) on ports and state of its own, and stopped by ``deployments/stop.sh`` at the
end of the run; the ``stack`` fixture (``tests/conftest.py``) hands it to every e2e test,
which all run on one pytest-xdist worker. Its settings are what every e2e test needs:
Prefect's shortest heartbeat and a short grace for a lost host (preemption), a queued run
asking for its slot every 3 s (concurrency), no UI.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.net import free_port, prefect_api

ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Prefect's, Ray's address and ringflow's settings,
    and with ``extra``: for a command that starts a private Prefect and Ray of its own."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "RAY_ADDRESS", "RINGFLOW_"))
    }
    return {**env, **extra}


class Stack:
    """The run's stack: its environment, and calls into its scripts and API."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.storage = state / "storage"
        port = free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        self.serve_port = free_port()
        """Serve's HTTP port on the Ray head: fixed once the first run serves."""
        self.env = {
            **{
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("PREFECT_", "RAY_ADDRESS", "RINGFLOW_"))
            },
            "RINGFLOW_STATE": str(state),
            "RINGFLOW_POOL": "ringflow-e2e-test",
            "RINGFLOW_PREFECT_PORT": str(port),
            "RINGFLOW_RAY_PORT": str(free_port(6)),
            "RINGFLOW_RAY_DASHBOARD_PORT": str(free_port()),
            "RINGFLOW_SERVE_PORT": str(self.serve_port),
            "RINGFLOW_CPUS": "2",
            "PREFECT_UI_ENABLED": "false",
            # Prefect's shortest heartbeat and 30 s more: a lost host, or a run still Pending
            # that long after a worker took it, is Crashed after 60 s. Shorter, a flow
            # process that takes longer to start on a loaded machine (up to 25 s seen) counts
            # as lost. The preemption tests sit through it (twice for a run lost before it
            # starts).
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
            "RINGFLOW_HEARTBEAT_GRACE_SECONDS": "60",
            # A queued run asks for its slot again this often (Prefect's default is 30 s).
            "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "3",
            "COLUMNS": "250",
        }

    # ------------------------------------------------------------------ scripts and CLI

    def script(self, name: str, *args: str, cwd: Path = ROOT, timeout: float = 300) -> str:
        """Run ``deployments/NAME ARGS...`` in ``cwd``; its output."""
        done = subprocess.run(
            [str(ROOT / "deployments" / name), *args],
            cwd=cwd,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        return done.stdout

    def stop(self) -> None:
        subprocess.run(["./deployments/stop.sh"], cwd=ROOT, env=self.env, timeout=180)

    def prefect_in(
        self, project: Path, command: str, *args: str, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        """A documented ``prefect ...`` command run in a shell in ``project``, as a user runs
        it there after ``. deployments/env.sh`` (so ``$PWD`` is the project)."""
        return subprocess.run(
            ["bash", "-c", '. "$0" && cd "$1" && shift && exec prefect "$@"']
            + [str(ROOT / "deployments" / "env.sh"), str(project), *command.split()[1:], *args],
            cwd=ROOT,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )

    def run_deployment(self, name: str, params: dict) -> str:
        """The flow run ``prefect deployment run NAME --param k=v ...`` creates (a string
        value read as JSON where it is JSON, as the CLI reads it), created through the API,
        without the CLI's seconds of start; its id. The demo and the project tests run the
        CLI itself."""
        deployment = self.get(f"deployments/name/{name}")
        return self.create_run(deployment["id"], {k: _param(v) for k, v in params.items()})

    # ------------------------------------------------------------------ API

    def get(self, path: str) -> dict:
        return prefect_api("GET", f"{self.api}/{path}").json()

    def create_run(self, deployment_id: str, parameters: dict) -> str:
        reply = prefect_api(
            "POST",
            f"{self.api}/deployments/{deployment_id}/create_flow_run",
            json={"parameters": parameters},
        )
        return reply.json()["id"]

    def flow_run(self, run_id: str) -> dict:
        return self.get(f"flow_runs/{run_id}")

    def states(self, run_id: str) -> list[dict]:
        reply = prefect_api("GET", f"{self.api}/flow_run_states/", params={"flow_run_id": run_id})
        return sorted(reply.json(), key=lambda s: s["timestamp"])

    def wait_until_completed(self, run_id: str, seconds: float) -> dict:
        """The flow run once Completed; fails at once if it Failed or was Cancelled."""
        deadline = time.monotonic() + seconds
        while True:
            run = self.flow_run(run_id)
            if run["state"]["type"] == "COMPLETED":
                return run
            assert run["state"]["type"] not in {"FAILED", "CANCELLED"}, run["state"]
            assert time.monotonic() < deadline, (
                f"flow run {run_id} still {run['state']['name']} after {seconds} s; states "
                f"{[s['name'] for s in self.states(run_id)]}" + self.logs()
            )
            time.sleep(0.5)

    def artifact(self, run_id: str, key: str) -> str:
        body = {"artifacts": {"flow_run_id": {"any_": [run_id]}, "key": {"any_": [key]}}}
        reply = httpx.post(f"{self.api}/artifacts/filter", json=body, timeout=30)
        found = reply.raise_for_status().json()
        assert found, f"flow run {run_id} has no {key!r} artifact"
        return found[0]["data"]

    def run_log(self, run_id: str) -> str:
        """The messages a flow run logged to the server, one a line, oldest first."""
        messages: list[str] = []
        while True:  # the server answers a page at a time
            body = {"logs": {"flow_run_id": {"any_": [run_id]}}, "offset": len(messages)}
            reply = httpx.post(f"{self.api}/logs/filter", json=body, timeout=30)
            page = [log["message"] for log in reply.raise_for_status().json()]
            if not page:
                return "\n".join(messages)
            messages += page

    def automations(self) -> list[dict]:
        reply = httpx.post(f"{self.api}/automations/filter", json={}, timeout=30)
        return reply.raise_for_status().json()

    # ------------------------------------------------------------------ processes and logs

    def worker(self) -> int:
        return int((self.state / "run" / "prefect-worker.pid").read_text())

    def ray_head(self) -> int:
        return int((self.state / "run" / "ray-head.pid").read_text())

    def flow_processes(self, run_id: str) -> list[int]:
        """The processes the worker started for ``run_id``: the outermost ones with its id."""
        wanted = f"PREFECT__FLOW_RUN_ID={run_id}".encode()
        mine = []
        for pid in descendants(self.worker()):
            try:
                if wanted in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    mine.append(pid)
            except OSError:
                continue
        return [pid for pid in mine if _parent(pid) not in mine and not _is_zombie(pid)]

    @contextlib.contextmanager
    def training_paused(self) -> Iterator[None]:
        """SIGSTOP the Ray training workers of the head while inside: a flow process stays
        alive, heartbeating and holding its run key's lease, and trains no further."""
        workers = [pid for pid in descendants(self.ray_head()) if _is_training_worker(pid)]
        assert workers, "no training worker under the stack's Ray head"
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def logs(self) -> str:
        return "".join(
            f"\n--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}"
            for log in sorted((self.state / "logs").glob("*.log"))
        )


def _is_training_worker(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::Worker")
    except OSError:
        return False


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants at once, as a preempted machine would. They are
    stopped first, until no new one appears, so that none started meanwhile (a worker
    starting a flow process) outlives them."""
    procs: list[int] = []
    while new := [p for p in [pid, *descendants(pid)] if p not in procs]:
        for proc in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc, signal.SIGSTOP)
        procs += new
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() and not _is_zombie(p) for p in procs):
        assert time.monotonic() < deadline, f"processes {procs} outlived SIGKILL"
        time.sleep(0.1)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def descendants(pid: int) -> list[int]:
    """``pid``'s live descendants, parents before children, by ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _param(value: object) -> object:
    """A parameter's value as ``prefect deployment run --param`` reads it: a string that is
    JSON (``false``, an object) as what it encodes, any other value as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
