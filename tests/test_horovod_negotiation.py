"""What every rank concludes from a cycle (``ringflow.horovod.negotiation.decide``), from the
blocks the ranks tell, without a ring: operations matched by name in rank 0's order, the
ranks that disagree, ``hvd.join``'s zeros and refusals, and ranks that wait for each other."""

from __future__ import annotations

import torch

from ringflow.horovod.negotiation import SHOWN, Told, blocks, decide, describe, heard


def _row(name: str, kind: str = "allreduce", shape=(3,), op: str = "sum") -> list[int]:
    return describe(kind, torch.zeros(shape), name, -1, op)


def _key(name: str) -> int:
    return _row(name)[-1]


def _told(*names: str, waits: bool = False, joined: bool = False) -> Told:
    return Told(waits, joined, False, [_row(n) for n in names])


def test_operations_every_rank_asked_for_run_in_rank_0s_order_whatever_the_others_order():
    outcome = decide([_told("a", "b", "c"), _told("c", "a")])
    assert [key for key, _, _ in outcome.ready] == [_key("a"), _key("c")]
    assert all(failure is None for _, _, failure in outcome.ready)
    assert outcome.stuck is None
    same = decide([_told("a", "b"), _told("a", "b")])
    assert [key for key, _, failure in same.ready if failure is None] == [_key("a"), _key("b")]


def test_an_operation_one_rank_asked_for_waits_until_every_rank_waits():
    assert decide([_told("a", waits=True), _told("barrier")]).stuck is None
    stuck = decide([_told("a", waits=True), _told("b", waits=True)]).stuck
    assert str(stuck.error("allreduce", "a")) == (
        "allreduce 'a': the ranks disagree on the name: rank 0 and rank 1 gave it different names"
    )


def test_ranks_that_gave_one_name_to_different_tensors_fail_it_on_every_rank():
    (_, _, failure), *_ = decide(
        [Told(False, False, False, [_row("x", shape=(4,))]), Told(True, False, False, [_row("x")])]
    ).ready
    assert str(failure.error("allreduce", None)) == (
        "allreduce: the ranks disagree on the shape: rank 0 has (4,), rank 1 has (3,)"
    )
    ragged = [Told(False, False, False, [_row("g", "allgather", (r + 1, 2))]) for r in range(2)]
    assert decide(ragged).ready[0][2] is None  # an allgather's first dimension may differ


def test_a_joined_rank_takes_part_in_sums_and_refuses_gathers_until_every_rank_joined():
    joined = Told(True, True, False, [])
    (key, row, failure), *_ = decide([joined, _told("s")]).ready
    assert (key, row, failure) == (_key("s"), _row("s"), None)
    gathered = Told(False, False, False, [_row("g", "allgather")])
    failure = decide([joined, gathered]).ready[0][2]
    assert str(failure.error("allgather", "g")) == (
        "allgather cannot run once a rank has joined (nor in Horovod)"
    )
    last = decide([joined, Told(True, True, True, []), Told(True, True, True, [])])
    assert last.last_joined == 2


def test_a_queue_longer_than_the_first_block_travels_whole_in_the_second():
    names = [f"op{i}" for i in range(SHOWN + 3)]
    every = [_told(*names), _told("x")]
    firsts = [blocks(t)[0] for t in every]
    assert len({len(f) for f in firsts}) == 1
    seconds = [blocks(t)[1] for t in every]
    most = max(len(s) for s in seconds)
    seconds = [s + [0] * (most - len(s)) for s in seconds]
    assert heard(firsts, seconds) == every
