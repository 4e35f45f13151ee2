"""Transports over ``torch.distributed`` point-to-point: gloo (CPU, TCP) and NCCL (GPU).

gloo keeps several segments in flight: it posts receives ``window`` hops ahead and lets its own
threads move the bytes while this thread reduces. NCCL runs a whole collective, transfers and
additions, on a side stream of the ring's own, ``lookahead`` hops apart when a chunk is cut in
segments: the caller's stream waits for it once, when the caller waits for the collective,
so backward keeps computing while gradient buckets are summed. The host only launches, and a
watchdog thread holds each collective to its deadline.

When a hop fails, the survivors agree through the rendezvous store on which peer to blame:
the first verdict written there wins (``compare_set``). A rank whose left neighbour died sees
the closed connection at once and writes the verdict; a rank that timed out first waits a
short grace period for the other survivors to say they are alive, and blames one that did
not. The store lives in rank 0: when it cannot be reached, rank 0 is the one lost; when it
answers, rank 0 runs, and is blamed only if no other rank is silent.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import NoReturn

import torch
import torch.distributed as dist

from ringflow.engine.collective._schedule import Hop, Schedule
from ringflow.engine.collective._transport import (
    Completion,
    Deadline,
    Finisher,
    Plan,
    Transport,
    keep_wire_rounding,
    land,
)
from ringflow.engine.collective._watchdog import Watchdog
from ringflow.engine.errors import CollectiveTimeoutError, PeerLostError

__all__ = ["GlooTransport", "NcclTransport"]

_VERDICT_KEY = "verdict"


class _StoreArbiter:
    """Agrees, through the rendezvous store, on which peer the survivors of a failure blame."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, timeout_s: float):
        self._store = store.clone()  # its own connection, with a short timeout
        self._rank, self._n = rank, world_size
        self.reserve_s = min(1.0, 0.2 * timeout_s)
        """Kept from each deadline for agreeing, so survivors still raise by the deadline."""
        self._store.set_timeout(dt.timedelta(seconds=max(0.05, self.reserve_s / 2)))

    def fail(self, *, timed_out: bool, suspect: int, deadline: Deadline, cause: str) -> NoReturn:
        peer = _within(self.reserve_s, lambda: self._agree(timed_out=timed_out, suspect=suspect))
        if peer is _SILENT:
            # Rank 0 hosts the store and takes requests without answering them: it is
            # stopped, whatever this rank saw first (a survivor that gave up closes its pairs).
            peer, timed_out = 0, True
            cause = f"{cause}; the rendezvous store on rank 0 does not answer either"
        elif peer is _REFUSED:
            peer, cause = 0, f"{cause}; the rendezvous store on rank 0 is unreachable too"
        elif peer != suspect:  # not the one whose connection closed: it stopped answering
            timed_out = True
        kind = CollectiveTimeoutError if timed_out else PeerLostError
        what = "stopped answering" if timed_out else "was lost"
        raise kind(
            f"rank {peer} {what} during {deadline.op} (rank {self._rank} saw: {cause}); the "
            f"collective deadline is {deadline.timeout_s:g} s",
            peer=peer,
            op=deadline.op,
            rank=self._rank,
        )

    def _agree(self, *, timed_out: bool, suspect: int) -> int:
        until = time.monotonic() + self.reserve_s * 0.8
        self._store.set(f"alive/{self._rank}", b"1")
        verdict = self._verdict()
        if verdict is not None:
            return verdict
        if not timed_out and self._survived(suspect):
            # The closed connection was a survivor giving up at its deadline (gloo closes a
            # pair that timed out before its rank can say so): the lost rank is the silent one.
            timed_out = True
        if timed_out:
            # Every survivor is waiting on someone; the lost rank is the one not saying alive.
            missing = self._missing(until=until)
            if missing is None:
                return self._verdict()
            if len(missing) > 1 and 0 in missing:
                # The store lives in rank 0 and just answered: its process runs, and of
                # several ranks still silent, another one is the lost (rank 0 is late).
                missing.remove(0)
            if missing and suspect not in missing:
                suspect = missing[0]
        return self._decide(suspect)

    def _survived(self, suspect: int) -> bool:
        """Whether ``suspect``, whose connection closed, says it is alive within a moment
        (a survivor says so as it starts to agree; a lost rank never does)."""
        until = time.monotonic() + self.reserve_s * 0.25
        while not self._store.check([f"alive/{suspect}"]):
            if time.monotonic() >= until or self._store.check([_VERDICT_KEY]):
                return False
            time.sleep(0.01)
        return True

    def _missing(self, *, until: float) -> list[int] | None:
        """Ranks that have not said they are alive by ``until``; ``None`` if a verdict came.

        Returns as soon as at most one is missing: with one peer lost, that is the one. Until
        then a survivor that reached its deadline later than this rank may still be missing,
        and blaming it (a neighbour waits on its left one, alive or not) would be wrong.
        """
        others = [q for q in range(self._n) if q != self._rank]
        while True:
            missing = [q for q in others if not self._store.check([f"alive/{q}"])]
            if len(missing) <= 1 or time.monotonic() >= until:
                return missing
            if self._store.check([_VERDICT_KEY]):
                return None
            time.sleep(0.02)

    def _verdict(self) -> int | None:
        if not self._store.check([_VERDICT_KEY]):
            return None
        return int(self._store.get(_VERDICT_KEY))

    def _decide(self, peer: int) -> int:
        return int(self._store.compare_set(_VERDICT_KEY, "", str(peer)))


_SILENT, _REFUSED = object(), object()
"""What :func:`_within` returns when ``fn`` got no answer in time, or raised."""


def _within(seconds: float, fn: Callable[[], int]) -> int | object:
    """``fn()``; ``_SILENT`` if it took longer than ``seconds``, ``_REFUSED`` if it raised.

    A store whose host is stopped accepts requests and never answers, and the client then
    waits past its own timeout: only a thread of its own bounds the wait. A store whose host
    died refuses or drops the connection instead, and the call raises.
    """
    result: list[int | object] = []

    def run() -> None:
        try:
            result.append(fn())
        except RuntimeError:  # includes the store's DistError and its timeouts
            result.append(_REFUSED)

    thread = threading.Thread(target=run, name="ringflow-arbiter", daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else _SILENT


class GlooTransport(Transport):
    """Ring neighbours over gloo's TCP pairs (any hosts, CPU tensors).

    Args:
        store: the rendezvous store.
        rank: this rank.
        world_size: ranks in the ring.
        timeout_s: the collective deadline (sizes the arbiter's grace period).
        connect_timeout_s: how long connecting may wait for every rank.
        window: hops whose receives are posted ahead of the one being reduced.
    """

    name = "gloo"
    wavefront = True

    def __init__(
        self,
        *,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float,
        connect_timeout_s: float,
        window: int = 4,
    ) -> None:
        self._left, self._right = (rank - 1) % world_size, (rank + 1) % world_size
        self._window = window
        # gloo's own timeout only backs up ours: a timed-out wait also closes the TCP pair.
        self._pg = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo", store),
            rank,
            world_size,
            dt.timedelta(seconds=max(connect_timeout_s, timeout_s)),
        )
        self._arbiter = _StoreArbiter(store, rank=rank, world_size=world_size, timeout_s=timeout_s)

    def run(
        self, plan: Plan, *, wire: torch.dtype, finish: Finisher | None, deadline: Deadline
    ) -> None:
        hops = plan.schedule.hops
        receives: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        sends: deque[tuple[dist.Work, torch.Tensor]] = deque()
        posted = 0
        for i, hop in enumerate(hops):
            while posted < min(len(hops), i + self._window):
                if hops[posted].recv is not None:
                    receives[posted] = self._post_receive(hops[posted], wire)
                posted += 1
            if hop.send is not None:
                sends.append(self._post_send(hop, wire))
            if hop.recv is not None:
                work, received = receives.pop(i)
                self._wait(work, self._left, deadline)
                land(hop, received, finish)
            while len(sends) > self._window:
                self._wait(sends.popleft()[0], self._right, deadline)
        for work, _ in sends:
            self._wait(work, self._right, deadline)

    def _post_receive(self, hop: Hop, wire: torch.dtype) -> tuple[dist.Work, torch.Tensor]:
        # Always into a fresh buffer: a segment of the tensor may still be on its way out.
        buffer = torch.empty(hop.recv.numel(), dtype=wire)
        return self._pg.recv([buffer], self._left, hop.tag), buffer

    def _post_send(self, hop: Hop, wire: torch.dtype) -> tuple[dist.Work, torch.Tensor]:
        buffer = hop.send if hop.send.dtype == wire else hop.send.to(wire)
        keep_wire_rounding(hop, buffer)
        return self._pg.send([buffer], self._right, hop.tag), buffer

    def _wait(self, work: dist.Work, peer: int, deadline: Deadline) -> None:
        seconds = deadline.remaining() - self._arbiter.reserve_s
        try:
            if seconds <= 0:
                raise RuntimeError("Timed out before the transfer could be waited for")
            work.wait(dt.timedelta(seconds=seconds))
        except RuntimeError as err:
            timed_out = "Timed out" in str(err)
            self._arbiter.fail(timed_out=timed_out, suspect=peer, deadline=deadline, cause=str(err))

    def close(self) -> None:
        self._pg = None


class NcclTransport(Transport):
    """Ring neighbours over NCCL (CUDA tensors), hops grouped so sends and receives overlap.

    Args:
        store: the rendezvous store.
        rank: this rank (``torch.cuda.current_device()`` must be its GPU).
        world_size: ranks in the ring.
        timeout_s: the collective deadline.
        connect_timeout_s: how long connecting may wait for every rank.
        lookahead: hops enqueued ahead of the reduction being enqueued.
    """

    name = "nccl"
    wavefront = False  # the device has no cache to keep segments in; lookahead needs lag
    inline = True
    # NCCL's point-to-point runs faster the larger the message and each hop costs host time:
    # whole chunks up to 512 MiB, pipelined beyond (the fastest tried, docs/benchmarks.md).
    pipeline_depth = 1
    segment_range = (4 << 20, 512 << 20)
    _hang = "an NCCL hop hung"

    def __init__(
        self,
        *,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float,
        connect_timeout_s: float,
        lookahead: int = 2,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._left, self._right = (rank - 1) % world_size, (rank + 1) % world_size
        self._lookahead = lookahead
        # NCCL's watchdog would kill the process at its own timeout: keep it behind ours.
        timeout = dt.timedelta(seconds=max(connect_timeout_s, timeout_s) + 60)
        self._owns_default_group = not dist.is_initialized() and group is None
        self._owns_group = group is None
        with _survivable_nccl_errors():
            if group is not None:
                if group.size() != world_size or group.rank() != rank:
                    raise ValueError(
                        f"the ring's group has rank {group.rank()} of {group.size()}; this ring "
                        f"needs rank {rank} of {world_size}"
                    )
                self._group = group
            elif self._owns_default_group:
                # Kept here: a store written in Python is held by torch on the C++ side only,
                # which does not keep its Python methods alive.
                self._rendezvous_store = self._group_store(store)
                dist.init_process_group(
                    "nccl",
                    store=dist.PrefixStore("nccl", self._rendezvous_store),
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                )
            elif dist.get_world_size() != world_size:
                raise ValueError(
                    f"torch.distributed already runs a group of {dist.get_world_size()} ranks; "
                    f"the ring needs all {world_size} of its ranks to be that group's"
                )
            if group is None:
                self._group = dist.new_group(backend="nccl", timeout=timeout)
        self._arbiter = _StoreArbiter(store, rank=rank, world_size=world_size, timeout_s=timeout_s)
        self._aborting = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        self._watchdog = Watchdog(
            "ringflow-nccl-deadlines",
            late=lambda item: item[0].remaining() <= self._arbiter.reserve_s,
            expire=lambda item: self.fail(item[0]),
        )

    def _group_store(self, store: dist.Store) -> dist.Store:
        """The store this transport's process groups rendezvous through."""
        return store

    def run(
        self, plan: Plan, *, wire: torch.dtype, finish: Finisher | None, deadline: Deadline
    ) -> Completion:
        """Enqueue every hop on the side stream and return: the GPU runs them meanwhile.

        The side stream first waits for what the caller's stream has enqueued so far (the
        tensor's last writes), and nothing after: later computation runs alongside.
        """
        self._watchdog.raise_failure()  # an earlier collective hung: this one would too
        caller = torch.cuda.current_stream()
        side = self._side_stream(caller.device)
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                self._issue(plan, wire=wire, finish=finish)
        except RuntimeError as err:  # NCCL refuses work once a communicator was aborted
            if self._watchdog.failure is None:
                self._blame(deadline, cause=str(err), timed_out=False)
            raise self._watchdog.failure from err
        done = torch.cuda.Event()
        done.record(side)
        # The caller's tensor stays alive until the GPU is done with it, so its memory cannot
        # go to another stream's allocation while the ring still runs.
        self._watchdog.watch(done, (deadline, plan.keep))
        return _SideStreamWork(done, caller.device, self._watchdog)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            # High priority: a hop's addition, short, runs before the next backward kernel,
            # so the next hop is not held up behind the caller's computation.
            self._stream = torch.cuda.Stream(device=device, priority=-1)
        return self._stream

    def _issue(self, plan: Plan, *, wire: torch.dtype, finish: Finisher | None) -> None:
        """Enqueue the collective on the current (side) stream."""
        self._enqueue(plan.schedule, wire=wire, finish=finish)

    def _enqueue(self, schedule: Schedule, *, wire: torch.dtype, finish: Finisher | None) -> None:
        lookahead = min(self._lookahead, schedule.lag - 1)
        pending: deque[tuple[Hop, dist.Work | None, torch.Tensor | None]] = deque()
        for hop in schedule.hops:
            pending.append((hop, *self._launch(hop, wire)))
            while len(pending) > lookahead:
                self._land(*pending.popleft(), finish)
        while pending:
            self._land(*pending.popleft(), finish)

    def _launch(self, hop: Hop, wire: torch.dtype) -> tuple[dist.Work | None, torch.Tensor | None]:
        """Enqueue one hop's send and receive as one NCCL group, so they run together.

        Straight on the process group: ``batch_isend_irecv`` makes the same group call with
        more Python around it, and each hop's host time must stay below its GPU time.
        """
        if hop.send is None and hop.recv is None:
            return None, None
        device, received = (hop.send if hop.send is not None else hop.recv).device, None
        self._group._start_coalescing(device)
        if hop.send is not None:
            outgoing = hop.send if hop.send.dtype == wire else hop.send.to(wire)
            keep_wire_rounding(hop, outgoing)
            self._group.send([outgoing], self._right, 0)
        if hop.recv is not None:
            # NCCL runs hops in stream order, so an all-gather segment may land in place.
            direct = not hop.reduce and hop.recv.dtype == wire
            received = hop.recv if direct else hop.recv.new_empty(hop.recv.numel(), dtype=wire)
            self._group.recv([received], self._left, 0)
        return self._group._end_coalescing(device), received

    @staticmethod
    def _land(
        hop: Hop, work: dist.Work | None, received: torch.Tensor | None, finish: Finisher | None
    ) -> None:
        if work is not None:
            work.wait()  # the side stream waits for NCCL's; the host does not
        if received is not None:
            land(hop, received, finish)

    def check(self) -> None:
        self._watchdog.raise_failure()

    def fail(self, deadline: Deadline) -> None:
        """Agree on the lost peer, then abort the communicator so hung kernels return.

        The verdict comes first: whatever the abort makes fail on this rank then finds it.
        """
        self._blame(deadline, cause=self._hang, timed_out=True)
        # Aborting can block on the hung kernels: let it run beside the caller.
        threading.Thread(target=self._abort, name="ringflow-nccl-abort", daemon=True).start()

    def _blame(self, deadline: Deadline, *, cause: str, timed_out: bool) -> None:
        try:
            self._arbiter.fail(
                timed_out=timed_out, suspect=self._left, deadline=deadline, cause=cause
            )
        except PeerLostError as err:
            self._watchdog.failure = self._watchdog.failure or err

    def _abort(self) -> None:
        # Hung NCCL kernels would block every later CUDA call: abort them, best effort.
        self._abort_group()

    def _abort_group(self) -> None:
        with self._aborting, contextlib.suppress(Exception):  # already failing: best effort
            if self._group in dist.distributed_c10d._world.pg_map:
                dist.distributed_c10d._abort_process_group(self._group)

    def close(self) -> None:
        failed = self._watchdog.failure is not None
        self._watchdog.stop()
        if self._owns_group and self._group is not None and dist.is_initialized():
            if failed:
                # A graceful teardown waits for the lost peer, forever: abort instead, after
                # the watchdog's own abort has finished.
                self._abort_group()
                if self._owns_default_group:
                    with contextlib.suppress(Exception):
                        dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group(self._group)
                if self._owns_default_group:
                    dist.destroy_process_group()
        self._group = None


@contextlib.contextmanager
def _survivable_nccl_errors() -> Iterator[None]:
    """Create NCCL groups that abort on a peer's death instead of killing this process.

    torch's default (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) ends the process when NCCL reports
    a dead peer; with 2 it only aborts the communicator, and the ring raises ``PeerLostError``.
    The variable is read when a group is created; one the user set is kept.
    """
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    before = os.environ.get(key)
    os.environ.setdefault(key, "2")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)


class _SideStreamWork(Completion):
    """One collective on the side stream: ``wait`` orders the caller's stream after it.

    Like ``torch.distributed``'s NCCL works, the host never blocks on the GPU, so it keeps
    launching ahead; a failure the watchdog found is raised instead.
    """

    def __init__(self, done: torch.cuda.Event, device: torch.device, watchdog: Watchdog):
        self._done, self._device, self._watchdog = done, device, watchdog

    def wait(self) -> None:
        self._watchdog.raise_failure()
        torch.cuda.current_stream(self._device).wait_event(self._done)
