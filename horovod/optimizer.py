"""Horovod's ``DistributedOptimizer``: gradients averaged over the ranks while backward runs."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ringflow.engine.collective import CollectiveWork, GradientBuckets
from ringflow.horovod.basics import Average, HorovodError, Sum, ring, size
from ringflow.horovod.collectives import (
    _reduce,
    _reduce_asked,
    allgather_object,
    broadcast_object,
    synchronize,
)
from ringflow.horovod.coordinator import coordinator
from ringflow.horovod.process_sets import ProcessSet, within
from ringflow.horovod.timeline import naming

__all__ = ["Compression", "DistributedOptimizer", "broadcast_optimizer_state"]

FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"
"""Horovod's variable for the bytes gradients are fused into per all-reduce (0: no fusion)."""
DEFAULT_FUSION_BYTES = 25 << 20
"""DDP's bucket size: each fills during backward and starts at once, so a small one overlaps
more of backward than Horovod's 128 MiB (fused by whatever is ready each 1 ms cycle)."""


class _NoneCompressor:
    """Gradients travel as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _FP16Compressor:
    """Floating-point gradients travel (and are summed) as float16, as Horovod's do."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Horovod's gradient compressions: ``none`` and ``fp16``."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


class _Distributed:
    """The methods a ``DistributedOptimizer`` adds to the optimizer's own class."""

    def _distribute(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        compression: Any,
        backward_passes_per_step: int,
        op: str,
        gradient_predivide_factor: float,
    ) -> None:
        if op not in (Average, Sum):
            raise HorovodError(f"op {op!r} is not supported: ringflow's ring sums and averages")
        if backward_passes_per_step < 1:
            raise HorovodError(
                f"backward_passes_per_step must be 1 or more, got {backward_passes_per_step}"
            )
        if gradient_predivide_factor != 1.0 and op != Average:
            raise HorovodError("gradient_predivide_factor is only for op=Average, as in Horovod")
        params = [p for group in self.param_groups for p in group["params"]]
        by_id = None
        if named_parameters is not None:
            named = list(named_parameters)
            names = [n for n, _ in named]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:  # Horovod's error type: a wrong argument
                raise ValueError(f"named_parameters has a name twice: {', '.join(twice)}")
            by_id = {id(p): n for n, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in by_id]
            if missing:
                raise ValueError(
                    f"named_parameters lacks {len(missing)} of the optimizer's parameters: "
                    "pass model.named_parameters() of the model the optimizer steps"
                )
        self._names, self._agreed, self._joined = by_id, None, None
        self._parameter_names = _parameter_names(self.param_groups, by_id)
        self._synchronized = False
        self._compression, self._op = compression, op
        self._passes, self._predivide = backward_passes_per_step, gradient_predivide_factor
        self._counts = {p: 0 for p in params if p.requires_grad}
        self._handles: dict[torch.nn.Parameter, tuple[Any, Any]] = {}
        self._skip, self._ring = False, ring()
        self._fusion_bytes = _fusion_bytes()
        self._buckets: GradientBuckets | None = None
        self._ready: set[torch.nn.Parameter] = set()
        """The gradients in buckets this step."""
        self._sparse: set[torch.nn.Parameter] = set()
        """The parameters whose gradients came sparse this step: reduced dense (Horovod's
        ``sparse_as_dense``), made sparse again for the optimizer's step."""
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._gradient_ready) for p in self._counts
        ]

    def _gradient_ready(self, param: torch.nn.Parameter) -> None:
        """A parameter's gradient is accumulated: after the step's last backward pass, its
        average over the ranks (of the process set) starts now, while backward goes on."""
        if self._outside:  # as Horovod's: a rank outside the process set reduces nothing
            return
        with within(self._process_set):
            self._reduce_when_ready(param)

    def _reduce_when_ready(self, param: torch.nn.Parameter) -> None:
        self._forget_a_lost_ring()
        self._counts[param] += 1
        if param.grad.is_sparse:  # travels dense; sparse again for the step (synchronize)
            self._sparse.add(param)
            param.grad = param.grad.to_dense()
        if self._counts[param] < self._passes or size() == 1:
            return
        if self._agreed is not ring():  # the first reduction on these ranks: agree first
            _agree_on_parameters(list(self._counts), self._names)
            self._agreed = ring()
        if self._joined is None:  # the step's first reduction: has a rank joined?
            self._joined = coordinator().step()
        if param in self._handles or param in self._ready:
            raise HorovodError(
                "a gradient was reduced twice before the optimizer stepped: call "
                "optimizer.synchronize() before a second backward, or raise "
                "backward_passes_per_step"
            )
        if not self._joined and self._fusion_bytes:  # fused (a joined rank sends zeros by shape)
            self._ready.add(param)
            self._fuse(param)
            return
        wire, ctx = self._compression.compress(param.grad)
        op, pre, post = self._scaling()
        label = (self._names or {}).get(id(param))
        if self._joined:  # through the queue: the joined ranks take part with zeros by its row
            self._handles[param] = (_reduce_asked(wire, op, pre, post, label), ctx)
            return
        with naming(label):
            self._handles[param] = (_reduce(wire, op, pre, post), ctx)

    def _scaling(self) -> tuple[str, float, float]:
        """The op the ring runs and the factors before and after it: as Horovod's,
        ``gradient_predivide_factor`` f splits Average's division into 1/f before the sum and
        f/size after it."""
        if self._op == Average and self._predivide != 1.0:
            return Sum, 1.0 / self._predivide, self._predivide / size()
        return self._op, 1.0, 1.0

    def _fuse(self, param: torch.nn.Parameter) -> None:
        """Reduce ``param``'s gradient in its bucket, which starts once every gradient in it
        (and every bucket before it) is ready: as DDP's buckets and Horovod's tensor fusion."""
        if self._buckets is None:  # the first step on this ring
            params = list(self._counts)
            fused = _Fused(ring(), self._compression, params, self._names)
            self._buckets = GradientBuckets(
                params, fused, bucket_bytes=self._fusion_bytes, hooks=False
            )
            fused.name(self._buckets.groups)
        if not self._buckets.active:  # the step's first gradient
            op, pre, _ = self._scaling()
            if op == Average:
                self._buckets.start(average=True)
            else:
                self._buckets.start(weight=pre)
        self._buckets.ready(param)

    def _fused(self) -> None:
        """Wait for the buckets (started where backward did not reach): sums in ``.grad``."""
        if self._buckets is None or not self._buckets.active:
            return
        self._buckets.finish()
        _, _, post = self._scaling()
        if post != 1.0:  # each gradient is a view into its bucket: one pass a bucket
            for _, buffer in self._buckets.groups:
                buffer.mul_(post)

    def _forget_a_lost_ring(self) -> None:
        """Drop the reductions of a ring that lost a rank (``@hvd.elastic.run`` rolled back
        and formed a new one): their step is gone with it."""
        if self._ring is not ring():
            if self._buckets is not None:  # its buffers belong to the ring that is gone
                self._buckets.close()
                self._buckets = None
            self._handles.clear()
            self._ready.clear()
            self._sparse.clear()
            self._counts = dict.fromkeys(self._counts, 0)
            self._ring, self._joined = ring(), None

    def synchronize(self) -> None:
        """Wait until every gradient is averaged over the ranks (before clipping them)."""
        if self._outside:
            self._synchronized = True
            return
        with within(self._process_set):
            self._synchronize()

    def _synchronize(self) -> None:
        self._forget_a_lost_ring()
        self._fused()
        for param, (handle, ctx) in self._handles.items():
            reduced = self._compression.decompress(synchronize(handle), ctx)
            if reduced.data_ptr() != param.grad.data_ptr():
                param.grad.copy_(reduced)
        missing = [p for p, n in self._counts.items() if 0 < n < self._passes]
        if missing and size() > 1:
            raise HorovodError(
                f"{len(missing)} gradients had fewer than backward_passes_per_step "
                f"({self._passes}) backward passes when the optimizer stepped"
            )
        for param in self._sparse:
            param.grad = param.grad.to_sparse()
        self._handles.clear()
        self._ready.clear()
        self._sparse.clear()
        self._counts = dict.fromkeys(self._counts, 0)
        self._joined, self._synchronized = None, True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step`` inside it does not synchronize again (after an explicit ``synchronize``)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure: Any = None) -> Any:
        if not self._skip:
            if self._synchronized:
                warnings.warn(_SYNCHRONIZED_TWICE, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._outside:
            with within(self._process_set):
                self._forget_a_lost_ring()
        if self._handles or (self._buckets is not None and self._buckets.active):
            raise HorovodError(
                "zero_grad with gradients still being averaged: call optimizer.step() or "
                "optimizer.synchronize() first"
            )
        return super().zero_grad(set_to_none=set_to_none)


_SYNCHRONIZED_TWICE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(): the gradients are synchronized again (as in Horovod); use "
    "`with optimizer.skip_synchronize(): optimizer.step()` after an explicit synchronize()"
)


def _parameter_names(
    groups: list[dict[str, Any]], by_id: dict[int, str] | None
) -> dict[torch.nn.Parameter, str]:
    """Horovod's ``_parameter_names``: each parameter's name, ``allreduce.noname.<group>.<n>``
    where ``named_parameters`` was not given."""
    return {
        p: by_id[id(p)] if by_id is not None else f"allreduce.noname.{g}.{n}"
        for g, group in enumerate(groups)
        for n, p in enumerate(group["params"])
    }


class _Fused:
    """The collective the buckets reduce through: the ring, each bucket compressed as the
    optimizer's ``compression`` says and named in the timeline after its gradients."""

    def __init__(
        self,
        ring: Any,
        compression: Any,
        params: list[torch.nn.Parameter],
        names: dict[int, str] | None,
    ) -> None:
        self._ring, self._compression = ring, compression
        self._index = {id(p): i for i, p in enumerate(params)}
        self._names, self._labels = names, {}

    def name(self, groups: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
        """Label each bucket's buffer after the gradients it holds."""
        for params, buffer in groups:
            named = [
                (self._names or {}).get(id(p), f"gradient {self._index[id(p)]}") for p in params
            ]
            label = ", ".join(named)
            if len(named) > 3:
                label = f"{named[0]} ... {named[-1]} ({len(named)} gradients)"
            self._labels[buffer.data_ptr()] = label

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._ring.empty(numel, dtype, device)

    def allreduce_async_(self, buffer: torch.Tensor, *, op: str = "sum") -> CollectiveWork:
        wire, ctx = self._compression.compress(buffer)
        with naming(self._labels.get(buffer.data_ptr())):
            work = self._ring.allreduce_async_(wire, op=op)
        if wire.data_ptr() == buffer.data_ptr():
            return work
        return _Decompressed(work, buffer, ctx, self._compression)


class _Decompressed(CollectiveWork):
    """A compressed bucket's all-reduce; waited, its result is back in the bucket."""

    def __init__(self, work: CollectiveWork, buffer: torch.Tensor, ctx: Any, compression: Any):
        self._work, self._buffer, self._ctx, self._compression = work, buffer, ctx, compression

    def wait(self) -> torch.Tensor:
        reduced = self._compression.decompress(self._work.wait(), self._ctx)
        if reduced.data_ptr() != self._buffer.data_ptr():
            self._buffer.copy_(reduced)
        return self._buffer

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _fusion_bytes() -> int:
    """``HOROVOD_FUSION_THRESHOLD`` in bytes, or DDP's 25 MiB; 0 turns fusion off."""
    value = os.environ.get(FUSION_THRESHOLD)
    if value is None:
        return DEFAULT_FUSION_BYTES
    try:
        fusion = int(value)
    except ValueError:
        fusion = -1
    if fusion < 0:
        raise HorovodError(
            f"{FUSION_THRESHOLD} must be a number of bytes (0 or more), got {value!r}"
        )
    return fusion


def _agree_on_parameters(params: list[torch.nn.Parameter], names: dict[int, str] | None) -> None:
    """Every rank's optimizer steps the same parameters (names, shapes, dtypes, in order):
    checked once, as the gradients' reductions are matched by order and not checked again."""
    if size() == 1:
        return
    mine = [
        ((names or {}).get(id(p), f"parameter {i}"), tuple(p.shape), str(p.dtype))
        for i, p in enumerate(params)
    ]
    every = allgather_object(mine)
    for rank, theirs in enumerate(every):
        if theirs == every[0]:
            continue
        if len(theirs) != len(every[0]):
            raise HorovodError(
                f"DistributedOptimizer: rank 0 has {len(every[0])} parameters, rank {rank} "
                f"has {len(theirs)}: every rank must build the same model"
            )
        first = next(i for i, (a, b) in enumerate(zip(every[0], theirs, strict=True)) if a != b)
        raise HorovodError(
            f"DistributedOptimizer: parameter {first} is {every[0][first]} on rank 0 and "
            f"{theirs[first]} on rank {rank}: every rank must build the same model"
        )


def DistributedOptimizer(  # noqa: N802 (Horovod's name)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    sparse_as_dense: bool = False,
    process_set: ProcessSet | None = None,
    **refused: Any,
) -> torch.optim.Optimizer:
    """``optimizer`` whose ``step`` uses the gradients averaged (or summed) over the ranks,
    each started as soon as backward has accumulated it, as Horovod's. It is an instance of
    the optimizer's own class (its state, ``state_dict`` and param groups are the same).

    ``backward_passes_per_step``: backward passes accumulated locally before a step (the
    gradients are reduced once, after the last). ``compression``: ``Compression.none`` or
    ``Compression.fp16``. With ``process_set``, the gradients are averaged over its ranks
    only, and a rank outside it steps on its own gradients, as Horovod's. Sparse gradients
    (``nn.Embedding(sparse=True)``'s) are reduced dense and are sparse again for the step,
    whatever ``sparse_as_dense`` says (Horovod's ``sparse_as_dense=True``; its ``False``
    all-gathers their indices and values instead, with the same result).
    """
    if refused:
        raise HorovodError(
            f"DistributedOptimizer does not take {', '.join(sorted(refused))} "
            "(groupwise reductions are not supported)"
        )
    cls = type(optimizer.__class__.__name__, (_Distributed, optimizer.__class__), {})
    optimizer.__class__ = cls
    optimizer._process_set = process_set
    optimizer._outside = process_set is not None and not process_set.included()
    with within(None if optimizer._outside else process_set):
        optimizer._distribute(
            named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor
        )
    return optimizer


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Every rank's optimizer state (moments, steps, learning rates) becomes rank
    ``root_rank``'s. A fresh optimizer first takes a step on zero gradients, as Horovod's
    does, so that its state exists (a stateless one then has nothing to broadcast).

    Raises:
        ValueError: ``optimizer`` is an ``LBFGS`` (its state cannot be broadcast, as in
            Horovod).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        _zero_gradient_step(optimizer)
    if not optimizer.state_dict()["state"]:
        return
    state = broadcast_object(optimizer.state_dict(), root_rank)
    optimizer.load_state_dict(state)


def _zero_gradient_step(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's initialisation of a fresh optimizer's state: a step on zero gradients, taken
    by the optimizer's own class (a ``DistributedOptimizer``'s step would reduce them)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    if isinstance(optimizer, _Distributed):
        super(_Distributed, optimizer).step()
    else:
        optimizer.step()
