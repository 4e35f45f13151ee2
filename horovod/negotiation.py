"""What the ranks tell each other before an operation, as Horovod's coordinator hears it:
which operation, on what dtype and shape, from which root, under which name; or that the
rank has joined (``hvd.join``: it has no more data, and takes part with zeros).

One small all-gather of a fixed-size row of integers per operation. A gradient reduction of
``DistributedOptimizer`` skips it: its shapes are agreed once, and each step starts with a
row of its own (:func:`step`), which tells the ranks whether one has joined, and only then
does every gradient of that step tell its shape.
"""

from __future__ import annotations

import zlib

import torch

from ringflow.horovod.basics import OPS, HorovodError, Max, Min, Product, ring, size
from ringflow.horovod.timeline import NEGOTIATE, naming

__all__ = ["JOINED", "agree", "step"]

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
JOINED = KINDS.index("join")
MOST_DIMS = 8
_FIELDS = ("operation", "dtype", "number of dimensions", *["shape"] * MOST_DIMS)
_FIELDS += ("root rank", "op", "refusal", "name")
_OPS = ("", *OPS)
_ELEMENTWISE = (Min, Max, Product)
_WIDTH = len(_FIELDS)


def exchange(row: list[int]) -> list[list[int]]:
    """Every rank's ``row``, in rank order (named in the timeline after the operation:
    ``NEGOTIATE_ALLREDUCE``, ...)."""
    with naming(f"{NEGOTIATE}{KINDS[row[0]].upper()}"):
        every = ring().all_gather(torch.tensor(row, dtype=torch.int64))
    return torch.stack(every).tolist()


def describe(kind: str, tensor: torch.Tensor | None, name: str | None, root: int, op: str):
    """This rank's row for an operation."""
    if tensor is None:
        return [KINDS.index(kind)] + [-1] * (_WIDTH - 1)
    if tensor.dtype not in DTYPES:
        raise HorovodError(f"{kind}: tensors of {tensor.dtype} are not supported")
    if tensor.dim() > MOST_DIMS:
        raise HorovodError(f"{kind}: tensors of more than {MOST_DIMS} dimensions")
    shape = list(tensor.shape) + [-1] * (MOST_DIMS - tensor.dim())
    named = zlib.crc32(name.encode()) if name else -1
    row = [KINDS.index(kind), DTYPES.index(tensor.dtype), tensor.dim(), *shape, root]
    return row + [_OPS.index(op), 0, named]


def agree(
    kind: str,
    tensor: torch.Tensor,
    name: str | None,
    *,
    root: int = -1,
    op: str = "",
    first_dim_may_differ: bool = False,
    refusal: Exception | None = None,
) -> list[int]:
    """Every rank that has not joined asked for the same operation on a tensor of the same
    dtype and shape (all dimensions but the first, where ``first_dim_may_differ``), from the
    same root, under the same name where every rank gave one, and none refused it (its
    arguments were wrong: ``refusal``). The same error on every rank otherwise, so that the
    ranks stay in step. Returns the ranks that have joined (they take part with zeros).

    Raises:
        HorovodError: the ranks disagree, the operation cannot run with joined ranks, or
            another rank refused it.
        Exception: ``refusal``, on the rank that refused.
    """
    try:
        row = describe(kind, tensor, name, root, op)
    except HorovodError as err:
        refusal, row = refusal or err, describe(kind, None, name, root, op)
    row[_FIELDS.index("refusal")] = int(refusal is not None)
    every = exchange(row) if size() > 1 else [row]
    _refused(kind, every, refusal)
    joined = [r for r, theirs in enumerate(every) if theirs[0] == JOINED]
    if joined and (kind in ("allgather", "alltoall", "broadcast") or op in _ELEMENTWISE):
        what = f"{kind} {op}" if op in _ELEMENTWISE else kind
        raise HorovodError(f"{what} cannot run once a rank has joined (nor in Horovod)")
    active = [(r, theirs) for r, theirs in enumerate(every) if theirs[0] != JOINED]
    if first_dim_may_differ:
        for _, theirs in active:
            theirs[3] = 0
    (first, mine), others = active[0], active[1:]
    differ = [(r, t) for r, t in others if t[:-1] != mine[:-1]]
    if mine[-1] >= 0 and all(t[-1] >= 0 for _, t in others):
        differ += [(r, t) for r, t in others if t[-1] != mine[-1]]
    if differ:
        _disagree(kind, name, (first, mine), differ[0])
    return joined


def elementwise(row: list[int]) -> bool:
    """Whether ``row`` asks for a min, max or product (which joined ranks cannot join)."""
    index = row[_FIELDS.index("op")]
    return index > 0 and _OPS[index] in _ELEMENTWISE


def refused(row: list[int]) -> bool:
    """Whether the rank of ``row`` refused its operation's arguments (it does not run)."""
    return row[_FIELDS.index("refusal")] == 1


def _refused(kind: str, every: list[list[int]], refusal: Exception | None) -> None:
    if refusal is not None:
        raise refusal
    refusing = [r for r, theirs in enumerate(every) if refused(theirs)]
    if refusing:
        raise HorovodError(f"{kind}: rank {refusing[0]} refused its arguments (its error says why)")


def _disagree(kind: str, name: str | None, first: tuple, other: tuple) -> None:
    (a, row_a), (b, row_b) = first, other
    field = next(i for i, (x, y) in enumerate(zip(row_a, row_b, strict=True)) if x != y)
    if _FIELDS[field] == "name":
        told = f"rank {a} and rank {b} gave it different names"
    else:
        told = f"rank {a} has {_described(row_a, field)}, rank {b} has {_described(row_b, field)}"
    kind += f" {name!r}" if name else ""
    raise HorovodError(f"{kind}: the ranks disagree on the {_FIELDS[field]}: {told}")


def _described(row: list[int], field: int) -> str:
    if field == 0:
        return KINDS[row[0]]
    if field == 1:
        return str(DTYPES[row[1]])
    if _FIELDS[field] == "shape":
        return str(tuple(row[3 : 3 + row[2]]))
    if _FIELDS[field] == "op":
        return _OPS[row[field]] or "none"
    return str(row[field])


def step() -> bool:
    """The row a ``DistributedOptimizer`` step starts with; whether a rank has joined (the
    step's gradients then tell their shapes, for the joined ranks' zeros)."""
    if size() == 1:
        return False
    return any(theirs[0] == JOINED for theirs in exchange(describe("step", None, None, -1, "")))
