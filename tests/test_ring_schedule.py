"""The ring schedules, run by an in-process simulator of the ring: no processes, many cases.

The simulator gives every directed edge a FIFO of bounded capacity (the shared-memory
transport's slots), steps the ranks round-robin and fails on a deadlock, a tag mismatch or a
wrong result, so the algorithm is checked apart from any transport.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringflow.engine.collective._schedule import (
    Schedule,
    all_gather_schedule,
    allreduce_schedule,
    broadcast_schedule,
)
from ringflow.engine.collective._transport import land


def _simulate(schedules: list[Schedule], *, capacity: int, finish=None) -> None:
    """Run every rank's schedule; sends block while the right neighbour's FIFO is full."""
    n = len(schedules)
    inbox = [deque() for _ in range(n)]
    position, sent = [0] * n, [False] * n
    while any(position[r] < len(s.hops) for r, s in enumerate(schedules)):
        progressed = False
        for r, schedule in enumerate(schedules):
            while position[r] < len(schedule.hops):
                hop = schedule.hops[position[r]]
                if hop.send is not None and not sent[r]:
                    if len(inbox[(r + 1) % n]) >= capacity:
                        break
                    inbox[(r + 1) % n].append((hop.tag, hop.send.clone()))
                    sent[r] = progressed = True
                if hop.recv is not None:
                    if not inbox[r]:
                        break
                    tag, segment = inbox[r].popleft()
                    assert tag == hop.tag, f"rank {r} expected tag {hop.tag}, got {tag}"
                    assert segment.shape == hop.recv.shape
                    land(hop, segment, finish)
                position[r] += 1
                sent[r], progressed = False, True
        assert progressed, f"deadlock at positions {position}"
    assert not any(inbox), "segments were sent that nobody received"


def _inputs(n: int, length: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n * 1000 + length)
    return [torch.randint(-50, 50, (length,), generator=g).double() for _ in range(n)]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 6),
    length=st.integers(0, 300),
    segment=st.integers(1, 40),
    wavefront=st.booleans(),
    capacity=st.integers(2, 4),
)
def test_allreduce_schedule_sums_on_every_rank(n, length, segment, wavefront, capacity):
    tensors = _inputs(n, length)
    want = torch.stack(tensors).sum(0) if length else torch.zeros(0, dtype=torch.double)
    schedules = [
        allreduce_schedule(t, rank=r, world_size=n, segment_elems=segment, wavefront=wavefront)
        for r, t in enumerate(tensors)
    ]
    _simulate(schedules, capacity=capacity)
    for t in tensors:
        assert torch.equal(t, want)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 5), length=st.integers(1, 100), segment=st.integers(1, 16))
def test_finisher_runs_once_per_element_on_its_owner(n, length, segment):
    tensors = _inputs(n, length)
    want = torch.stack(tensors).sum(0) / n
    schedules = [
        allreduce_schedule(t, rank=r, world_size=n, segment_elems=segment, wavefront=True)
        for r, t in enumerate(tensors)
    ]
    _simulate(schedules, capacity=2, finish=lambda segment: segment.div_(n))
    for t in tensors:
        assert torch.allclose(t, want)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), length=st.integers(0, 50), segment=st.integers(1, 16))
def test_all_gather_schedule_fills_every_part(n, length, segment):
    outs = [torch.full((n, length), -1.0) for _ in range(n)]
    for r, out in enumerate(outs):
        out[r] = r
    schedules = [
        all_gather_schedule(out.view(-1), rank=r, world_size=n, segment_elems=segment)
        for r, out in enumerate(outs)
    ]
    _simulate(schedules, capacity=2)
    want = torch.arange(n, dtype=torch.float).unsqueeze(1).expand(n, length)
    for out in outs:
        assert torch.equal(out, want)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), length=st.integers(0, 80), segment=st.integers(1, 16), data=st.data())
def test_broadcast_schedule_copies_the_source(n, length, segment, data):
    src = data.draw(st.integers(0, n - 1))
    tensors = _inputs(n, length)
    want = tensors[src].clone()
    schedules = [
        broadcast_schedule(t, rank=r, world_size=n, src=src, segment_elems=segment)
        for r, t in enumerate(tensors)
    ]
    _simulate(schedules, capacity=1)
    for t in tensors:
        assert torch.equal(t, want)


@pytest.mark.parametrize("wavefront", [False, True])
def test_segments_never_exceed_the_segment_size(wavefront):
    flat = torch.zeros(1001)
    schedule = allreduce_schedule(flat, rank=1, world_size=3, segment_elems=50, wavefront=wavefront)
    sizes = [h.send.numel() for h in schedule.hops if h.send is not None]
    assert max(sizes) <= 50
    assert len(schedule.hops) == 2 * 2 * 7  # 2(n-1) steps of ceil(334 / 50) segments
