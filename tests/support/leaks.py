"""What a test may not leave behind for the next one, and how to tell that it did.

:func:`guard` runs around every test (``tests/conftest.py``): it looks at this process and
the machine before the test and after it, and fails the test that left one of these
behind, naming it, after cleaning it up so that the next test starts clean:

- a ``torch.distributed`` process group;
- a Ray instance this process connected to, other than the session's;
- a process it started (directly, or detached into a session of its own) still running, or
  one a shared Ray cluster started for it (an actor, and what the actor started);
- a socket listening on an address beyond loopback, opened by this process or one it
  started;
- an environment variable it set, changed or removed.

Processes are ours when this process is their nearest ancestor that was already running
before the test, or when they were detached (reparented away) but carry :data:`OWNER` in
their environment, which this process sets at start and every child inherits. A process
that a long-lived process of the session started (a Ray raylet's new worker, a Prefect
server's subprocess) is that process's business, not the test's; but under a shared Ray
cluster (``tests/support/ray_cluster.py``: a module's launchers join it) a worker that was
idle when the test started, or started since, and runs something now (an actor, a task) is
the test's, with what it started: only idle workers and the cluster's own processes stay.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

OWNER = "RINGFLOW_TEST_SUITE_PID"
"""Set to the id of the pytest process that runs the tests (under xdist, the worker's own,
so that a test is not blamed for what a test on the other worker runs meanwhile); inherited
by everything a test starts."""

_GRACE_S = 10.0
"""How long a process a test ended may take to exit, or a socket to close, before it
counts as left behind."""

_BENIGN_PROCESSES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Helpers Python starts once per process on first use and keeps for its lifetime."""

_BENIGN_ENV = {
    "PL_GLOBAL_SEED": "Lightning's seed_everything records the seed it was given",
    "PL_SEED_WORKERS": "Lightning's seed_everything records whether workers are seeded",
    "KINETO_LOG_LEVEL": "torch.profiler sets it on first use",
    "CUBLAS_WORKSPACE_CONFIG": "lightning.Trainer(deterministic=True) sets it for cuBLAS",
    "RAY_CLIENT_MODE": "Ray sets it when it is first imported",
    "PYTEST_CURRENT_TEST": "pytest's own, naming the phase of the test it runs",
    "CRC32C_SW_MODE": "tensorboardX sets it when first imported",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "Lightning sets it when first imported",
    "TORCHINDUCTOR_CACHE_DIR": "Lightning sets it when first imported",
    "KMP_DUPLICATE_LIB_OK": "scikit-learn and joblib set it when first imported",
    "KMP_INIT_AT_FORK": "scikit-learn and joblib set it when first imported",
}
"""Variables a library sets for itself when a test first uses it; changing them is not a
test's doing."""


def mark_owner() -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[OWNER] = str(os.getpid())  # not the controller's, which it inherited
    else:
        os.environ.setdefault(OWNER, str(os.getpid()))


@dataclass(frozen=True)
class _Process:
    pid: int
    ppid: int
    ours: bool
    cmdline: str


def _processes() -> dict[int, _Process]:
    me = os.environ.get(OWNER, str(os.getpid())).encode()
    marker = OWNER.encode() + b"=" + me
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            state, ppid = stat.rsplit(b")", 1)[1].split()[:2]
            if state in (b"Z", b"X"):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    ours = marker in f.read().split(b"\0")
            except PermissionError:
                ours = False
        except (FileNotFoundError, ProcessLookupError, ValueError, OSError):
            continue
        found[pid] = _Process(pid=pid, ppid=int(ppid), ours=ours, cmdline=cmdline)
    return found


def _left_behind(before: set[int], now: dict[int, _Process]) -> list[_Process]:
    """The processes started during the test that belong to it (see the module docstring)."""
    me = os.getpid()
    leaked = []
    for proc in now.values():
        if proc.pid in before or proc.pid == me:
            continue
        if any(name in proc.cmdline for name in _BENIGN_PROCESSES):
            continue
        ancestor = proc.ppid
        while ancestor not in before and ancestor in now and ancestor > 1:
            ancestor = now[ancestor].ppid
        if ancestor == me:
            leaked.append(proc)
        elif proc.ours and (ancestor <= 1 or not now.get(ancestor, proc).ours):
            leaked.append(proc)  # detached from us: reparented to init or a subreaper
    return leaked


_IDLE_RAY_WORKER = "ray::IDLE"
"""How a Ray worker process that runs nothing names itself (``ray::IDLE``,
``ray::IDLE_SpillWorker``, ...)."""


def _idle_ray_worker(proc: _Process) -> bool:
    return proc.cmdline.startswith(_IDLE_RAY_WORKER)


def _left_in_clusters(
    before: _Before, now: dict[int, _Process], clusters: frozenset[int]
) -> list[_Process]:
    """The processes under a shared Ray cluster (``clusters``: the processes holding them up)
    that run something the test started: a worker busy now that was idle at its start or
    started since (an actor, a task), and what such a worker started."""
    leaked = []
    for proc in now.values():
        if _idle_ray_worker(proc):
            continue
        if proc.pid in before.processes and proc.pid not in before.idle_ray_workers:
            continue  # the cluster's own: its raylet, its GCS, its agents
        ancestor = proc.ppid
        while ancestor in now and ancestor not in clusters and ancestor > 1:
            ancestor = now[ancestor].ppid
        if ancestor in clusters:
            leaked.append(proc)
    return leaked


def _kill(processes: list[_Process]) -> None:
    for proc in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, signal.SIGKILL)


def _listeners() -> dict[int, str]:
    """Sockets listening beyond loopback, by inode: ``address:port``."""
    found = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            host = _host(address, v6)
            if host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1"):
                continue
            found[int(fields[9])] = f"{host}:{int(port, 16)}"
    return found


def _host(hex_address: str, v6: bool) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_address)
    if not v6:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped) if address.ipv4_mapped else str(address)


def _owner_of(inode: int, candidates: list[int]) -> int | None:
    link = f"socket:[{inode}]"
    for pid in candidates:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == link:
                    return pid
    return None


@dataclass
class _Before:
    env: dict[str, str]
    processes: set[int]
    idle_ray_workers: set[int]
    listeners: set[int]
    ray: bool


def _ray_connected() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def _process_group() -> bool:
    import sys

    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def guard(*, session_ray: bool, clusters: frozenset[int] = frozenset()) -> Iterator[None]:
    """Run one test; fail it if it left something behind (see the module docstring).

    Args:
        session_ray: the session's own Ray instance is connected now (not a leak).
        clusters: the processes holding shared Ray clusters up (``tests/support/
            ray_cluster.py``), started before the test and stopped after it.
    """
    processes = _processes()
    before = _Before(
        env=dict(os.environ),
        processes=set(processes),
        idle_ray_workers={p.pid for p in processes.values() if _idle_ray_worker(p)},
        listeners=set(_listeners()),
        ray=_ray_connected(),
    )
    yield
    problems = []
    if _process_group():
        import torch.distributed as dist

        dist.destroy_process_group()
        problems.append("a torch.distributed process group (destroy_process_group() it)")
    if _ray_connected() and not before.ray and not session_ray:
        import ray

        ray.shutdown()
        problems.append("a Ray instance (ray.shutdown() it, or use the ray_session fixture)")
    problems += _env_changes(before.env)
    deadline = time.monotonic() + _GRACE_S
    while True:
        now = _processes()
        leaked = _left_behind(before.processes, now)
        leaked += _left_in_clusters(before, now, clusters)
        mine = [os.getpid(), *(p.pid for p in now.values() if p.ours)]
        listening = {
            inode: address
            for inode, address in _listeners().items()
            if inode not in before.listeners and _owner_of(inode, mine) is not None
        }
        if not (leaked or listening) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    problems += [f"a listener on {address}, beyond 127.0.0.1" for address in listening.values()]
    problems += [f"process {p.pid} still running: {p.cmdline[:160]}" for p in leaked]
    _kill(leaked)
    if problems:
        raise AssertionError("the test left behind: " + "; ".join(problems))


def _env_changes(before: dict[str, str]) -> list[str]:
    """What the test did to the environment, undone; one line each."""
    changes = []
    now = dict(os.environ)
    for key in sorted(set(before) | set(now)):
        if before.get(key) == now.get(key) or key in _BENIGN_ENV:
            continue
        if key not in now:
            changes.append(f"environment variable {key} removed")
            os.environ[key] = before[key]
        elif key not in before:
            changes.append(f"environment variable {key} set")
            del os.environ[key]
        else:
            changes.append(f"environment variable {key} changed")
            os.environ[key] = before[key]
    return changes
