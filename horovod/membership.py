"""Who the ranks of an elastic run are, generation by generation.

The launcher keeps one :class:`Membership` (a Ray actor) for the run and tells it which
workers it started and which it lost. A worker asks it, through the :class:`Relay` in its
own Ray actor, to join the next generation of ranks; the generation forms once every live
rank of the last one has asked (survivors after a loss) or a new worker is waiting and the
ranks reached a commit (a worker that joins). Each generation has its own ring, with rank 0
of the survivors first, so the state every rank syncs from is one that survived. Who may be
a rank, when a worker starts in place of a lost one and when the run gives up are decided
by the engine's elastic coordinator, as in ``engine.fit``; what is Horovod's (ranks asking
to join a generation, a ring per generation, survivors first) stays here.

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
from collections.abc import Callable
from typing import Any

from ringflow.engine.elastic.coordinator import (
    Coordinator,
    ElasticEvent,
    FailurePolicy,
    GiveUp,
    Phase,
)

__all__ = ["SOCKET", "WORKER", "Membership", "Relay", "ask"]

SOCKET = "RINGFLOW_HOROVOD_MEMBERSHIP"
"""The variable naming the rank's relay socket; set only in elastic runs."""
WORKER = "RINGFLOW_HOROVOD_WORKER"
"""The variable naming the worker (``0``, ``1``, ...: its place in the launcher's output,
which stays when its rank changes); set only in elastic runs."""


class Membership:
    """The ranks of an elastic run: each generation formed from the workers alive and ready;
    who may be one, and when the run gives up, decided by the engine's elastic
    :class:`~ringflow.engine.elastic.coordinator.Coordinator` (as in ``engine.fit``).

    The first ``np`` workers started (``"0"``, ``"1"``, ...) are the coordinator's members; a
    worker started later is a newcomer until a generation takes it in (the coordinator's
    ``joined``). A member lost is the coordinator's ``lost`` (each a reset of the group); a
    newcomer lost before it joined is a replacement that failed to start (``spawn_failed``:
    the next one backs off). Every lost or joined worker counts against ``reset_limit``.

    Args:
        np: the workers the run starts with, and keeps running (until :meth:`resize`).
        min_np: fewest ranks a generation may have (more are waited for).
        max_np: most ranks a generation may have, and most workers :meth:`resize` keeps.
        drop_after_s: how long a reset waits for a rank of the last generation that is alive
            but has not asked to join (a rank stuck outside any collective); then it is
            dropped (lost) and the launcher ends it.
        reset_limit: Horovod's: how many times the ranks may change after the first
            generation (``None``: any number).
        clock: seconds, for the replacements' backoff (tests pass a fake one).
    """

    def __init__(
        self,
        np: int,
        min_np: int,
        max_np: int,
        drop_after_s: float,
        reset_limit: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._coordinator = Coordinator(
            [str(i) for i in range(np)],
            min_workers=min_np,
            max_workers=np,
            policy=FailurePolicy(max_failures=None, max_resets=reset_limit),
            clock=clock,
        )
        self._max, self._drop_after_s = max_np, drop_after_s
        self._changed = threading.Condition()
        self._generation = 0
        self._members: list[str] = []  # the current generation, in rank order
        self._assigned: dict[str, dict[str, Any]] = {}
        self._alive: set[str] = set()
        self._started: dict[str, int] = {}  # worker -> in which order it was started
        self._ready: dict[str, tuple[str, str]] = {}  # asked to join: (node, address)
        self._dropped: list[str] = []
        self._gone: set[str] = set()  # lost or dropped: told once
        self._reported = 0  # the coordinator's events handed out by poll()
        self._reset_since: float | None = None
        self._finished = False
        self._gave_up: str | None = None

    def started(self, worker: str) -> None:
        """The launcher started ``worker``."""
        with self._changed:
            self._alive.add(worker)
            self._started.setdefault(worker, len(self._started))
            self._changed.notify_all()

    def lost(self, worker: str, cause: str = "its process died") -> str | None:
        """``worker`` died, or was ended by the launcher. Why the run gives up, if it does
        (the coordinator's reason, in one line)."""
        with self._changed:
            self._lose(worker, cause)
            self._changed.notify_all()
            return self._gave_up

    def _lose(self, worker: str, cause: str) -> None:
        self._alive.discard(worker)
        self._ready.pop(worker, None)
        coordinator = self._coordinator
        if self._finished or self._gave_up is not None or worker in self._gone:
            return
        self._gone.add(worker)
        if worker in coordinator.members:
            decision = coordinator.lost([worker], at_step=coordinator.committed_step, cause=cause)
            if isinstance(decision, GiveUp):
                self._gave_up = decision.reason
        elif worker in self._started:  # a newcomer: a replacement that did not come up
            coordinator.spawn_failed(f"{worker}: {cause}")

    def poll(self) -> tuple[list[str], int, list[ElasticEvent], str | None]:
        """What the launcher acts on: the workers dropped since the last call (alive, but
        they never came to a reset: end them), how many workers to start now in place of
        lost ones, the coordinator's events since the last call, and why the run gave up
        (``None`` while it goes on)."""
        with self._changed:
            self._form()  # a reset waiting on a stuck rank drops it on time
            dropped, self._dropped = self._dropped, []
            events = self._coordinator.events[self._reported :]
            self._reported += len(events)
            newcomers = [w for w in self._alive if w not in self._coordinator.members]
            start = 0
            if not self._finished and self._gave_up is None:
                start = max(0, self._coordinator.vacancies() - len(newcomers))
            return dropped, start, events, self._gave_up

    def resize(self, np: int) -> None:
        """Keep ``np`` workers running from now on (within ``min_np`` and ``max_np``): where
        that is more than there are, :meth:`poll` asks for more, and they join the ranks at
        their next commit; where less, the ranks there are stay."""
        with self._changed:
            coordinator = self._coordinator
            coordinator.resize(min(max(np, coordinator.min_workers), self._max))
            self._changed.notify_all()

    def finish(self, worker: str) -> list[str]:
        """``worker``'s rank finished: no generation forms any more. The workers still
        waiting to join one, which the launcher ends."""
        with self._changed:
            self._finished = True
            self._alive.discard(worker)
            waiting = sorted(w for w in self._alive if w not in self._members)
            self._alive -= set(waiting)
            self._changed.notify_all()
            return waiting

    def generation(self) -> int:
        with self._changed:
            return self._generation

    def updated(self, generation: int, committed: bool = False) -> bool:
        """Whether a worker outside ``generation`` is waiting to join it (the ranks should
        reset at their next commit to take it in); ``committed``: rank 0 asks at a commit
        of the ranks, which the coordinator counts as a step."""
        with self._changed:
            current = generation == self._generation and self._gave_up is None
            if current and committed and self._coordinator.phase is Phase.RUNNING:
                self._coordinator.committed(self._coordinator.committed_step + 1)
            waiting = [w for w in self._ready if w not in self._members]
            return current and bool(waiting) and self._may_join()

    def join(self, worker: str, node: str, address: str, after: int) -> dict[str, Any]:
        """Wait until ``worker`` is a rank of a generation after ``after``; its place there
        (rank, size, local and cross ranks, rank 0's rendezvous ``address``, generation).

        Raises:
            RuntimeError: ``worker`` was lost or dropped meanwhile, or the run gave up.
        """
        with self._changed:
            self._ready[worker] = (node, address)
            self._changed.notify_all()
            while True:
                if self._gave_up is not None:
                    raise RuntimeError(f"the run gave up: {self._gave_up}")
                if worker not in self._alive:
                    raise RuntimeError(f"worker {worker} is no longer one of the run's workers")
                place = self._assigned.get(worker)
                if place is not None and place["generation"] > after:
                    return place
                if not self._form():
                    self._changed.wait(0.2)

    def _may_join(self) -> bool:
        left = self._coordinator.resets_left()
        return left is None or left > 0

    def _form(self) -> bool:
        """Form the next generation if it can be; whether it did."""
        if self._finished or self._gave_up is not None:
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
                    self._lose(m, "it never came to the ranks' reset")
                    self._dropped.append(m)
                if self._gave_up is not None:
                    self._changed.notify_all()
                    return False
        return self._assign(self._order())

    def _order(self) -> list[str]:
        """The next generation's workers: the last one's ready members first, in rank order,
        then newcomers in the order they started, while the coordinator lets them join."""
        members = self._coordinator.members
        ready = sorted((w for w in self._ready if w in self._alive), key=self._started.get)
        order = [m for m in self._members if m in ready]
        order += [w for w in ready if w in members and w not in order]
        newcomers = [w for w in ready if w not in members]
        if newcomers and self._may_join():
            order += newcomers[: max(0, self._coordinator.max_workers - len(order))]
        return order

    def _assign(self, order: list[str]) -> bool:
        """Make ``order`` the next generation, where it has enough ranks; whether it did."""
        if len(order) < self._coordinator.min_workers:
            return False
        newcomers = [w for w in order if w not in self._coordinator.members]
        if newcomers:
            self._coordinator.joined(newcomers, cause="a worker started in place of a lost one")
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
                    call = self._membership.updated.remote(
                        int(request["generation"]), bool(request.get("committed"))
                    )
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
