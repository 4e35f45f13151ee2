"""Horovod's tensor and object collectives on ringflow's ring.

Every rank calls them in the same order, as under Horovod (``name=`` is accepted and only
names the operation in errors: the ring matches operations by order, not by name).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ringflow.horovod import negotiation
from ringflow.horovod.basics import Average, HorovodError, Sum, ring, size
from ringflow.horovod.negotiation import agree
from ringflow.horovod.timeline import naming

__all__ = [
    "allgather",
    "barrier",
    "join",
    "alltoall",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "poll",
    "reducescatter",
    "synchronize",
]


class _Handle:
    """An all-reduce in flight (``allreduce_async``): ``synchronize`` gives its result."""

    def __init__(self, work: Any, target: torch.Tensor, scale: float) -> None:
        self.work, self.target, self.scale = work, target, scale
        self.result: torch.Tensor | None = None


_in_flight: dict[str, _Handle] = {}  # this rank's async operations by name, not yet waited for


def _op(average: bool | None, op: str | None) -> str:
    if average is not None and op is not None:
        raise HorovodError("allreduce takes average= or op=, not both")
    if op is None:
        return Sum if average is False else Average
    if op not in (Average, Sum):
        raise HorovodError(f"op {op!r} is not supported: ringflow's ring sums and averages")
    return op


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> _Handle:
    """Start replacing ``tensor`` by its average (``op=Average``, the default) or sum over
    the ranks; returns a handle for :func:`synchronize`. An integer tensor's average is
    truncated toward zero, as Horovod's.

    Raises:
        HorovodError: the ranks gave tensors of different dtypes or shapes, or ops.
        ValueError: an operation of this ``name`` is still in flight on this rank.
    """
    op = _op(average, op)
    if name is not None and name in _in_flight and _in_flight[name].result is None:
        raise ValueError(f"allreduce {name!r}: an operation of that name is still in flight")
    agree("allreduce", tensor, name, op=op)
    with naming(name):
        handle = _reduce(tensor, op, prescale_factor, postscale_factor)
    if name is not None:
        _in_flight[name] = handle
    return handle


def _reduce(tensor: torch.Tensor, op: str, pre: float, post: float) -> _Handle:
    """The all-reduce itself (``DistributedOptimizer``'s gradients come here directly: their
    shapes were agreed once, when it was built)."""
    flat = tensor.detach().reshape(-1).contiguous()
    if pre != 1.0:
        flat = _scaled(flat.clone(), pre)
    work = ring().allreduce_async_(flat, op="sum")
    return _Handle(work, tensor, post / (size() if op == Average else 1))


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` times ``factor``, in place; integers truncated toward zero."""
    if tensor.is_floating_point():
        return tensor.mul_(factor)
    return tensor.copy_((tensor.double() * factor).trunc())


def allreduce_async(tensor: torch.Tensor, average=None, name=None, op=None, **kw) -> _Handle:
    """As :func:`allreduce_async_`, into a new tensor (``tensor`` is left as it is)."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, **kw)


def poll(handle: _Handle) -> bool:
    """Whether the operation behind ``handle`` finished."""
    return handle.result is not None or handle.work.is_completed()


def synchronize(handle: _Handle) -> torch.Tensor:
    """Wait for the operation behind ``handle``; its result (the reduced tensor)."""
    if handle.result is None:
        reduced = handle.work.wait()
        if handle.scale != 1.0:
            reduced = _scaled(reduced, handle.scale)
        target = handle.target
        if reduced.data_ptr() != target.data_ptr():
            target.detach().copy_(reduced.view_as(target))
        handle.result = target
    return handle.result


def allreduce_(tensor: torch.Tensor, average=None, name=None, op=None, **kw) -> torch.Tensor:
    """Replace ``tensor`` by its average (or sum) over the ranks; return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, **kw))


def allreduce(tensor: torch.Tensor, average=None, name=None, op=None, **kw) -> torch.Tensor:
    """The average (or sum) of ``tensor`` over the ranks, as a new tensor."""
    return synchronize(allreduce_async(tensor, average, name, op, **kw))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Replace ``tensor`` by rank ``root_rank``'s; return it."""
    if not 0 <= root_rank < size():
        raise HorovodError(f"broadcast: root_rank {root_rank} is not one of the {size()} ranks")
    agree("broadcast", tensor, name, root=root_rank)
    flat = tensor.detach().reshape(-1).contiguous()
    ring().broadcast_(flat, src=root_rank)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(flat.view_as(tensor))
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Rank ``root_rank``'s ``tensor``, as a new tensor on every rank."""
    return broadcast_(tensor.detach().clone(), root_rank, name)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order; the
    first dimension may differ between ranks, the others may not."""
    agree("allgather", tensor, name, first_dim_may_differ=True)
    local = tensor.detach().contiguous()
    rows = torch.tensor([local.shape[0] if local.dim() else 1], dtype=torch.int64)
    counts = [int(n) for n in ring().all_gather(rows)]
    shape = local.shape[1:] if local.dim() else ()
    padded = local.new_zeros((max(counts), *shape))
    padded[: counts[ring().rank]] = local.reshape(-1, *shape)
    parts = ring().all_gather(padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])


def alltoall(
    tensor: torch.Tensor, splits: torch.Tensor | list[int] | None = None, name: str | None = None
) -> torch.Tensor:
    """Rank ``r`` gets part ``r`` of every rank's ``tensor``, concatenated in rank order: the
    first dimension cut into ``splits`` rows per rank (equal parts by default). It travels as
    an all-gather over the ring (each rank receives every rank's whole tensor)."""
    agree("alltoall", tensor, name, first_dim_may_differ=True)
    n, me = size(), ring().rank
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise HorovodError(f"alltoall: {rows} rows do not split into {n} equal parts")
        splits = [rows // n] * n
    splits = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    if len(splits) != n or sum(splits) != rows or min(splits) < 0:
        raise HorovodError(f"alltoall: splits {splits} must be {n} counts adding up to {rows}")
    every_split = allgather(torch.tensor([splits], dtype=torch.int64))
    gathered = allgather(tensor)
    parts, start = [], 0
    for counts in every_split.tolist():
        offset = start + sum(counts[:me])
        parts.append(gathered[offset : offset + counts[me]])
        start += sum(counts)
    return torch.cat(parts)


def reducescatter(
    tensor: torch.Tensor, name: str | None = None, op: str | None = None
) -> torch.Tensor:
    """Rank ``r``'s part of the average (``op=Average``, the default) or sum of ``tensor``
    over the ranks: the first dimension cut into ``size()`` parts, the first ones a row
    longer where it does not divide, as Horovod's."""
    op = _op(None, op)
    agree("reducescatter", tensor, name, op=op)
    n, me = size(), ring().rank
    rows = tensor.shape[0]
    reduced = synchronize(_reduce(tensor.detach().clone(), op, 1.0, 1.0))
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    start = sum(counts[:me])
    return reduced[start : start + counts[me]].clone()


def join(device: int = -1) -> int:
    """This rank has no more data (Horovod's ``hvd.join``): until every rank has joined it
    takes part in the others' all-reduces with zeros (their averages still divide by every
    rank) and broadcasts; returns the rank that joined last. An allgather or alltoall while
    a rank has joined raises on the ranks that asked for it, as in Horovod."""
    if size() == 1:
        return 0
    first = 1
    while True:
        row = negotiation.describe("join", None, None, -1, "")
        row[1], first = first, 0  # the round this rank joined in
        every = negotiation.exchange(row)
        active = [theirs for theirs in every if theirs[0] != negotiation.JOINED]
        if not active:
            return max(r for r, theirs in enumerate(every) if theirs[1] == 1)
        _with_zeros(active[0])


def _with_zeros(row: list[int]) -> None:
    """Take part in the operation the ranks still training described in ``row``."""
    kind = negotiation.KINDS[row[0]]
    if kind not in ("allreduce", "reducescatter", "broadcast"):
        return  # a step's first row, or an operation the others refuse while one has joined
    dtype = negotiation.DTYPES[row[1]]
    zeros = torch.zeros(row[3 : 3 + row[2]], dtype=dtype).reshape(-1)
    if kind == "broadcast":
        ring().broadcast_(zeros, src=row[3 + negotiation.MOST_DIMS])
    else:
        _reduce(zeros, Sum, 1.0, 1.0).work.wait()


def barrier(process_set: Any = None) -> None:
    """Wait until every rank got here (Horovod's ``hvd.barrier``; process sets refused)."""
    if process_set is not None:
        raise HorovodError("barrier takes no process_set: process sets are not supported")
    allreduce(torch.zeros(1), op=Sum)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Rank ``root_rank``'s ``obj`` on every rank (pickled between the run's own ranks)."""
    payload = _pickled(obj) if ring().rank == root_rank else torch.empty(0, dtype=torch.uint8)
    length = broadcast_(torch.tensor([payload.numel()], dtype=torch.int64), root_rank)
    if ring().rank != root_rank:
        payload = torch.empty(int(length), dtype=torch.uint8)
    broadcast_(payload, root_rank)
    return _unpickled(payload)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    payload = _pickled(obj)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64))
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


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Every rank's optimizer state (moments, steps, learning rates) becomes rank
    ``root_rank``'s."""
    state = broadcast_object(optimizer.state_dict(), root_rank)
    optimizer.load_state_dict(state)


def _pickled(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpickled(payload: torch.Tensor) -> Any:
    # From this run's own ranks, as Horovod's broadcast_object: never from storage.
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
