"""Ring schedules: the segments one rank sends right and receives from the left, hop by hop.

A schedule is plain data over views of the caller's tensor, so every transport runs the same
algorithm and the algorithm can be checked without any process (``tests/test_ring_schedule``).
Tensors are cut into ``world_size`` chunks (lengths differ by at most one element) and each
chunk into the same number of segments, so a rank's send at hop ``i`` is exactly what its
right neighbour receives at hop ``i``, and several segments are in flight at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Hop",
    "Schedule",
    "all_gather_schedule",
    "allreduce_schedule",
    "broadcast_schedule",
    "reduce_scatter_schedule",
]


@dataclass(frozen=True, slots=True)
class Hop:
    """One step of one rank: send a segment to the right, receive one from the left."""

    tag: int
    """Matches this send with the receive of the same tag on the right neighbour."""
    send: torch.Tensor | None
    recv: torch.Tensor | None
    reduce: bool = False
    """Add the received segment into ``recv`` (reduce-scatter) rather than overwrite it."""
    final: bool = False
    """After this hop ``recv`` holds this rank's finished segment of the reduction."""
    owned: bool = False
    """``send`` is this rank's finished segment, on its way to the others. When it travels in
    a narrower dtype, this rank keeps the narrowed values too, so every rank ends identical."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """The hops of one collective on one rank, in the order they must be issued."""

    hops: list[Hop]
    lag: int
    """Hop ``i`` sends what hop ``i - lag`` received (at the latest): a transport may issue
    ``lag - 1`` hops ahead of the reduction it waits for."""


def allreduce_schedule(
    flat: torch.Tensor, *, rank: int, world_size: int, segment_elems: int, wavefront: bool = False
) -> Schedule:
    """Reduce-scatter then all-gather around the ring, in place over ``flat``.

    After the ``world_size - 1`` reduce-scatter hops rank ``r`` holds the full sum of chunk
    ``r + 1``; the all-gather hops pass the finished chunks on.
    """
    n = world_size
    segments = _segmented(torch.tensor_split(flat, n), segment_elems)
    grid = _reduce_scatter_grid(segments, rank=rank, world_size=n)
    for step in range(n - 1):
        send, recv = segments[(rank + 1 - step) % n], segments[(rank - step) % n]
        grid.append(_hops(send, recv, first_tag=len(grid) * len(send), owned=step == 0))
    return _ordered(grid, wavefront=wavefront)


def reduce_scatter_schedule(
    flat: torch.Tensor, *, rank: int, world_size: int, segment_elems: int, wavefront: bool = False
) -> Schedule:
    """The reduce-scatter half of :func:`allreduce_schedule`, in place over ``flat``, with
    the chunks taken one place further round the ring: rank ``r`` ends holding the full sum
    of chunk ``r`` (its ``r``-th of ``world_size``), as ``torch.distributed``'s
    reduce-scatter gives it. The rest of ``flat`` holds partial sums."""
    n = world_size
    segments = _segmented(torch.tensor_split(flat, n), segment_elems)
    # Rotated by one: the allreduce's rank r finishes chunk r + 1; here that is chunk r.
    grid = _reduce_scatter_grid([*segments[-1:], *segments[:-1]], rank=rank, world_size=n)
    return _ordered(grid, wavefront=wavefront)


def _reduce_scatter_grid(
    segments: list[list[torch.Tensor]], *, rank: int, world_size: int
) -> list[list[Hop]]:
    """The ``world_size - 1`` reduce-scatter steps over ``segments`` (each chunk's): after
    them rank ``r`` holds the full sum of the chunk at ``r + 1``."""
    n = world_size
    grid: list[list[Hop]] = []
    for step in range(n - 1):
        send, recv = segments[(rank - step) % n], segments[(rank - step - 1) % n]
        grid.append(
            _hops(send, recv, first_tag=len(grid) * len(send), reduce=True, final=step == n - 2)
        )
    return grid


def all_gather_schedule(
    out: torch.Tensor, *, rank: int, world_size: int, segment_elems: int, wavefront: bool = False
) -> Schedule:
    """Pass every rank's part of ``out`` (its ``rank``-th of ``world_size`` equal chunks) on."""
    n = world_size
    segments = _segmented(torch.tensor_split(out, n), segment_elems)
    grid: list[list[Hop]] = []
    for step in range(n - 1):
        send, recv = segments[(rank - step) % n], segments[(rank - step - 1) % n]
        grid.append(_hops(send, recv, first_tag=len(grid) * len(send)))
    return _ordered(grid, wavefront=wavefront)


def broadcast_schedule(
    flat: torch.Tensor, *, rank: int, world_size: int, src: int, segment_elems: int
) -> Schedule:
    """A pipelined chain from ``src`` around the ring: each rank forwards what it received."""
    if world_size == 1:
        return Schedule(hops=[], lag=1)
    (segments,) = _segmented([flat], segment_elems)
    position = (rank - src) % world_size
    if position == 0:
        return Schedule(hops=_hops(segments, [None] * len(segments), first_tag=0), lag=1)
    if position == world_size - 1:
        return Schedule(hops=_hops([None] * len(segments), segments, first_tag=0), lag=1)
    # Forward each segment as soon as it arrived; the gaps between receives keep it pipelined.
    hops = []
    for k, segment in enumerate(segments):
        hops.append(Hop(tag=k, send=None, recv=_some(segment)))
        hops.append(Hop(tag=k, send=_some(segment), recv=None))
    return Schedule(hops=hops, lag=1)


def _ordered(grid: list[list[Hop]], *, wavefront: bool) -> Schedule:
    """Issue the hops step by step, or as a wavefront.

    Step by step, hop ``i`` sends what hop ``i - segments`` received. In a wavefront, segment
    ``k``'s step ``s`` comes right after the segments of the diagonal before it, so a segment
    is passed on a few hops after it arrived, while it is still in the CPU's cache; every
    rank issues the same order, so sends and receives still pair up.
    """
    if not grid:
        return Schedule(hops=[], lag=1)
    if not wavefront:
        return Schedule(hops=[hop for row in grid for hop in row], lag=len(grid[0]))
    steps, count = len(grid), len(grid[0])
    hops = [
        grid[step][diagonal - step]
        for diagonal in range(steps + count - 1)
        for step in range(max(0, diagonal - count + 1), min(steps, diagonal + 1))
    ]
    return Schedule(hops=hops, lag=1)


def _segmented(chunks: list[torch.Tensor], segment_elems: int) -> list[list[torch.Tensor]]:
    """Cut every chunk into the same number of segments of at most ``segment_elems``."""
    longest = max(len(chunk) for chunk in chunks)
    count = max(1, -(-longest // max(1, segment_elems)))
    return [list(torch.tensor_split(chunk, count)) for chunk in chunks]


def _hops(
    send: list[torch.Tensor | None],
    recv: list[torch.Tensor | None],
    *,
    first_tag: int,
    reduce: bool = False,
    final: bool = False,
    owned: bool = False,
) -> list[Hop]:
    return [
        Hop(
            tag=first_tag + k,
            send=_some(s),
            recv=_some(r),
            reduce=reduce,
            final=final,
            owned=owned,
        )
        for k, (s, r) in enumerate(zip(send, recv, strict=True))
    ]


def _some(segment: torch.Tensor | None) -> torch.Tensor | None:
    """Empty segments (tensors shorter than the ring) are not sent at all."""
    return segment if segment is not None and segment.numel() else None
