"""Who the ranks of an elastic run are, generation by generation.

The launcher keeps one :class:`Membership` (a Ray actor) for the run and tells it which
workers it started and which it lost. A worker asks it, through the :class:`Relay` in its
own Ray actor, to join the next generation of ranks; the generation forms once every live
rank of the last one has asked (survivors after a loss) or a new worker is waiting and the
ranks reached a commit (a worker that joins). Each generation has its own ring, with rank 0
of the survivors first, so the state every rank syncs from is one that survived.

A rank's script talks to its relay over a Unix socket in a directory only its user can
open (``RINGFLOW_HOROVOD_MEMBERSHIP``): nothing listens on a network port for this.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any

__all__ = ["SOCKET", "WORKER", "Membership", "Relay", "ask"]

SOCKET = "RINGFLOW_HOROVOD_MEMBERSHIP"
"""The variable naming the rank's relay socket; set only in elastic runs."""
WORKER = "RINGFLOW_HOROVOD_WORKER"
"""The variable naming the worker (``0``, ``1``, ...: its place in the launcher's output,
which stays when its rank changes); set only in elastic runs."""


class Membership:
    """The ranks of an elastic run: each generation formed from the workers alive and ready.

    Args:
        min_np: fewest ranks a generation may have (more are waited for).
        max_np: most ranks a generation may have (newcomers beyond wait).
        drop_after_s: how long a reset waits for a rank of the last generation that is alive
            but has not asked to join (a rank stuck outside any collective); then it is
            dropped and the launcher ends it.
    """

    def __init__(self, min_np: int, max_np: int, drop_after_s: float) -> None:
        self._min, self._max, self._drop_after_s = min_np, max_np, drop_after_s
        self._changed = threading.Condition()
        self._generation = 0
        self._members: list[str] = []  # the current generation, in rank order
        self._assigned: dict[str, dict[str, Any]] = {}
        self._alive: set[str] = set()
        self._started: dict[str, int] = {}  # worker -> in which order it was started
        self._ready: dict[str, tuple[str, str]] = {}  # asked to join: (node, address)
        self._dropped: list[str] = []
        self._reset_since: float | None = None
        self._finished = False

    def started(self, worker: str) -> None:
        """The launcher started ``worker``."""
        with self._changed:
            self._alive.add(worker)
            self._started.setdefault(worker, len(self._started))
            self._changed.notify_all()

    def lost(self, worker: str) -> None:
        """``worker`` died, or was ended by the launcher."""
        with self._changed:
            self._alive.discard(worker)
            self._ready.pop(worker, None)
            self._changed.notify_all()

    def dropped(self) -> list[str]:
        """Workers this dropped since the last call (alive, but never joined a reset)."""
        with self._changed:
            dropped, self._dropped = self._dropped, []
            return dropped

    def finish(self) -> list[str]:
        """A rank finished: no generation forms any more. The workers still waiting to
        join one, which the launcher ends."""
        with self._changed:
            self._finished = True
            waiting = sorted(w for w in self._alive if w not in self._members)
            self._alive -= set(waiting)
            self._changed.notify_all()
            return waiting

    def generation(self) -> int:
        with self._changed:
            return self._generation

    def updated(self, generation: int) -> bool:
        """Whether a worker outside ``generation`` is waiting to join it (the ranks should
        reset at their next commit to take it in)."""
        with self._changed:
            waiting = [w for w in self._ready if w not in self._members]
            return generation == self._generation and bool(waiting)

    def join(self, worker: str, node: str, address: str, after: int) -> dict[str, Any]:
        """Wait until ``worker`` is a rank of a generation after ``after``; its place there
        (rank, size, local and cross ranks, rank 0's rendezvous ``address``, generation).

        Raises:
            RuntimeError: ``worker`` was lost or dropped meanwhile.
        """
        with self._changed:
            self._ready[worker] = (node, address)
            self._changed.notify_all()
            while True:
                if worker not in self._alive:
                    raise RuntimeError(f"worker {worker} is no longer one of the run's workers")
                place = self._assigned.get(worker)
                if place is not None and place["generation"] > after:
                    return place
                if not self._form():
                    self._changed.wait(0.2)

    def _form(self) -> bool:
        """Form the next generation if it can be; whether it did."""
        if self._finished:
            return False
        last = [m for m in self._members if m in self._alive]
        if not last:  # the first generation (or none of the last is left): every worker
            if not self._alive or not self._alive <= set(self._ready):
                return False
        else:
            missing = [m for m in last if m not in self._ready]
            if len(missing) == len(last):  # no reset under way: newcomers wait for a commit
                self._reset_since = None
                return False
            if missing:
                self._reset_since = self._reset_since or time.monotonic()
                if time.monotonic() - self._reset_since < self._drop_after_s:
                    return False
                for m in missing:  # alive, but never came to the reset: end it
                    self._alive.discard(m)
                    self._dropped.append(m)
        ready = sorted((w for w in self._ready if w in self._alive), key=self._started.get)
        order = [m for m in self._members if m in ready]  # survivors first, in rank order
        order += [w for w in ready if w not in order][: max(0, self._max - len(order))]
        if len(order) < self._min:
            return False
        self._generation += 1
        self._members, self._reset_since = order, None
        nodes = [self._ready[w][0] for w in order]
        address = self._ready[order[0]][1]
        hosts = list(dict.fromkeys(nodes))
        for index, worker in enumerate(order):
            local = [i for i, n in enumerate(nodes) if n == nodes[index]]
            self._assigned[worker] = {
                "generation": self._generation,
                "rank": index,
                "size": len(order),
                "local_rank": local.index(index),
                "local_size": len(local),
                "cross_rank": hosts.index(nodes[index]),
                "cross_size": len(hosts),
                "address": address,
            }
            del self._ready[worker]
        self._changed.notify_all()
        return True


class Relay:
    """A worker's way to the run's :class:`Membership`: a Unix socket in a private
    directory, served by a thread of the worker's Ray actor, which adds what the actor knows
    (the worker's name, its node, a free rendezvous address there)."""

    def __init__(self, membership: Any, worker: str) -> None:
        import ray

        from ringflow.engine.worker import free_address

        self._membership, self.worker = membership, worker
        self._node, self._free_address = ray.util.get_node_ip_address(), free_address
        self._directory = tempfile.mkdtemp(prefix="ringflow-hvd-")  # mode 0700
        self.path = os.path.join(self._directory, "membership.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        import ray

        with connection, connection.makefile("rw") as stream:
            request = json.loads(stream.readline())
            try:
                if request["op"] == "join":
                    call = self._membership.join.remote(
                        self.worker, self._node, self._free_address(), int(request["after"])
                    )
                else:
                    call = self._membership.updated.remote(int(request["generation"]))
                reply = {"ok": ray.get(call)}
            except Exception as err:  # the worker was lost, or the launcher went away
                cause = getattr(err, "cause", None) or err
                reply = {"error": " ".join(str(cause).split())}
            stream.write(json.dumps(reply) + "\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.close()
        shutil.rmtree(self._directory, ignore_errors=True)


def ask(request: dict[str, Any]) -> Any:
    """Send ``request`` to this rank's relay; its answer.

    Raises:
        RuntimeError: the membership refused it (this worker was dropped or lost).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(os.environ[SOCKET])
        with connection.makefile("rw") as stream:
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            reply = json.loads(stream.readline())
    if "error" in reply:
        raise RuntimeError(reply["error"])
    return reply["ok"]
