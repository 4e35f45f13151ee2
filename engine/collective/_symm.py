"""The ring over GPU symmetric memory: NVLink peer writes between GPUs of one host.

NCCL's point-to-point, which :class:`~engine.collective._p2p.NcclTransport` uses, moves
segments through NCCL's own staging buffers, and it is slower than NCCL's all-reduce until
messages reach a GiB. On one host the GPUs can write into each other's memory directly, as
the ``shm`` transport's processes do on CPU: every rank allocates a staging buffer in
``torch.distributed``'s symmetric memory, maps its right neighbour's, and a hop is

1. a copy of the segment into the right neighbour's staging buffer (NVLink stores, the wire
   dtype's conversion folded in),
2. a signal to the right neighbour, and a wait for the left one's,
3. the addition (reduce-scatter) or copy (all-gather) of the own staging slot into place.

Each hop has its own slot, so no slot is written twice within a collective; a barrier at the
end of each collective lets the next one reuse them. Everything runs on the ring's side
stream, as on NCCL, and the same watchdog holds it to its deadline; when a chunk is cut into
segments, the pushes run on a second stream that joins the side stream at the end, so a
segment crosses NVLink while the one before it is added (``overlap=False``: one
stream; ``depth``: segments per chunk; each setting is a field of ``SymmConfig``).

Host time. A collective is a dozen small launches and their Python, which on a slow host cost
more than the GPU's work. So the first collective on a tensor (same address, length, dtype,
reduction) is recorded as a CUDA graph and later ones replay it: one launch. Gradient buckets
and benchmark buffers are the same tensors every step; growing the staging buffers drops the
graphs (``graphs=False`` launches every kernel each time instead).

Failures. A peer that dies or stops answering leaves this rank's signal waits unanswered. At
the deadline the watchdog agrees on the lost peer, as on NCCL, then answers the waits itself:
from a stream of its own it sets the fused kernel's abort word, and sets every rank's signal
slots of the ring's schedule to 1 and 0 in turn, until the side stream has drained (the mapped
memory of a dead peer stays writable: its pages live until every rank that mapped them lets
go). The collective ends with meaningless data the caller never sees; its wait raises
``CollectiveTimeoutError`` (or ``PeerLostError``), and the CUDA context stays usable, so the
elastic layer rebuilds the ring in the same process (tested on 2 H100s with a peer that exits
and with one that stops answering: ``tests/test_ring_gpu.py``). Two details make that work:
the release's kernel is loaded when the ring connects (CUDA loads kernels lazily, and loading
one while another spins blocks until the spinner ends), and the first rendezvous, which sets
up the inter-process mappings and can outlast a deadline, happens then too. Should the
release fail, the waiting kernels give up by themselves ``_KERNEL_GRACE_S`` after the deadline.
"""

from __future__ import annotations

import collections
import logging
import time

import torch
import torch.distributed as dist

from ringflow.engine.collective._fused import (
    FusedAllReduce,
    SymmetricTensors,
    allocate,
    fused_supported,
    piece_elements,
    signal_pads,
)
from ringflow.engine.collective._p2p import NcclTransport
from ringflow.engine.collective._schedule import Hop, Schedule
from ringflow.engine.collective._symm_store import GroupSequenceStore
from ringflow.engine.collective._transport import Finisher, Plan, keep_wire_rounding, land
from ringflow.engine.config import SymmConfig

__all__ = ["SymmTransport", "symm_available", "symm_unusable"]

_log = logging.getLogger(__name__)

_CHANNELS = 4
"""Signal channels used round-robin by consecutive hops, so several can be in flight (on one
stream; overlapped pushes use more). The channel after the last is the barrier's."""
_INITIAL_ELEMENTS = 16 << 20
"""Staging allocated when the ring connects (64 MiB of float32); larger collectives grow it."""
_GRAPHS = 64
"""Recorded collectives kept (least recently used dropped first)."""
_FUSED_ALL = 1 << 62
"""``SymmConfig.fused_below=None``: all-reduces of fewer bytes than this run as one fused kernel
(``_fused``) instead of the ring's schedule, where Triton is available and the wire is the
tensor's dtype: all of them by default, the fused kernel being the faster at every size
measured. The ring's schedule still carries what travels in another dtype (``compression``)."""
_KERNEL_GRACE_S = 30.0
"""How long past the collective deadline a waiting kernel spins before it gives up: the
watchdog must raise the typed error first."""


def symm_available() -> bool:
    """Whether this process can use symmetric memory (CUDA, and a torch that has it)."""
    if not torch.cuda.is_available():
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return hasattr(symm_mem, "rendezvous") and hasattr(symm_mem, "empty")


class SymmTransport(NcclTransport):
    """Ring neighbours over symmetric memory (CUDA tensors, every rank on this host).

    Args are those of :class:`NcclTransport`, whose process group, side stream, deadline
    watchdog and blame protocol it shares (NCCL itself carries no data here), and
    ``settings``: how this transport runs, the same on every rank.
    """

    name = "symm"
    # SymmConfig.depth, 2: chunks of 32 MiB and more go as two segments, so that one travels
    # while the other is added (pushes run on a stream of their own); smaller chunks go whole,
    # where two signals and launches would cost more than the overlap gains.
    segment_range = (16 << 20, 1 << 62)
    _hang = "a hop through GPU shared memory hung"

    def __init__(self, *, settings: SymmConfig, **kwargs) -> None:
        _check_usable(kwargs["store"], rank=kwargs["rank"], world_size=kwargs["world_size"])
        super().__init__(**kwargs)
        self._settings = settings
        self._buffers: dict[torch.dtype, _Staging] = {}
        self._graphs: collections.OrderedDict[tuple, torch.cuda.CUDAGraph] | None = None
        if settings.graphs:
            self._graphs = collections.OrderedDict()
        self.pipeline_depth = settings.depth
        # Everything the release needs, made now: with CUDA's lazy module loading, loading a
        # kernel while another spins waiting can block until that one ends, which it won't.
        device = torch.device("cuda", torch.cuda.current_device())
        self._pusher: torch.cuda.Stream | None = None
        if settings.overlap:
            self._pusher = torch.cuda.Stream(device=device)
        self._releaser = torch.cuda.Stream(device=device)
        with torch.cuda.stream(self._releaser):
            torch.zeros(1, dtype=torch.int32, device=device).fill_(1)
        self._releaser.synchronize()
        # The first rendezvous sets up CUDA's inter-process mappings, which can take longer
        # than a collective's deadline: do it now, outside any deadline, at a size that
        # serves gradient buckets without growing.
        self._staging(torch.float32, _INITIAL_ELEMENTS)
        self._timeout_ms = int((kwargs["timeout_s"] + _KERNEL_GRACE_S) * 1000)
        self._world_size = kwargs["world_size"]
        # The fused path's buffers, made (and its kernel compiled) now for the same reason.
        self._fused: dict[torch.dtype, FusedAllReduce | None] = {}
        self._symmetric = SymmetricTensors(self._group)
        self._symmetric_buckets = settings.buckets
        self._fused_below = _FUSED_ALL if settings.fused_below is None else settings.fused_below
        if self._fused_below > 0:
            for dtype in (torch.float32, torch.bfloat16):
                self._fused_buffer(dtype, _INITIAL_ELEMENTS)

    def _group_store(self, store: dist.Store) -> dist.Store:
        # A worker that joins a ring later must meet the others' symmetric-memory handles.
        return GroupSequenceStore(store)

    def _issue(self, plan: Plan, *, wire: torch.dtype, finish: Finisher | None) -> None:
        """Replay the collective recorded for ``plan.key``, recording it the first time."""
        key = None if self._graphs is None or plan.key is None else (*plan.key, wire)
        graph = None if key is None else self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.replay()
            return
        fused = self._fused_for(plan, wire)
        if fused is not None:
            flat, op = plan.operand
            timeout_s, peers = self._timeout_ms / 1000, self._symmetric.peers(flat)

            def enqueue() -> None:
                fused.run(flat, average=op == "avg", timeout_s=timeout_s, peers=peers)
        else:
            self._prepare(*_sides(plan.schedule), wire)  # may rendezvous: not while recording

            def enqueue() -> None:
                self._enqueue(plan.schedule, wire=wire, finish=finish)

        graph = None if key is None else self._record(enqueue)
        if graph is None:
            enqueue()
            return
        self._graphs[key] = graph
        while len(self._graphs) > _GRAPHS:
            self._graphs.popitem(last=False)
        graph.replay()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor for all-reducing again and again (gradient buckets): in symmetric
        memory (unless ``SymmConfig.buckets`` is off), so that the fused kernel writes the sums
        straight into every rank's copy (collective: every rank allocates alike)."""
        device = torch.device("cuda", torch.cuda.current_device())
        if (
            not self._symmetric_buckets
            or self._fused_below <= 0
            or not fused_supported(dtype, self._world_size)
        ):
            return torch.zeros(numel, dtype=dtype, device=device)
        return self._symmetric.empty(numel, dtype)

    def _fused_for(self, plan: Plan, wire: torch.dtype) -> FusedAllReduce | None:
        """The fused kernel's buffer if ``plan`` runs as one kernel, else ``None``."""
        if plan.operand is None:
            return None
        flat, _ = plan.operand
        size = flat.numel() * flat.element_size()
        if wire != flat.dtype or size >= self._fused_below:
            return None
        return self._fused_buffer(wire, flat.numel())

    def _fused_buffer(self, dtype: torch.dtype, elements: int) -> FusedAllReduce | None:
        """The fused path's buffer for ``dtype``, grown (on every rank alike) to ``elements``;
        ``None`` where the fused kernel cannot run."""
        current = self._fused.get(dtype, False)
        if current is None:
            return None
        piece = piece_elements(dtype, elements, self._settings)
        if current and current.piece >= piece:
            return current  # large enough, or the largest: larger collectives go in pieces
        if not fused_supported(dtype, self._world_size):
            self._fused[dtype] = None
            return None
        if current:
            torch.cuda.current_stream().synchronize()  # queued collectives use the old one
            if self._graphs is not None:
                self._graphs.clear()
        in_place = self._symmetric_buckets
        self._fused[dtype] = current = FusedAllReduce(
            self._group, dtype, piece, settings=self._settings, in_place=in_place
        )
        return current

    def _record(self, enqueue) -> torch.cuda.CUDAGraph | None:
        """What ``enqueue`` launches as a CUDA graph of the current stream, or ``None`` if it
        cannot be recorded here."""
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: backward keeps launching from autograd's threads meanwhile.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                enqueue()
            finally:
                graph.capture_end()
        except RuntimeError:
            _log.warning(
                "the ring cannot record its collectives as CUDA graphs here; each collective is "
                "launched one kernel at a time from now on",
                exc_info=True,
            )
            self._graphs = None
            return None
        return graph

    def _prepare(self, sends: list[Hop], recvs: list[Hop], wire: torch.dtype) -> _Staging:
        """The staging buffer these hops need, grown on every rank alike if needed."""
        needed = max(_total(h.send for h in sends), _total(h.recv for h in recvs), 1)
        return self._staging(wire, needed)

    def _enqueue(self, schedule: Schedule, *, wire: torch.dtype, finish: Finisher | None) -> None:
        sends, recvs = _sides(schedule)
        staging = self._prepare(sends, recvs, wire)
        # Slots by tag: this rank's sends and its right neighbour's receives carry the same
        # tags and sizes, so both compute the same offsets.
        send_at = _offsets(sends, lambda h: h.send)
        recv_at = _offsets(recvs, lambda h: h.recv)
        # With segments (lag > 1) the pushes (NVLink) run on a stream of their own and the
        # waits and folds (local memory) on the side stream, so that segment k + 1 travels
        # while segment k is added. A push then waits only for the fold that produced what
        # it sends (lag hops back), and a rank's pushes run at most 2 * lag signals ahead of
        # what its neighbour has consumed: 2 * lag + 1 channels never hold two at once.
        side = torch.cuda.current_stream()
        overlap = self._pusher is not None and schedule.lag > 1
        pusher = self._pusher if overlap else side
        channels = 2 * schedule.lag + 1 if overlap else _CHANNELS
        if overlap:
            pusher.wait_stream(side)
        handle, timeout_ms = staging.handle, self._timeout_ms
        landed: list[tuple[int, torch.cuda.Event]] = []
        sent = received = 0
        for i, hop in enumerate(schedule.hops):
            if hop.send is not None:
                ready = [event for at, event in landed if at <= i - schedule.lag]
                with torch.cuda.stream(pusher):
                    if ready:
                        pusher.wait_event(ready[-1])
                    self._push(hop, staging, send_at[hop.tag], wire)
                    handle.put_signal(self._right, sent % channels, timeout_ms)
                sent += 1
            if hop.recv is not None:
                handle.wait_signal(self._left, received % channels, timeout_ms)
                received += 1
                start = recv_at[hop.tag]
                land(hop, staging.mine[start : start + hop.recv.numel()], finish)
                if overlap:
                    landed.append((i, torch.cuda.Event()))
                    landed[-1][1].record(side)
        if overlap:
            side.wait_stream(pusher)
        handle.barrier(channels, timeout_ms)  # every slot read: the next may reuse them

    def _push(self, hop: Hop, staging: _Staging, start: int, wire: torch.dtype) -> None:
        assert hop.send is not None
        slot = staging.right[start : start + hop.send.numel()]
        if hop.owned and hop.send.dtype != wire:
            outgoing = hop.send.to(wire)
            keep_wire_rounding(hop, outgoing)
            slot.copy_(outgoing)
        else:
            slot.copy_(hop.send.view(-1))

    def _staging(self, wire: torch.dtype, elements: int) -> _Staging:
        """The staging buffer for ``wire``, grown (on every rank alike) to ``elements``."""
        current = self._buffers.get(wire)
        if current is None or current.elements < elements:
            # Every rank runs the same collectives on the same sizes, so they all grow here
            # together: rendezvous is collective. Powers of two keep regrowth rare.
            size = 1 << max(20, (elements - 1).bit_length())
            if current is not None:
                # Collectives still queued on the side stream may use the old buffer, and
                # the recorded ones point at it.
                torch.cuda.current_stream().synchronize()
                if self._graphs is not None:
                    self._graphs.clear()
            self._buffers[wire] = current = _Staging(self._group, wire, size, right=self._right)
        return current

    def _abort(self) -> None:
        """Answer every signal wait of the side stream's hung work, until it has drained."""
        try:
            self._release()
        except Exception:  # the verdict stands; the kernels then give up by themselves
            _log.exception("could not release the ring's waiting kernels")

    def _release(self) -> None:
        side, buffers = self._stream, list(self._buffers.values())
        if side is None:
            return
        with torch.cuda.device(side.device):
            releaser = self._releaser
            with torch.cuda.stream(releaser):
                for fused in self._fused.values():
                    if fused:
                        fused.abort.fill_(1)  # its kernels' waits end, and they drain
            # The ring's signals are torch's, which know no abort: a wait takes a slot at 1, a
            # put one at 0, and a put into a peer that stopped taking its signals finds 1
            # forever. Every rank's pads are set to 1 and to 0 in turn until the side stream
            # drained, so each finds what it waits for (the peers' results are meaningless
            # by now, and theirs are released alike).
            pads = [pad for staging in buffers for pad in staging.pads()]
            give_up = time.monotonic() + _KERNEL_GRACE_S
            value = 1
            while not side.query() and time.monotonic() < give_up:
                with torch.cuda.stream(releaser):
                    for pad in pads:
                        pad.fill_(value)
                releaser.synchronize()
                value ^= 1
                time.sleep(1e-3)

    def close(self) -> None:
        if self._graphs is not None:
            self._graphs.clear()
        self._buffers.clear()
        self._fused.clear()
        self._symmetric.clear()
        super().close()


def symm_unusable(store: dist.Store, *, rank: int, world_size: int) -> str | None:
    """Why symmetric memory cannot serve this ring, or ``None`` if it can.

    Every rank publishes what it has before any decides, so all of them reach the same answer:
    every rank on this host, each able to use symmetric memory, each on a GPU index of its own
    (processes that each see their one GPU as ``cuda:0`` cannot map each other's).
    """
    from ringflow.engine.collective._rendezvous import same_host

    local = same_host(store, rank=rank, world_size=world_size)
    mine = str(torch.cuda.current_device()) if symm_available() else "-"
    store.set(f"symm_device/{rank}", mine.encode())
    devices = [d.decode() for d in store.multi_get([f"symm_device/{q}" for q in range(world_size)])]
    if "-" in devices:
        return f"a rank has no CUDA or no symmetric memory in its torch (here: {torch.__version__})"
    if not local:
        return "the ranks are not all on this host"
    if len(set(devices)) != world_size:
        return (
            f"ranks share GPU indices (devices {devices}); let each process see every GPU and "
            "pick its own (Ray: RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, as the engine's "
            "workers do)"
        )
    return None


def _check_usable(store: dist.Store, *, rank: int, world_size: int) -> None:
    """Refuse, on every rank alike, a ring that symmetric memory cannot serve."""
    why = symm_unusable(store, rank=rank, world_size=world_size)
    if why is not None:
        raise ValueError(
            f"transport 'symm' cannot serve this ring: {why}. Use transport='nccl' (or 'auto', "
            "which picks it then)"
        )


class _Staging:
    """This rank's staging buffer and a view of its right neighbour's."""

    def __init__(
        self, group: dist.ProcessGroup, dtype: torch.dtype, elements: int, *, right: int
    ) -> None:
        self.elements = elements
        self.handle, stages = allocate(group, elements, dtype)
        self.mine, self.right = stages[self.handle.rank], stages[right]

    def pads(self) -> list[torch.Tensor]:
        """Every rank's signal pad, as int32 words."""
        return signal_pads(self.handle)


def _sides(schedule: Schedule) -> tuple[list[Hop], list[Hop]]:
    """The schedule's hops that send, and those that receive."""
    sends = [hop for hop in schedule.hops if hop.send is not None]
    return sends, [hop for hop in schedule.hops if hop.recv is not None]


def _total(tensors) -> int:
    return sum(t.numel() for t in tensors)


def _offsets(hops: list[Hop], tensor_of) -> dict[int, int]:
    offsets, at = {}, 0
    for hop in sorted(hops, key=lambda h: h.tag):
        offsets[hop.tag] = at
        at += tensor_of(hop).numel()
    return offsets
