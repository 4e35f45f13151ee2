"""What the ranks tell each other about the operations they asked for, as Horovod's coordinator
hears it, and what every rank concludes from it (the same on every rank, with no ring here:
``ringflow.horovod.coordinator`` keeps each rank's queue and runs the cycles).

An operation is matched across ranks by its name, as in Horovod: an unnamed one is named after
its kind and how many of that kind its rank asked for before, so ranks that ask in the same
order match without names. In each cycle every rank tells, in a block of integers, whether it
waits (for an operation, or in ``hvd.join``: it has no more data and takes part with zeros)
and a row for each operation in its queue: which operation, on what dtype and shape, from
which root, with which op, whether the rank refused its arguments, and its name's hash.
:func:`decide` gives the operations every rank has asked for, in rank 0's order, each with
why it cannot run where the ranks disagree; and, where every rank waits and none of them can
go on, how their oldest operations differ.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ringflow.horovod.basics import OPS, HorovodError, Max, Min, Product

__all__ = [
    "KINDS",
    "SHOWN",
    "Failure",
    "Outcome",
    "Told",
    "blocks",
    "decide",
    "describe",
    "elementwise",
    "heard",
    "longest",
    "refusing",
]

DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "step", "join")
MOST_DIMS = 8
_FIELDS = ("operation", "dtype", "number of dimensions", *["shape"] * MOST_DIMS)
_FIELDS += ("root rank", "op", "refusal", "name")
_OPS = ("", *OPS)
_ELEMENTWISE = (Min, Max, Product)
_RAGGED = ("allgather", "alltoall")  # every dimension but the first must agree
_REFUSED_WHILE_JOINED = ("allgather", "alltoall", "broadcast")
_WIDTH = len(_FIELDS)
_OP, _REFUSAL = _FIELDS.index("op"), _FIELDS.index("refusal")
_HEADER = 4  # waits, has joined, joined in this cycle, how many rows
SHOWN = 1
"""Rows each rank shows in a cycle's first all-gather: where the ranks start operations in the
same order, each cycle's queue holds the one just started. A rank with more shows them all in
a second all-gather (every rank sees every rank's count, so they all take part in it)."""


def describe(kind: str, tensor: torch.Tensor | None, name: str, root: int, op: str) -> list[int]:
    """This rank's row for an operation named ``name`` (its own, or its automatic one).

    Raises:
        HorovodError: ``tensor``'s dtype or number of dimensions cannot travel.
    """
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 1
    if tensor is None:
        return [KINDS.index(kind)] + [-1] * (_WIDTH - 3) + [0, key]
    if tensor.dtype not in DTYPES:
        raise HorovodError(f"{kind}: tensors of {tensor.dtype} are not supported")
    if tensor.dim() > MOST_DIMS:
        raise HorovodError(f"{kind}: tensors of more than {MOST_DIMS} dimensions")
    shape = list(tensor.shape) + [-1] * (MOST_DIMS - tensor.dim())
    row = [KINDS.index(kind), DTYPES.index(tensor.dtype), tensor.dim(), *shape, root]
    return row + [_OPS.index(op), 0, key]


def refusing(row: list[int]) -> list[int]:
    """``row`` of a rank that refused the operation's arguments (it runs nowhere)."""
    return [*row[:-2], 1, row[-1]]


def elementwise(row: list[int]) -> bool:
    """Whether ``row`` asks for a min, max or product (which joined ranks cannot join)."""
    index = row[_OP]
    return index > 0 and _OPS[index] in _ELEMENTWISE


class Told(NamedTuple):  # a tuple: one per rank every cycle, quick to make
    """What one rank told in a cycle."""

    waits: bool
    """It waits for an operation to run, or in ``hvd.join``."""
    joined: bool
    """It is in ``hvd.join``: it takes part with zeros in what the others run."""
    joined_now: bool
    """It came into ``hvd.join`` in this cycle."""
    rows: list[list[int]]
    """Its queue, oldest first."""


def blocks(mine: Told) -> tuple[list[int], list[int]]:
    """What this rank tells (``mine``) as the two blocks of integers a cycle all-gathers: the
    first of a fixed size (its first :data:`SHOWN` rows), and every row (the second
    all-gather's, of the size the longest queue needs)."""
    header = [int(mine.waits), int(mine.joined), int(mine.joined_now), len(mine.rows)]
    shown = [v for row in mine.rows[:SHOWN] for v in row]
    first = header + shown + [0] * (SHOWN * _WIDTH - len(shown))
    return first, [v for row in mine.rows for v in row]


def heard(firsts: list[list[int]], seconds: list[list[int]] | None = None) -> list[Told]:
    """What every rank told, from the first blocks of the ranks (and the second ones, where
    a rank has more rows than the first shows)."""
    every = []
    for rank, first in enumerate(firsts):
        count = first[3]
        flat = seconds[rank] if count > SHOWN else first[_HEADER:]
        rows = [list(flat[i * _WIDTH : (i + 1) * _WIDTH]) for i in range(count)]
        every.append(Told(bool(first[0]), bool(first[1]), bool(first[2]), rows))
    return every


def longest(firsts: list[list[int]]) -> int:
    """How many integers each rank's second block holds: 0 where every queue was shown."""
    most = max(first[3] for first in firsts)
    return most * _WIDTH if most > SHOWN else 0


@dataclass(frozen=True)
class Failure:
    """Why an operation does not run: the same on every rank (a rank that refused its
    arguments raises its own error instead)."""

    reason: str
    """``disagree``, ``refused`` or ``joined``."""
    told: str

    def error(self, kind: str, name: str | None) -> HorovodError:
        """The error this rank raises for its operation of ``kind`` named ``name`` (its own
        name; ``None`` where it gave none)."""
        if self.reason == "joined":
            return HorovodError(self.told)
        head = f"{kind} {name!r}" if name and self.reason == "disagree" else kind
        return HorovodError(f"{head}: {self.told}")


class Outcome(NamedTuple):
    """What every rank concludes from a cycle."""

    ready: list[tuple[int, list[int], Failure | None]]
    """The operations every rank not in ``hvd.join`` has asked for, in the order rank 0
    (the first such rank) asked: each one's name hash, its row on that rank (a joined rank
    takes part by it) and why it cannot run (``None``: it runs now)."""
    joined: list[int]
    """The ranks in ``hvd.join``."""
    last_joined: int | None
    """Where every rank is in ``hvd.join``: the one that came last (``join`` returns it)."""
    stuck: Failure | None
    """Where every rank waits and none of the operations it waits for can run: how the
    ranks' oldest operations differ (every waiting operation fails with it)."""


def decide(every: list[Told]) -> Outcome:
    """What every rank concludes from what each told (``every``, in rank order)."""
    if _alike(every):  # the same operations asked for in the same order: all of them run
        return Outcome([(row[-1], row, None) for row in every[0].rows], [], None, None)
    joined = [r for r, t in enumerate(every) if t.joined]
    active = [r for r, t in enumerate(every) if not t.joined]
    if not active:
        came_last = [r for r in joined if every[r].joined_now] or joined
        return Outcome([], joined, max(came_last), None)
    by_name = [{row[-1]: row for row in t.rows} for t in every]
    ready = []
    for row in every[active[0]].rows:
        if all(row[-1] in by_name[r] for r in active):
            asked = [(r, by_name[r][row[-1]]) for r in range(len(every)) if row[-1] in by_name[r]]
            lacking = [r for r in joined if row[-1] not in by_name[r]]
            ready.append((row[-1], row, _failure(asked, bool(lacking))))
    stuck = None
    if not ready and all(t.waits for t in every):
        oldest = [(r, every[r].rows[0]) for r in active if every[r].rows]
        stuck = _disagreement(oldest) or Failure("disagree", "the ranks wait for each other")
    return Outcome(ready, joined, None, stuck)


def _alike(every: list[Told]) -> bool:
    """Whether no rank is in ``hvd.join``, every queue is the same and none refused."""
    first = every[0]
    if first.joined or any(row[_REFUSAL] for row in first.rows):
        return False
    return all(t.rows == first.rows and not t.joined for t in every[1:])


def _failure(asked: list[tuple[int, list[int]]], joined: bool) -> Failure | None:
    """Why the operation the ranks ``asked`` for (each with its row) cannot run, ``joined``
    where a rank in ``hvd.join`` would take part with zeros."""
    kind, row = KINDS[asked[0][1][0]], asked[0][1]
    refused = [r for r, theirs in asked if theirs[_REFUSAL] == 1]
    if refused:
        return Failure("refused", f"rank {refused[0]} refused its arguments (its error says why)")
    if joined and (kind in _REFUSED_WHILE_JOINED or elementwise(row)):
        what = f"{kind} {_OPS[row[_OP]]}" if elementwise(row) else kind
        return Failure("joined", f"{what} cannot run once a rank has joined (nor in Horovod)")
    return _disagreement(asked)


def _disagreement(asked: list[tuple[int, list[int]]]) -> Failure | None:
    """How the first of ``asked``'s rows that differs from the first one's differs from it
    (``None``: they are the same)."""
    if len(asked) < 2:
        return None
    a, row_a = asked[0][0], _comparable(asked[0][1])
    for b, row_b in ((r, _comparable(row)) for r, row in asked[1:]):
        if row_b == row_a:
            continue
        field = next(i for i, (x, y) in enumerate(zip(row_a, row_b, strict=True)) if x != y)
        if _FIELDS[field] == "name":
            said = f"rank {a} and rank {b} gave it different names"
        else:
            theirs = _described(row_a, field), _described(row_b, field)
            said = f"rank {a} has {theirs[0]}, rank {b} has {theirs[1]}"
        return Failure("disagree", f"the ranks disagree on the {_FIELDS[field]}: {said}")
    return None


def _comparable(row: list[int]) -> list[int]:
    """``row`` as it must agree: the first dimension left out where it may differ."""
    if KINDS[row[0]] in _RAGGED and row[2] > 0:
        return [*row[:3], 0, *row[4:]]
    return row


def _described(row: list[int], field: int) -> str:
    if field == 0:
        return KINDS[row[0]]
    if field == 1:
        return str(DTYPES[row[1]]) if row[1] >= 0 else "no tensor"
    if _FIELDS[field] == "shape":
        return str(tuple(row[3 : 3 + row[2]]))
    if _FIELDS[field] == "op":
        return _OPS[row[field]] or "none"
    return str(row[field])
