"""Horovod's tensor and object collectives on ringflow's ring.

As under Horovod, an operation runs once every rank (of its process set) has asked for it,
matched by its ``name=`` (an unnamed one by its kind and how many of that kind the rank asked
for before), so ranks may start operations in different orders; one asked for on one rank only
waits there (``ringflow.horovod.coordinator``). Those that return a new tensor, differentiable
as Horovod's are, are autograd functions over these handles
(``ringflow.horovod.differentiable``).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from ringflow.engine.collective.base import CompletedWork
from ringflow.horovod import negotiation
from ringflow.horovod.basics import OPS, Average, HorovodError, Max, Min, Sum, ring, size
from ringflow.horovod.coordinator import Request, coordinator
from ringflow.horovod.process_sets import current, in_process_set, within

__all__ = [
    "Handle",
    "allgather_async",
    "allgather_object",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall_async",
    "barrier",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_parameters",
    "grouped_allgather_async",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]

_PENDING = object()


class Handle:
    """An operation started by an ``*_async`` call: :func:`poll` tells whether it finished,
    :func:`synchronize` waits for it and gives its result. ``requests``: what it waits for
    in the queue before it runs."""

    def __init__(
        self,
        wait: Callable[[], Any],
        done: Callable[[], bool] = lambda: True,
        requests: Sequence[Request] = (),
    ) -> None:
        self._wait, self._done, self.requests = wait, done, tuple(requests)
        self.result: Any = _PENDING

    def finished(self) -> bool:
        return self.result is not _PENDING or self._done()

    def in_flight(self) -> bool:
        """Whether a second operation of its name is refused (see ``Request.in_flight``)."""
        return self.result is _PENDING and any(r.in_flight() for r in self.requests)

    def wait(self) -> Any:
        if self.result is _PENDING:
            self.result = self._wait()
        return self.result


def _on(work: Any, finish: Callable[[torch.Tensor], Any]) -> Handle:
    """The handle of ``work`` (a ring collective in flight); ``finish`` makes its result."""
    return Handle(lambda: finish(work.wait()), work.is_completed)


def _done(result: Any) -> Handle:
    return Handle(lambda: result)


def _group(handles: list[Handle]) -> Handle:
    """One handle for a grouped operation: its result is every member's, in order."""
    return Handle(
        lambda: [h.wait() for h in handles],
        lambda: all(h.finished() for h in handles),
        [r for h in handles for r in h.requests],
    )


def _ask(kind: str, tensor: torch.Tensor | None, name: str | None, start, **how) -> Handle:
    """Ask the ranks for an operation (``Coordinator.ask``); its handle. ``start`` runs it,
    on every rank in the same cycle, and gives a handle on its result.

    Raises:
        HorovodError: it ran in this call's cycle and failed: the ranks disagree on it, or
            another rank refused it.
        Exception: this rank's ``refusal=``, where it failed in this call's cycle.
    """
    request = coordinator().ask(kind, tensor, name, start, **how)
    if request.error is not None:
        raise request.error

    def wait() -> Any:
        request.owner.wait(request)
        if request.error is not None:
            raise request.error
        return request.started.wait()

    def done() -> bool:
        if request.ran_in is None:
            return False
        return request.error is not None or request.started.finished()

    return Handle(wait, done, [request])


_in_flight: dict[str, Handle] = {}  # this rank's async operations by name, not yet waited for


def _named(kind: str, name: str | None) -> None:
    """Refuse a second operation of a name still in flight, as Horovod does.

    Raises:
        ValueError: an operation of this ``name`` is still in flight on this rank.
    """
    if name is not None and name in _in_flight and _in_flight[name].in_flight():
        raise ValueError(f"{kind} {name!r}: an operation of that name is still in flight")


def _started(name: str | None, handle: Handle) -> Handle:
    if name is not None:
        _in_flight[name] = handle
    return handle


def _op(average: bool | None, op: str | None, default: str = Average) -> str:
    if average is not None and op is not None:
        raise ValueError("allreduce takes average= or op=, not both")
    if op is None:
        return default if average is None else (Average if average else Sum)
    if op not in OPS:
        raise HorovodError(f"op {op!r} is not supported: ringflow.horovod has {', '.join(OPS)}")
    return op


@in_process_set
def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start replacing ``tensor`` by its average (``op=Average``, the default), sum, min, max
    or product over the ranks; returns a handle for :func:`synchronize`. An integer
    tensor's average is truncated toward zero, as Horovod's.

    Raises:
        HorovodError: the ranks gave tensors of different dtypes or shapes, or ops.
        ValueError: an operation of this ``name`` is still in flight on this rank.
    """
    op = _op(average, op)
    _named("allreduce", name)
    return _started(
        name,
        _ask(
            "allreduce",
            tensor,
            name,
            partial(_reduce, tensor, op, prescale_factor, postscale_factor),
            op=op,
        ),
    )


def _reduce_asked(tensor: torch.Tensor, op: str, pre: float, post: float, label: str | None):
    """:func:`_reduce` of an unnamed operation asked for through the queue, named ``label`` in
    the timeline (``DistributedOptimizer``'s gradients while a rank is in ``hvd.join``: its
    row tells the joined ranks the shape of their zeros)."""
    start = partial(_reduce, tensor, op, pre, post)
    return _ask("allreduce", tensor, None, start, op=op, label=label)


def _reduce(tensor: torch.Tensor, op: str, pre: float, post: float) -> Handle:
    """The all-reduce itself, into ``tensor`` (``DistributedOptimizer``'s gradients come
    here directly: their shapes were agreed once, when it was built)."""
    flat = tensor.detach().reshape(-1).contiguous()
    if pre != 1.0:
        flat = _scaled(flat.clone(), pre)
    scale = post / (size() if op == Average else 1)
    if op in (Average, Sum):
        work = ring().allreduce_async_(flat, op="sum")
    else:  # the ring sums: min, max and product reduce every rank's tensor here
        work = CompletedWork(_elementwise(flat, op))
    return _on(work, lambda reduced: _into(tensor, _scaled(reduced, scale)))


def _elementwise(flat: torch.Tensor, op: str) -> torch.Tensor:
    every = torch.stack(ring().all_gather(flat))
    if op == Min:
        return every.amin(0)
    if op == Max:
        return every.amax(0)
    return every.prod(0).to(flat.dtype)


def _into(target: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    if reduced.data_ptr() != target.data_ptr():
        target.detach().copy_(reduced.view_as(target))
    return target


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` times ``factor``, in place; integers truncated toward zero."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point():
        return tensor.mul_(factor)
    return tensor.copy_((tensor.double() * factor).trunc())


@in_process_set
def allreduce_async(tensor: torch.Tensor, average=None, name=None, op=None, **kw) -> Handle:
    """As :func:`allreduce_async_`, into a new tensor (``tensor`` is left as it is)."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, **kw)


def poll(handle: Handle) -> bool:
    """Whether the operation behind ``handle`` finished. One that waits for other ranks to
    ask for it runs a cycle (``Coordinator.poll``) first."""
    waiting = [r for r in handle.requests if r.ran_in is None]
    if waiting and handle.result is _PENDING:
        waiting[0].owner.poll(waiting[0])
    return handle.finished()


def synchronize(handle: Handle) -> Any:
    """Wait for the operation behind ``handle``; its result (a tensor; a list of them for a
    grouped operation; ``(tensor, received_splits)`` for an alltoall)."""
    try:
        return handle.wait()
    finally:
        for name in [n for n, h in _in_flight.items() if h is handle]:
            del _in_flight[name]


@in_process_set
def allreduce_(tensor: torch.Tensor, average=None, name=None, op=None, **kw) -> torch.Tensor:
    """Replace ``tensor`` by its average (or sum, min, max, product) over the ranks."""
    return synchronize(allreduce_async_(tensor, average, name, op, **kw))


@in_process_set
def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor], average=None, name=None, op=None, **kw
):
    """Start :func:`allreduce_async_` of each tensor; one handle for them all."""
    return _group(
        [allreduce_async_(t, average, _member(name, i), op, **kw) for i, t in enumerate(tensors)]
    )


@in_process_set
def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor], average=None, name=None, op=None, **kw
):
    """As :func:`grouped_allreduce_async_`, into new tensors."""
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op, **kw)


@in_process_set
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average=None, name=None, op=None, **kw):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, **kw))


def _member(name: str | None, index: int) -> str | None:
    return None if name is None else f"{name}.{index}"


@in_process_set
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Handle:
    """Replace ``tensor`` by rank ``root_rank``'s; a handle whose result is ``tensor``."""
    _named("broadcast", name)
    refusal, root = None, _root(root_rank)
    if not 0 <= root < size():
        refusal = HorovodError(f"broadcast: root_rank {root_rank} is not one of the {size()} ranks")
    start = partial(_broadcast, tensor, root)
    return _started(name, _ask("broadcast", tensor, name, start, root=root, refusal=refusal))


def _broadcast(tensor: torch.Tensor, root: int) -> Handle:
    flat = tensor.detach().reshape(-1).contiguous()
    ring().broadcast_(flat, src=root)
    return _done(_into(tensor, flat))


def _root(root_rank: int) -> int:
    """The place in the ring of ``root_rank`` (a rank of the run, in a process set too)."""
    process_set = current()
    if process_set is None or root_rank not in process_set.ranks:
        return root_rank if process_set is None else -1
    return process_set.ranks.index(root_rank)


@in_process_set
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Handle:
    """As :func:`broadcast_async_`, into a new tensor."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name)


@in_process_set
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Replace ``tensor`` by rank ``root_rank``'s; return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


@in_process_set
def allgather_async(tensor: torch.Tensor, name: str | None = None) -> Handle:
    """Start :func:`allgather`; a handle for :func:`synchronize`."""
    _named("allgather", name)
    return _started(name, _ask("allgather", tensor, name, partial(_concatenating, tensor)))


def _concatenated(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's rows (a scalar is one row), in rank order."""
    return _concatenating(tensor).wait()


def _concatenating(tensor: torch.Tensor) -> Handle:
    """Start gathering every rank's rows: the row counts travel first, then the rows (padded
    to the longest) in the background; the handle gives them concatenated."""
    local = tensor.detach().reshape(-1, *tensor.shape[1:]).contiguous()
    rows = torch.tensor([local.shape[0]], dtype=torch.int64)
    counts = [int(n) for n in ring().all_gather(rows)]
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[: counts[ring().rank]] = local
    work = ring().all_gather_async(padded)
    return _on(work, lambda parts: torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)]))


@in_process_set
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None) -> Handle:
    return _group([allgather_async(t, _member(name, i)) for i, t in enumerate(tensors)])


@in_process_set
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None) -> Handle:
    """Start :func:`alltoall`; the handle's result is ``(tensor, received_splits)``."""
    _named("alltoall", name)
    counts, refusal = _splits(tensor, splits)
    start = partial(_exchanged, tensor, counts)
    return _started(name, _ask("alltoall", tensor, name, start, refusal=refusal))


def _exchanged(tensor: torch.Tensor, counts: list[int]) -> Handle:
    """A handle on rank ``r``'s parts of every rank's ``tensor`` (``counts``: the rows this
    rank sends each rank) and how many rows came from each. It travels as an all-gather over
    the ring (each rank receives every rank's whole tensor)."""
    me = ring().rank
    every_split = torch.stack(ring().all_gather(torch.tensor(counts, dtype=torch.int64)))
    gathered = _concatenated(tensor)
    starts = torch.cumsum(every_split.sum(1), 0) - every_split.sum(1)
    offsets = starts + every_split[:, :me].sum(1)
    received = every_split[:, me]
    parts = [gathered[int(o) : int(o) + int(n)] for o, n in zip(offsets, received, strict=True)]
    return _done((torch.cat(parts), received.to(torch.int32)))


def _splits(tensor: torch.Tensor, splits: Any) -> tuple[list[int], ValueError | None]:
    """The rows for each rank, or why ``splits`` cannot be taken (as Horovod's errors)."""
    n = size()
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if rows % n:
            return [0] * n, ValueError(f"alltoall: {rows} rows do not split into {n} equal parts")
        return [rows // n] * n, None
    if torch.is_tensor(splits) and splits.dtype != torch.int32:
        return [0] * n, ValueError(
            f"alltoall: splits must be a tensor of int32, not {splits.dtype}"
        )
    counts = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    if len(counts) != n or sum(counts) != rows or min(counts) < 0:
        return [0] * n, ValueError(
            f"alltoall: splits {counts} must be {n} counts adding up to {rows}"
        )
    return counts, None


@in_process_set
def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: str = Average
) -> Callable[[], torch.Tensor]:
    """Start the average (or sum) of a sparse ``tensor`` over the ranks, as Horovod's: every
    rank's indices and values are all-gathered (a coordinate given by several ranks is summed
    when the result is coalesced). Returns a function that waits and gives the sparse result.

    Raises:
        HorovodError: ``op`` is neither ``Average`` nor ``Sum``.
    """
    if _op(None, op) not in (Average, Sum):
        raise HorovodError(f"sparse_allreduce_async takes op=Average or op=Sum, not {op}")
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), f"{name}.indices")
    values = allgather_async(tensor._values(), f"{name}.values")

    ranks = size()

    def result() -> torch.Tensor:
        gathered = synchronize(values)
        if op == Average:
            gathered = gathered / ranks
        where = synchronize(indices).transpose(0, 1)
        return torch.sparse_coo_tensor(where, gathered, tensor.size())

    return result


@in_process_set
def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start :func:`reducescatter`; a handle for :func:`synchronize`."""
    op = _op(None, op)
    _named("reducescatter", name)
    refusal = None
    if tensor.dim() == 0:
        refusal = ValueError("reducescatter takes a tensor of 1 or more dimensions")
    elif op not in (Average, Sum):
        refusal = ValueError(f"reducescatter takes op=Average or op=Sum, not {op}")
    start = partial(_scattered, tensor, op, prescale_factor, postscale_factor)
    return _started(name, _ask("reducescatter", tensor, name, start, op=op, refusal=refusal))


def _scattered(tensor: torch.Tensor, op: str, pre: float, post: float) -> Handle:
    """Start reducing ``tensor``; a handle on this rank's rows of the result."""
    n, me, rows = size(), ring().rank, tensor.shape[0]
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    first = sum(counts[:me])
    reduced = _reduce(tensor.detach().clone(), op, pre, post)
    return Handle(lambda: reduced.wait()[first : first + counts[me]].clone(), reduced.finished)


@in_process_set
def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor], name=None, op=Average, **kw
) -> Handle:
    return _group(
        [reducescatter_async(t, _member(name, i), op, **kw) for i, t in enumerate(tensors)]
    )


def join(device: int = -1) -> int:
    """This rank has no more data (Horovod's ``hvd.join``): until every rank has joined it
    takes part in the others' all-reduces with zeros (their averages still divide by every
    rank); returns the rank that joined last. A broadcast, allgather, alltoall, min, max or
    product while a rank has joined raises on the ranks that asked for it, as in Horovod."""
    if size() == 1:
        return 0
    return coordinator().join(_with_zeros)


def _with_zeros(row: list[int]) -> None:
    """Take part in the operation the ranks still training described in ``row``."""
    kind = negotiation.KINDS[row[0]]
    if kind not in ("allreduce", "reducescatter") or negotiation.elementwise(row):
        return  # a step's first row, or an operation the others refuse while one has joined
    dtype = negotiation.DTYPES[row[1]]
    zeros = torch.zeros(row[3 : 3 + row[2]], dtype=dtype).reshape(-1)
    _reduce(zeros, Sum, 1.0, 1.0).wait()


def barrier(process_set: Any = None) -> None:
    """Wait until every rank (of ``process_set``) got here (Horovod's ``hvd.barrier``)."""
    with within(process_set):
        zero = torch.zeros(1)
        start = partial(_reduce, zero, Sum, 1.0, 1.0)
        synchronize(_ask("allreduce", zero, None, start, op=Sum, counter="barrier"))


@in_process_set
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Rank ``root_rank``'s ``obj`` on every rank (pickled between the run's own ranks)."""
    root = _root(root_rank)
    payload = _pickled(obj) if ring().rank == root else torch.empty(0, dtype=torch.uint8)
    length = broadcast_(torch.tensor([payload.numel()], dtype=torch.int64), root_rank)
    if ring().rank != root:
        payload = torch.empty(int(length), dtype=torch.uint8)
    broadcast_(payload, root_rank)
    return _unpickled(payload)


@in_process_set
def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    payload = _pickled(obj)
    lengths = synchronize(allgather_async(torch.tensor([payload.numel()], dtype=torch.int64)))
    padded = torch.zeros(int(lengths.max()), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    parts = ring().all_gather(padded)
    return [_unpickled(p[: int(n)]) for p, n in zip(parts, lengths, strict=True)]


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int
) -> None:
    """Every rank's parameters (a ``state_dict()`` or ``named_parameters()``) become rank
    ``root_rank``'s, in place."""
    items = sorted(params.items() if isinstance(params, Mapping) else params)
    for _, tensor in items:
        with torch.no_grad():
            broadcast_(tensor, root_rank)


def _pickled(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpickled(payload: torch.Tensor) -> Any:
    # From this run's own ranks, as Horovod's broadcast_object: never from storage.
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
