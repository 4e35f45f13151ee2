"""Our ring all-reduce: reduce-scatter then all-gather over point-to-point transfers.

Every collective carries a deadline: a peer that dies or stops answering makes every survivor
raise ``PeerLostError`` (``CollectiveTimeoutError`` for a stopped one) naming that peer,
within ``timeout_s``. On CPU the transport does the copying itself, so collectives run one at
a time on a communication thread, in the order they were started, and ``allreduce_async_``
overlaps them with the caller's computation. On GPU, NCCL only enqueues work on streams: the
caller's thread launches it, as DDP does, onto a side stream that the caller's stream waits
for in ``wait``, and a watchdog thread holds it to its deadline.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ringflow.engine.collective._p2p import GlooTransport, NcclTransport
from ringflow.engine.collective._rendezvous import open_store, same_host
from ringflow.engine.collective._schedule import (
    all_gather_schedule,
    allreduce_schedule,
    broadcast_schedule,
    reduce_scatter_schedule,
)
from ringflow.engine.collective._shm import ShmTransport, shm_available
from ringflow.engine.collective._symm import SymmTransport, symm_unusable
from ringflow.engine.collective._transport import Completion, Deadline, Finisher, Plan, Transport
from ringflow.engine.collective.base import (
    Collective,
    CollectiveWork,
    CompletedWork,
    ReduceOp,
    check_reduce_op,
    check_shards,
    register_collective,
    shard_of,
    wire_dtype,
)
from ringflow.engine.config import TRANSPORTS, SymmConfig
from ringflow.engine.errors import CollectiveError, CollectiveTimeoutError

__all__ = ["TRANSPORTS", "RingCollective"]


_Started = tuple[torch.Tensor, Completion | None]
"""A collective's result tensor, and the device work still to wait for, if any."""

_WEDGED_GRACE_S = 5.0
"""How long past its deadline a collective may stay unfinished before ``wait`` gives up on it."""


@register_collective("ring")
class RingCollective(Collective):
    """Pipelined ring collectives over shared memory (same host), gloo or NCCL.

    Args:
        rank: this process's rank.
        world_size: number of ranks.
        init_method: ``tcp://host:port`` where rank 0 hosts the rendezvous store; unused for
            one rank or when ``store`` is given.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors on this rank's device).
        timeout_s: every collective's deadline.
        connect_timeout_s: how long joining may wait for every rank.
        compression: ``none``, ``bf16`` or ``fp16``: float32 all-reduces travel in that dtype
            and are summed in float32; every rank ends with the same values.
        transport: one of ``TRANSPORTS``.
        segment_bytes: the largest piece in flight; default per transport.
        symm: how the ``symm`` transport runs; ``SymmConfig()`` by default. Either way the
            ``RINGFLOW_SYMM_*`` variables of this process override its fields.
        store: a rendezvous store to use instead of ``init_method``.
        group: on ``nccl``, an NCCL process group of exactly this ring's ranks (this rank at
            ``rank``) to run over; without it the ring makes its own from the default group,
            which must then be the ring's alone (or not exist yet).

    Raises:
        ValueError: an argument is out of range; the message names it.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        init_method: str = "",
        backend: str = "gloo",
        timeout_s: float = 10.0,
        connect_timeout_s: float = 120.0,
        compression: str = "none",
        transport: str = "auto",
        segment_bytes: int | None = None,
        store: dist.Store | None = None,
        group: dist.ProcessGroup | None = None,
        symm: SymmConfig | None = None,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size)
        _check_arguments(backend=backend, timeout_s=timeout_s, transport=transport)
        self._wire = wire_dtype(compression)
        self._timeout_s = timeout_s
        self._failure: CollectiveError | None = None
        self._running: Deadline | None = None
        self._transport: Transport | None = None
        self._thread: _CommThread | None = None
        if world_size > 1:
            if store is None:
                store = open_store(
                    init_method, rank=rank, world_size=world_size, timeout_s=connect_timeout_s
                )
            self._transport = _connect(
                dist.PrefixStore("ring", store),
                rank=rank,
                world_size=world_size,
                backend=backend,
                transport=transport,
                timeout_s=timeout_s,
                connect_timeout_s=connect_timeout_s,
                segment_bytes=segment_bytes,
                group=group,
                symm=symm or SymmConfig(),
            )
            self._segment_range = (
                (segment_bytes, segment_bytes) if segment_bytes else self._transport.segment_range
            )
            if not self._transport.inline:
                self._thread = _CommThread(f"ringflow-ring-{rank}")
        self._inline_lock = threading.Lock()
        self._store = store  # kept alive: on rank 0 it serves the other ranks

    @property
    def transport(self) -> str:
        """The transport in use: ``shm``, ``gloo``, ``nccl``, ``symm``, or ``none`` for one rank."""
        return "none" if self._transport is None else self._transport.name

    def allreduce_async_(self, tensor: torch.Tensor, *, op: ReduceOp = "sum") -> CollectiveWork:
        check_reduce_op(op, tensor)
        if self._transport is None:
            return CompletedWork(tensor)
        return self._start(
            "allreduce", tensor, lambda deadline: self._allreduce(tensor, op, deadline)
        )

    def reduce_scatter_async_(
        self, tensor: torch.Tensor, *, out: torch.Tensor, op: ReduceOp = "sum"
    ) -> CollectiveWork:
        """The reduce-scatter half of the ring's all-reduce, each rank ending with its own
        shard (``Collective.reduce_scatter_async_``), under the same deadline; float32
        travels as ``compression`` and is summed in float32, as in an all-reduce."""
        check_shards(tensor, out, self.world_size, what="tensor")
        check_reduce_op(op, tensor)
        if self._transport is None:
            if out.data_ptr() != tensor.data_ptr():
                out.view(-1).copy_(tensor.view(-1))
            return CompletedWork(out)
        return self._start(
            "reduce_scatter",
            tensor,
            lambda deadline: self._reduce_scatter(tensor, out, op, deadline),
        )

    def all_gather_into_async_(self, shard: torch.Tensor, *, out: torch.Tensor) -> CollectiveWork:
        """The all-gather half of the ring's all-reduce (``Collective.all_gather_into_async_``),
        under the same deadline."""
        check_shards(out, shard, self.world_size, what="out")
        mine = shard_of(out, self.rank, self.world_size)
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard.view(-1))
        if self._transport is None:
            return CompletedWork(out)
        flat = out.view(-1)
        return self._start(
            "all_gather", flat, lambda deadline: (out, self._gather_into(flat, deadline))
        )

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        transport_empty = getattr(self._transport, "empty", None)
        if transport_empty is None or torch.device(device).type != "cuda":
            return super().empty(numel, dtype, device)
        with torch.cuda.device(device):
            return transport_empty(numel, dtype)

    def broadcast_(self, tensor: torch.Tensor, *, src: int = 0) -> torch.Tensor:
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be in [0, {self.world_size}), got {src}")
        if self._transport is None:
            return tensor
        return self._start(
            "broadcast", tensor, lambda deadline: self._broadcast(tensor, src, deadline)
        ).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(self.all_gather_async(tensor).wait().unbind(0))

    def all_gather_async(self, tensor: torch.Tensor) -> CollectiveWork:
        """Start gathering every rank's ``tensor`` (all of one shape); the work's ``wait``
        gives them stacked, in rank order."""
        out = tensor.new_empty((self.world_size, *tensor.shape))
        out[self.rank].copy_(tensor)
        if self._transport is None:
            return CompletedWork(out)
        return self._start("all_gather", out, lambda deadline: self._all_gather(out, deadline))

    def check(self) -> None:
        if self._failure is None and self._transport is not None:
            try:
                self._transport.check()
            except CollectiveError as err:
                self._failure = err
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    # -- running one collective ----------------------------------------------------------

    def _start(
        self, op: str, tensor: torch.Tensor, body: Callable[[Deadline], _Started]
    ) -> CollectiveWork:
        if self._transport is None:
            raise CollectiveError("the ring is closed")
        if self._transport.inline:  # it only enqueues device work: no thread needed
            with self._inline_lock:
                return _DeviceWork(*self._run(op, tensor, body), ring=self)
        return _RingWork(self._thread.submit(lambda: self._run(op, tensor, body)), self, op=op)

    def _run(self, op: str, tensor: torch.Tensor, body: Callable[[Deadline], _Started]):
        if self._failure is not None:
            raise self._failure  # the ring lost a peer: every later collective fails too
        self._running = deadline = Deadline.after(self._timeout_s, op=op)
        try:
            with _on_device(tensor):
                return body(deadline)
        except CollectiveError as err:
            self._failure = err
            raise
        finally:
            self._running = None

    def _settle(self, completion: Completion | None) -> None:
        """Wait for the device work a transport left running; remember a failure."""
        if completion is None:
            return
        try:
            completion.wait()
        except CollectiveError as err:
            self._failure = err
            raise

    def _wedged_for(self) -> float:
        """How far the running collective is past its deadline (0 when none or not yet)."""
        running = self._running
        return 0.0 if running is None else max(0.0, -running.remaining())

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp, deadline: Deadline) -> _Started:
        flat = _flat(tensor)
        wire = self._wire if self._wire is not None and tensor.dtype == torch.float32 else None
        wire = wire or tensor.dtype
        plan = Plan(
            lambda: allreduce_schedule(
                flat,
                rank=self.rank,
                world_size=self.world_size,
                segment_elems=self._elems(-(-flat.numel() // self.world_size), wire, flat.dtype),
                wavefront=self._transport.wavefront,
            ),
            key=("allreduce", *_shape_of(flat), wire, op),
            keep=flat,
            operand=(flat, op),
        )
        finish = _finisher(op, self.world_size)
        completion = self._transport.run(plan, wire=wire, finish=finish, deadline=deadline)
        return _unflat(flat, tensor, completion)

    def _reduce_scatter(
        self, tensor: torch.Tensor, out: torch.Tensor, op: ReduceOp, deadline: Deadline
    ) -> _Started:
        flat = tensor.view(-1)
        wire = self._wire if self._wire is not None and tensor.dtype == torch.float32 else None
        wire = wire or tensor.dtype
        chunk = flat.numel() // self.world_size
        plan = Plan(
            lambda: reduce_scatter_schedule(
                flat,
                rank=self.rank,
                world_size=self.world_size,
                segment_elems=self._elems(chunk, wire, flat.dtype),
                wavefront=self._transport.wavefront,
            ),
            key=("reduce_scatter", *_shape_of(flat), wire, op),
            keep=(flat, out),
        )
        finish = _finisher(op, self.world_size)
        completion = self._transport.run(plan, wire=wire, finish=finish, deadline=deadline)
        mine = shard_of(flat, self.rank, self.world_size)
        if mine.data_ptr() == out.data_ptr():
            return out, completion
        return _unflat(mine, out, completion)

    def _gather_into(self, flat: torch.Tensor, deadline: Deadline) -> Completion | None:
        plan = Plan(
            lambda: all_gather_schedule(
                flat,
                rank=self.rank,
                world_size=self.world_size,
                segment_elems=self._elems(flat.numel() // self.world_size, flat.dtype),
                wavefront=self._transport.wavefront,
            ),
            key=("all_gather", *_shape_of(flat)),
            keep=flat,
        )
        return self._transport.run(plan, wire=flat.dtype, finish=None, deadline=deadline)

    def _broadcast(self, tensor: torch.Tensor, src: int, deadline: Deadline) -> _Started:
        flat = _flat(tensor)
        plan = Plan(
            lambda: broadcast_schedule(
                flat,
                rank=self.rank,
                world_size=self.world_size,
                src=src,
                segment_elems=self._elems(flat.numel(), flat.dtype),
            ),
            key=("broadcast", *_shape_of(flat), src),
            keep=flat,
        )
        completion = self._transport.run(plan, wire=flat.dtype, finish=None, deadline=deadline)
        return _unflat(flat, tensor, completion)

    def _all_gather(self, out: torch.Tensor, deadline: Deadline) -> _Started:
        flat = out.view(-1)
        plan = Plan(
            lambda: all_gather_schedule(
                flat,
                rank=self.rank,
                world_size=self.world_size,
                segment_elems=self._elems(out[0].numel(), out.dtype),
                wavefront=self._transport.wavefront,
            ),
            key=("all_gather", *_shape_of(flat)),
            keep=out,
        )
        return out, self._transport.run(plan, wire=out.dtype, finish=None, deadline=deadline)

    def _elems(self, chunk: int, *dtypes: torch.dtype) -> int:
        """Elements per segment of a ``chunk``-element chunk, the same on every rank.

        Compressed or not, a segment covers the same elements, and its wire form fits a slot.
        """
        itemsize = max(d.itemsize for d in dtypes)
        smallest, largest = (max(1, b // itemsize) for b in self._segment_range)
        return max(smallest, min(largest, -(-chunk // self._transport.pipeline_depth)))


class _RingWork(CollectiveWork):
    """A collective queued on the ring's communication thread."""

    def __init__(self, future: concurrent.futures.Future, ring: RingCollective, *, op: str) -> None:
        self._future, self._ring, self._op = future, ring, op

    def wait(self) -> torch.Tensor:
        while True:
            try:
                result, completion = self._future.result(timeout=0.5)
                self._ring._settle(completion)
                return result
            except concurrent.futures.TimeoutError:
                # Deadlines are enforced on the communication thread; this only catches a
                # thread stuck where no deadline reaches (a hung driver call).
                if self._ring._wedged_for() > _WEDGED_GRACE_S:
                    raise CollectiveTimeoutError(
                        f"the ring's communication thread is stuck {_WEDGED_GRACE_S:g} s past "
                        "its deadline",
                        peer=None,
                        op=self._op,
                        rank=self._ring.rank,
                    ) from None

    def is_completed(self) -> bool:
        return self._future.done()


class _DeviceWork(CollectiveWork):
    """A collective whose hops are enqueued on the device; ``wait`` waits for them."""

    def __init__(
        self, result: torch.Tensor, completion: Completion | None, *, ring: RingCollective
    ) -> None:
        self._result, self._completion, self._ring = result, completion, ring
        self._waited = False

    def wait(self) -> torch.Tensor:
        """Order the calling stream after the collective, on every call: a timeline's probe
        stream may wait for it first, the compute stream later."""
        self._ring._settle(self._completion)
        self._waited = True
        return self._result

    def is_completed(self) -> bool:
        return self._waited


class _CommThread:
    """Runs submitted functions one at a time, in submission order, on a daemon thread."""

    def __init__(self, name: str) -> None:
        self._queue: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._ready:
            self._queue.append((fn, future))
            self._ready.notify()
        return future

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._ready:
            self._queue.append(None)
            self._ready.notify()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue)
                item = self._queue.popleft()
            if item is None:
                return
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:  # noqa: BLE001 - handed to the waiter
                    future.set_exception(err)


def _connect(
    store: dist.Store,
    *,
    rank: int,
    world_size: int,
    backend: str,
    transport: str,
    timeout_s: float,
    connect_timeout_s: float,
    segment_bytes: int | None,
    group: dist.ProcessGroup | None,
    symm: SymmConfig,
) -> Transport:
    if group is not None and backend != "nccl":
        raise ValueError("group is for the nccl backend; gloo rings connect through the store")
    if transport == "auto":
        transport = _pick_transport(store, backend=backend, rank=rank, world_size=world_size)
    common = {"store": store, "rank": rank, "world_size": world_size}
    if transport == "shm":
        slot = segment_bytes or ShmTransport.segment_range[1]
        return ShmTransport(**common, segment_bytes=slot)
    if transport == "gloo":
        return GlooTransport(**common, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
    nccl = {"timeout_s": timeout_s, "connect_timeout_s": connect_timeout_s, "group": group}
    if transport == "nccl":
        return NcclTransport(**common, **nccl)
    return SymmTransport(**common, **nccl, settings=symm.with_environment())


def _pick_transport(store: dist.Store, *, backend: str, rank: int, world_size: int) -> str:
    # Every rank must pick the same: shared memory needs all of them on this host, able to
    # use it (on CPU /dev/shm; on GPU see symm_unusable).
    if backend == "nccl":
        return "nccl" if symm_unusable(store, rank=rank, world_size=world_size) else "symm"
    local = same_host(store, rank=rank, world_size=world_size)
    store.set(f"shm_ok/{rank}", b"1" if shm_available() else b"0")
    usable = store.multi_get([f"shm_ok/{q}" for q in range(world_size)])
    return "shm" if local and all(v == b"1" for v in usable) else "gloo"


def _check_arguments(*, backend: str, timeout_s: float, transport: str) -> None:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    gpu = transport in ("nccl", "symm")
    if transport != "auto" and gpu != (backend == "nccl"):
        raise ValueError(
            f"transport {transport!r} does not run on the {backend!r} backend: use "
            + ("'nccl' or 'symm' with backend='nccl'" if gpu else "'shm' or 'gloo' with 'gloo'")
        )
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")


def _finisher(op: ReduceOp, world_size: int) -> Finisher | None:
    """What a rank does to its finished chunk before passing it on, or ``None``."""
    if op != "avg":
        return None

    def finish(segment: torch.Tensor) -> None:
        segment.div_(world_size)

    return finish


def _shape_of(flat: torch.Tensor) -> tuple:
    """What a collective's schedule depends on in its (flat, contiguous) tensor."""
    return (flat.device, flat.data_ptr(), flat.numel(), flat.dtype)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _unflat(flat: torch.Tensor, tensor: torch.Tensor, completion: Completion | None) -> _Started:
    """``tensor`` holding the result computed in ``flat``, once ``completion`` is waited for."""
    if flat.data_ptr() == tensor.data_ptr() and tensor.is_contiguous():
        return tensor, completion
    if completion is None:  # the transport is done already
        tensor.copy_(flat.view_as(tensor))
        return tensor, None
    return tensor, _CopyBack(completion, flat=flat, tensor=tensor)


class _CopyBack(Completion):
    """Device work that ran on a contiguous copy of ``tensor``: copy back once it is done.

    The copy runs on the stream that waits, after the collective, never on the side stream
    while the collective may still be running.
    """

    def __init__(self, completion: Completion, *, flat: torch.Tensor, tensor: torch.Tensor):
        self._completion, self._flat, self._tensor = completion, flat, tensor

    def wait(self) -> None:
        self._completion.wait()
        self._tensor.copy_(self._flat.view_as(self._tensor))


def _on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """A thread's current CUDA device starts at 0: follow the tensor's."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
