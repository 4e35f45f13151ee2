"""This rank's queue of operations on a ring, and the cycles in which the ranks agree on what
runs: Horovod's coordinator, run by the calls themselves rather than by a background thread.

An operation waits in its rank's queue until every rank (of its process set) that is not in
``hvd.join`` has asked for one of the same name; it then runs on every rank in the same cycle,
in the order rank 0 asked, so ranks may ask in different orders. A cycle is one all-gather of a
small block per rank (``ringflow.horovod.negotiation``): an ``*_async`` call runs one and
returns whether or not its operation ran; ``synchronize`` (and every call that waits) and
``hvd.join`` run cycles until theirs ran; ``poll`` runs one while its operation waits. Where the
ranks ask in the same order, each operation runs in the cycle of the call that asks for it: one
small all-gather per operation.

A ``DistributedOptimizer``'s gradients skip the queue: each step asks for one operation
(:meth:`Coordinator.step`), in which the ranks learn whether one is in ``hvd.join``, and the
gradients then go straight to the ring in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ringflow.horovod import basics
from ringflow.horovod.basics import HorovodError, ring, size
from ringflow.horovod.negotiation import (
    Failure,
    Outcome,
    Told,
    blocks,
    decide,
    describe,
    heard,
    longest,
    refusing,
)
from ringflow.horovod.process_sets import current
from ringflow.horovod.timeline import NEGOTIATE, naming

__all__ = ["Coordinator", "Request", "coordinator", "forget"]


class Request:
    """An operation this rank asked for: in its queue until every rank has, then run (or
    failed) in a cycle."""

    def __init__(
        self,
        owner: Coordinator,
        kind: str,
        row: list[int],
        name: str | None,
        start: Callable[[], Any],
        *,
        label: str | None,
        refusal: Exception | None,
    ) -> None:
        self.owner, self.kind, self.row, self.name = owner, kind, row, name
        self.start, self.label, self.refusal = start, label, refusal
        self.started: Any = None
        """What ``start`` gave once the operation ran: a handle on its result."""
        self.error: Exception | None = None
        """Why it did not run (raised where it is waited for)."""
        self.joined: list[int] = []
        """The ranks in ``hvd.join`` when it ran."""
        self.ran_in: int | None = None
        """The cycle it ran or failed in (``None``: it waits)."""

    def in_flight(self) -> bool:
        """Whether a second operation of its name is refused: until it ran and this rank has
        since waited for an operation (as in Horovod, whose background thread finishes it
        while the script goes on: a rank that never waits cannot tell that it finished)."""
        return self.ran_in is None or self.owner.waited_in < self.ran_in


class Coordinator:
    """This rank's queue on one ring (the run's, or a process set's) and its cycles."""

    def __init__(self, ring: Any, process_set: Any) -> None:
        self.ring, self.process_set = ring, process_set
        self.queue: list[Request] = []
        self.cycles = 0
        self.waited_in = 0
        """The cycle of the last wait for an operation (``wait`` or ``join``) to return."""
        self._asked: dict[str, int] = {}  # unnamed operations asked for, by counter
        self._round = 0  # automatic names start again once the ranks have met in a join
        self._joined = self._joined_now = False
        self._zeros: Callable[[list[int]], None] | None = None

    def ask(
        self,
        kind: str,
        tensor: torch.Tensor | None,
        name: str | None,
        start: Callable[[], Any],
        *,
        root: int = -1,
        op: str = "",
        refusal: Exception | None = None,
        counter: str | None = None,
        label: str | None = None,
    ) -> Request:
        """Queue an operation and run a cycle; the request, whether its operation ran, failed
        or waits for other ranks. ``start`` runs it (on every rank, in the same cycle);
        ``refusal``: why this rank cannot take its arguments (it fails on every rank);
        ``counter``: what an unnamed operation is counted as (its kind by default);
        ``label``: its name in the timeline (``name`` by default)."""
        named = name if name is not None else self._automatic(counter or kind)
        try:
            row = describe(kind, tensor, named, root, op)
        except HorovodError as err:
            refusal, row = refusal or err, describe(kind, None, named, root, op)
        if refusal is not None:
            row = refusing(row)
        label = name if label is None else label
        request = Request(self, kind, row, name, start, label=label, refusal=refusal)
        self.queue.append(request)
        self.cycle(kind, waits=False)
        return request

    def _automatic(self, counter: str) -> str:
        number = self._asked.get(counter, 0)
        self._asked[counter] = number + 1
        return f"\0{counter}.noname.{self._round}.{number}"

    def wait(self, request: Request) -> None:
        """Run cycles until ``request`` ran or failed."""
        while request.ran_in is None:
            self.cycle(request.kind, waits=True)
        self.waited_in = self.cycles

    def poll(self, request: Request) -> None:
        """One cycle, where ``request`` waits (the others run theirs as they call)."""
        if request.ran_in is None:
            self.cycle(request.kind, waits=False)

    def step(self) -> bool:
        """The operation a ``DistributedOptimizer`` step starts with; whether a rank is in
        ``hvd.join`` (the step's gradients then go through the queue, for its zeros)."""
        request = self.ask("step", None, None, lambda: None)
        self.wait(request)
        if request.error is not None:
            raise request.error
        return bool(request.joined)

    def join(self, zeros: Callable[[list[int]], None]) -> int:
        """Run cycles until every rank is in ``hvd.join``, taking part in what the others run
        by ``zeros`` (given the row of each operation this rank has not asked for); the rank
        that came last."""
        self._joined = self._joined_now = True
        self._zeros = zeros
        try:
            while True:
                outcome = self.cycle("join", waits=True)
                self._joined_now = False
                if outcome.last_joined is not None:
                    self._start_names_again()
                    self.waited_in = self.cycles
                    return outcome.last_joined
        finally:
            self._joined = self._joined_now = False
            self._zeros = None

    def _start_names_again(self) -> None:
        """Every rank at once (a join every rank came to, a deadlock): the ranks count unnamed
        operations from 0 again, whatever each asked for before."""
        self._round += 1
        self._asked.clear()

    def cycle(self, kind: str, *, waits: bool) -> Outcome:
        """Tell the other ranks this rank's queue (``kind``: the operation this call is about,
        as the timeline names the negotiation), and run what every rank asked for."""
        before = getattr(basics._scope, "set", None)
        basics._scope.set = self.process_set  # wherever it was called from (synchronize)
        try:
            self.cycles += 1
            outcome = decide(self._exchange(kind, waits))
            for key, row, failure in outcome.ready:
                self._run(key, row, failure, outcome.joined)
            if outcome.stuck is not None:
                self._fail_every(outcome.stuck)
        finally:
            basics._scope.set = before
        return outcome

    def _exchange(self, kind: str, waits: bool) -> list[Told]:
        rows = [request.row for request in self.queue]
        mine = Told(waits or self._joined, self._joined, self._joined_now, rows)
        if size() == 1:
            return [mine]
        first, every_row = blocks(mine)
        with naming(f"{NEGOTIATE}{kind.upper()}"):
            firsts = _gathered(first)
            more = longest(firsts)
            seconds = _gathered(every_row + [0] * (more - len(every_row))) if more else None
        return heard(firsts, seconds)

    def _run(self, key: int, row: list[int], failure: Failure | None, joined: list[int]) -> None:
        request = next((r for r in self.queue if r.row[-1] == key), None)
        if request is None:  # this rank is in hvd.join: it takes part with zeros
            if failure is None and self._zeros is not None:
                self._zeros(row)
            return
        self.queue.remove(request)
        request.ran_in, request.joined = self.cycles, joined
        if failure is not None:
            request.error = request.refusal or failure.error(request.kind, request.name)
            return
        try:
            with naming(request.label):
                request.started = request.start()
        except Exception as err:
            request.error = err
            raise

    def _fail_every(self, stuck: Failure) -> None:
        """Every rank waits and none can go on: each fails every operation in its queue with
        how the ranks' oldest operations differ, and the ranks go on from empty queues."""
        if self.queue:
            error = stuck.error(self.queue[0].kind, self.queue[0].name)
            for request in self.queue:
                request.error, request.ran_in = error, self.cycles
        self.queue.clear()
        self._start_names_again()

    def forget(self) -> None:
        """Its ring is gone (``hvd.shutdown``): what waits fails."""
        error = HorovodError("ringflow.horovod was shut down before the operation ran")
        self.cycles += 1
        for request in self.queue:
            request.error, request.ran_in = error, self.cycles
        self.queue.clear()
        self.waited_in = self.cycles


def _gathered(values: list[int]) -> list[list[int]]:
    return torch.stack(ring().all_gather(torch.tensor(values, dtype=torch.int64))).tolist()


_coordinators: dict[int, Coordinator] = {}


def coordinator() -> Coordinator:
    """This rank's coordinator on the ring collectives run over here (the process set's, in
    one); a ring formed anew (``init`` after ``shutdown``, an elastic reset) has a new one."""
    here = ring()
    here = getattr(here, "untimed", here)  # the timeline may wrap the run's ring for a while
    found = _coordinators.get(id(here))
    if found is None or found.ring is not here:
        found = _coordinators[id(here)] = Coordinator(here, current())
    return found


def forget() -> None:
    """At ``hvd.shutdown``: every queue is dropped, what waits in it failed."""
    for each in _coordinators.values():
        each.forget()
    _coordinators.clear()
