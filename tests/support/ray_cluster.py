"""A Ray cluster of a test's own, for scripts that join one with ``ray.init(address="auto")``
(Horovod's Ray examples): a process starts a local Ray on 127.0.0.1 with the resources
asked for (GPUs may be declared where there are none: Ray only counts them) and keeps it
until the test ends; the script finds it through ``RAY_ADDRESS``.

:func:`shared_cluster` keeps one for several tests in turn (a module fixture's), so that each
launcher they start (``ringflow-run``, a flow's ranks) joins it instead of starting a private
Ray: while it is up, the leak guard (``tests/support/leaks.py``) fails a test that leaves one
of the processes it started on it running (an actor, a rank's script)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_HOLD = """
import sys
import ray
ray.init(address="local", num_cpus=int(sys.argv[1]), num_gpus=int(sys.argv[2]),
         include_dashboard=False, _node_ip_address="127.0.0.1")
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes it
"""


@dataclass(frozen=True)
class RayCluster:
    address: str
    """The cluster's GCS address, for ``RAY_ADDRESS``."""
    pid: int
    """The process holding it: every Ray process of the cluster descends from it."""

    def actor_processes(self, name: str) -> list[int]:
        """The processes of the cluster's actors of class ``name`` (``ray::name...``)."""
        import psutil

        found = []
        for process in psutil.Process(self.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process.cmdline()[:1] and process.cmdline()[0].startswith(f"ray::{name}"):
                    found.append(process.pid)
        return sorted(found)

    def kill(self, pid: int) -> None:
        """SIGKILL one of the cluster's processes."""
        assert pid in {p.pid for p in _descendants(self.pid)}, pid
        os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


@contextlib.contextmanager
def ray_cluster(
    *, num_cpus: int, num_gpus: int = 0, cwd: Path, python_path: tuple[str | Path, ...] = ()
) -> Iterator[RayCluster]:
    """A cluster of ``num_cpus`` CPUs and ``num_gpus`` GPUs, its workers started in ``cwd``
    with ``python_path`` ahead of this process's ``PYTHONPATH`` (code the cluster's nodes
    have installed); it stops when the block ends."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if python_path:
        paths = [*map(str, python_path), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(num_cpus), str(num_gpus)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
    )
    try:
        address = holder.stdout.readline().strip()
        assert address, "the Ray cluster did not start"
        yield RayCluster(address=address, pid=holder.pid)
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)


_SHARED: set[int] = set()


@contextlib.contextmanager
def shared_cluster(
    *, num_cpus: int, num_gpus: int = 0, cwd: Path, python_path: tuple[str | Path, ...] = ()
) -> Iterator[RayCluster]:
    """:func:`ray_cluster`, known to the leak guard while it is up (:func:`shared_pids`):
    for a fixture wider than a test, set up before the tests' guard looks and torn down
    after it."""
    with ray_cluster(
        num_cpus=num_cpus, num_gpus=num_gpus, cwd=cwd, python_path=python_path
    ) as cluster:
        _SHARED.add(cluster.pid)
        try:
            yield cluster
        finally:
            _SHARED.discard(cluster.pid)


def shared_pids() -> frozenset[int]:
    """The processes holding the shared clusters up now."""
    return frozenset(_SHARED)
