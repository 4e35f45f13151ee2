"""Sharded parameters: ZeRO-3 (``TrainConfig.shard="parameters"``), FSDP's full sharding.

Between steps each worker holds only its shard of the parameters, as under ZeRO-2 it holds
only its shard of the gradients and of the optimizer state (``engine.sharding``): the
module's parameters are views of flat buffers laid out as the gradient buckets are, and the
buffers' storage is freed (resized to nothing) while no computation needs them; this rank's
shard of each buffer lives in a tensor of its own, which the optimizer steps in place.

A *unit* is a bucket. Its buffer is all-gathered just before the forward of a module that
owns one of its parameters (a forward pre-hook; the next unit's gather starts meanwhile) and
freed once the forward of every such module's parent has run (its nearest ancestor that runs
a forward, below the root; a model reads its children's weights in its own forward, as a
head tied to the token embedding does). Backward gathers it again where autograd
unpacks a tensor saved from it (``saved_tensors_hooks``; the next unit backward reaches
starts to gather meanwhile), and frees it once the bucket's gradients are taken for their
reduce-scatter (``GradientBuckets.launched``): backward needs a unit's weights only to
compute the gradients of the layers before it, which it has done once the unit's own
gradients are in. The module's own parameters (a LightningModule's, used anywhere in its
step) are gathered for a whole pass. Evaluation gathers and frees through the same hooks.

So every worker must run the same layers in the same order, in every forward pass (each
gather is a collective), and a layer's weights may be read only inside the forward of a
module that owns them or of its parent (the module's own parameters: anywhere in its step).
A unit freed, its parameters are of a class of their own (:func:`_freed_class`) whose every
use but their metadata (shape, dtype, ``.grad``, ``requires_grad``) raises ``RuntimeError``
naming the weight and what to do: a weight penalty that reads a layer's weights after its
forward, a hook or callback that reads them after the step (``on_train_batch_end``,
``on_validation_epoch_end``...) fail at once as the module's error, never read freed memory.
``detach()``, ``.data`` and ``state_dict()`` of a freed weight give tensors that raise
alike.

Each gather fills a buffer of its own, and freeing a unit only lets go of it: a tensor that
views a unit's weights (kept from a forward, returned by it) keeps that buffer, and the
values it viewed, for as long as it lives. Autograd's saved tensors keep no buffer: each
names its unit and its place in the buffer, and backward views the unit gathered again.

Commits, checkpoints and the weights a run returns are the whole state, gathered by every
worker alike (:meth:`ShardedParameters.copies`); a rollback or a checkpoint loaded writes
whole weights, each worker keeping its shard of them (:meth:`ShardedParameters.writing`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from ringflow.engine.collective import Collective, GradientBuckets, shard_of
from ringflow.engine.collective.base import CollectiveWork
from ringflow.engine.errors import EngineError

__all__ = ["ShardedParameters"]


class _Saved(NamedTuple):
    """A tensor autograd saved for backward that views the buffer of unit ``index``: where
    in it (not the tensor, which would keep the buffer)."""

    index: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


_METADATA = frozenset(
    {
        "shape", "dtype", "device", "layout", "ndim", "is_leaf", "requires_grad", "grad",
        "_grad", "retains_grad", "grad_fn", "_version", "output_nr", "_base", "names", "_cdata",
        "_backward_hooks", "_post_accumulate_grad_hooks", "itemsize", "nbytes", "is_cuda",
        "is_cpu", "is_meta", "is_mps", "is_xpu", "is_sparse", "is_quantized", "is_mkldnn",
        "is_nested", "size", "dim", "numel", "nelement", "element_size", "stride",
        "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "is_signed",
        "is_inference", "_is_view", "get_device", "requires_grad_", "register_hook",
        "register_post_accumulate_grad_hook", "untyped_storage", "data_ptr", "__len__",
        "__dir__", "empty_like", "zeros_like", "ones_like", "full_like", "new_empty",
        "new_zeros", "new_ones", "new_full", "new_empty_strided",
    }
)  # fmt: skip
"""What a freed weight answers: what reads none of its elements."""
_SHAPES = frozenset({"view_as", "expand_as", "reshape_as", "type_as"})
"""What takes only a freed weight's metadata where it is the other tensor."""
_SETTABLE = frozenset(
    {"grad", "_grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"}
)
_ALIASES = frozenset({"detach", "data"})
"""What gives a freed weight's alias (``state_dict()`` takes its ``detach()``): freed too."""
_NAMES: dict[int, str] = {}
"""Each sharded parameter's name in its module, by ``id``: what a freed one's error names."""


def _freed_torch_function(
    cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None
) -> Any:
    """Any use of a freed weight (a parameter whose unit is not gathered, or an alias of
    it) but its metadata raises ``RuntimeError`` naming it; its ``detach()`` and ``.data``
    are aliases freed alike."""
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "")
    access = "call"
    if name in ("__get__", "__set__", "__delete__"):
        access, name = name, getattr(getattr(func, "__self__", None), "__name__", "")
    if access == "__set__":
        allowed = name in _SETTABLE
    else:
        allowed = name in _METADATA or (
            name in _SHAPES and len(args) == 2 and not _is_freed(args[0])
        )
    if allowed:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if access != "__set__" and name in _ALIASES and len(args) == 1 and not kwargs:
        with torch._C.DisableTorchFunctionSubclass():
            alias = func(*args).as_subclass(_FreedTensor)
        alias._ringflow_name = _name_of(args[0])
        return alias
    freed = next((a for a in _tensors(args, kwargs) if _is_freed(a)), None)
    raise RuntimeError(
        f"the weight {_freed_name(freed)} was read where it is not gathered: under "
        "shard='parameters' a layer's weights exist only inside the forward of the module "
        "that owns them or of its parent (the module's own parameters: during its steps); "
        "read weights only there, or use shard='gradients'"
    )


def _tensors(args: Any, kwargs: dict[str, Any]) -> Iterator[Any]:
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, list | tuple):
            yield from arg
        else:
            yield arg


def _is_freed(value: Any) -> bool:
    return getattr(type(value), "_ringflow_freed", False)


def _name_of(tensor: Any) -> str:
    return _NAMES.get(id(tensor)) or getattr(tensor, "_ringflow_name", "")


def _freed_name(tensor: Any) -> str:
    name = _name_of(tensor)
    return repr(name) if name else "(a sharded parameter)"


class _FreedTensor(torch.Tensor):
    """An alias of a freed weight (``detach()``, ``.data``, ``state_dict()``): it raises as
    the weight does."""

    _ringflow_freed = True
    __torch_function__ = classmethod(_freed_torch_function)  # type: ignore[assignment]


@functools.cache
def _freed_class(cls: type) -> type:
    """The class a parameter of class ``cls`` takes while its unit is freed."""
    return type(
        f"Freed{cls.__name__}",
        (cls,),
        {
            "_ringflow_freed": True,
            "__torch_function__": classmethod(_freed_torch_function),
            "__module__": __name__,
        },
    )


_CONTAINERS = (
    torch.nn.ModuleList,
    torch.nn.ModuleDict,
    torch.nn.ParameterList,
    torch.nn.ParameterDict,
)
"""Modules that only hold others: no forward of theirs runs."""


def _holder(owner: torch.nn.Module, root: torch.nn.Module, parents: dict) -> torch.nn.Module:
    """The module whose forward ends the use of ``owner``'s parameters: its nearest ancestor
    below ``root`` that runs a forward (not a container), else ``owner`` itself.

    A model reads a child's weights in its own forward as often as it calls the child (a
    language model's head tied to its token embedding: ``F.linear(x, self.wte.weight)``),
    so a unit is kept from its owner's forward to the end of its parent's, as FSDP keeps a
    unit for the forward of the module it wraps. The root (the LightningModule, whose
    ``forward`` a step need not call) never holds: its children free their units as they
    end."""
    parent = parents.get(id(owner))
    while parent is not None and isinstance(parent, _CONTAINERS):
        parent = parents.get(id(parent))
    return owner if parent is None or parent is root else parent


class ShardedParameters:
    """The module's trainable parameters, each worker holding its shard of each bucket's.

    Args:
        module: the module; its parameters become views of the buckets' flat buffers, and
            every submodule that owns one gets the forward hooks that gather and free them.
        buckets: the gradient buckets (reduce-scattered, keeping their shards): one unit
            each, laid out as they are.
        collective: the ring of this rank.
    """

    def __init__(
        self, module: torch.nn.Module, buckets: GradientBuckets, collective: Collective
    ) -> None:
        self.collective = collective
        rank, size = collective.rank, collective.world_size
        self.flats: list[torch.Tensor] = []
        """Each bucket's parameters, flat and padded: while the unit is gathered, the buffer
        its module's parameters view (a new one each gather); else a stand-in of its size
        that holds no memory."""
        self.shards: list[torch.Tensor] = []
        """This rank's shard of each flat buffer, in storage of its own: what is kept."""
        self._params: list[list[torch.Tensor]] = []
        self._classes: list[list[type]] = []
        """Each parameter's own class, which it has while its unit is gathered."""
        self._empty: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        """Each unit's stand-ins, holding no memory: a flat one, and one per parameter."""
        names = {id(p): name for name, p in module.named_parameters()}
        with torch.no_grad():
            for params, numel, _ in buckets.shards:
                flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
                empty = torch.empty_like(flat)
                offset, stand_ins = 0, []
                for param in params:
                    flat[offset : offset + param.numel()].view_as(param).copy_(param)
                    stand_ins.append(empty[offset : offset + param.numel()].view_as(param))
                    _NAMES[id(param)] = names.get(id(param), "")
                    offset += param.numel()
                empty.untyped_storage().resize_(0)
                self.flats.append(flat)
                self.shards.append(shard_of(flat, rank, size).clone())
                self._params.append(list(params))
                self._classes.append([type(param) for param in params])
                self._empty.append((empty, stand_ins))
        layout = tuple((tuple(map(id, params)), flat.numel()) for params, flat, _ in self._units)
        self._key = (rank, size, layout)
        count = len(self.flats)
        self._gathered = [True] * count
        self._works: list[CollectiveWork | None] = [None] * count
        self._ptrs: dict[int, int] = {}
        """The data pointer of each gathered unit's storage: its index."""
        self._holding = 0
        """While above 0, every unit is gathered and stays so (:meth:`gathered`)."""
        self._backward = False
        """Within the backward pass (:meth:`backward`)."""
        self.missing = False
        """This rank's shard of the weights is not here (:meth:`take`) until whole weights
        are written (:meth:`writing`)."""
        unit_of = {id(p): index for index, params in enumerate(self._params) for p in params}
        self._holders: list[list[torch.nn.Module]] = [[] for _ in range(count)]
        """The modules whose forward ends each unit's use (:func:`_holder`)."""
        self._left: list[set[int]] = [set() for _ in range(count)]
        """The holders of each gathered unit whose forward has not run since it gathered."""
        self._hooks: list[Any] = []
        self.pinned: frozenset[int] = frozenset()
        """The units holding the module's own parameters: gathered for whole passes."""
        parents = {id(child): parent for parent in module.modules() for child in parent.children()}
        held: dict[int, tuple[torch.nn.Module, set[int]]] = {}
        for owner in module.modules():
            units = sorted(
                {
                    unit_of[id(p)]
                    for p in owner._parameters.values()
                    if p is not None and id(p) in unit_of
                }
            )
            if not units:
                continue
            if owner is module:
                self.pinned = frozenset(units)
            holder = _holder(owner, module, parents)
            held.setdefault(id(holder), (holder, set()))[1].update(units)
            self._hooks.append(
                owner.register_forward_pre_hook(functools.partial(self._before_forward, units))
            )
        for holder, units in held.values():
            for index in units:
                self._holders[index].append(holder)
            self._hooks.append(
                holder.register_forward_hook(functools.partial(self._after_forward, sorted(units)))
            )
        self._buckets = buckets
        buckets.launched = self._reduced
        for index in range(count):
            self._show(index)
            self._free(index)

    # ------------------------------------------------------------------ units

    def _start(self, index: int) -> None:
        """Start gathering unit ``index`` (nothing if it is gathered or on its way)."""
        if self._gathered[index] or self._works[index] is not None:
            return
        flat = self.flats[index]
        flat.data = torch.empty_like(flat)
        self._ptrs[flat.untyped_storage().data_ptr()] = index
        self._left[index] = {id(holder) for holder in self._holders[index]}
        self._works[index] = self.collective.all_gather_into_async_(self.shards[index], out=flat)

    def _gather(self, index: int) -> None:
        """Unit ``index`` gathered, waiting for it."""
        self._start(index)
        work, self._works[index] = self._works[index], None
        if work is not None:
            work.wait()
            self._show(index)

    def _show(self, index: int) -> None:
        """Unit ``index`` gathered: its parameters view its buffer, of their own class."""
        flat, offset = self.flats[index], 0
        with torch._C.DisableTorchFunctionSubclass():
            for param, cls in zip(self._params[index], self._classes[index], strict=True):
                param.data = flat[offset : offset + param.numel()].view_as(param)
                param.__class__ = cls
                offset += param.numel()
        self._gathered[index] = True

    def _free(self, index: int, *, quietly: bool = False) -> None:
        """Let unit ``index``'s buffer go (once a gather into it is done: the collective
        writes into it until then): its parameters are freed (:func:`_freed_class`), a
        stand-in that holds no memory their data."""
        work, self._works[index] = self._works[index], None
        if work is None and not self._gathered[index]:
            return
        try:
            if work is not None:
                work.wait()
        except Exception:
            if not quietly:
                raise
        finally:
            empty, stand_ins = self._empty[index]
            with torch._C.DisableTorchFunctionSubclass():
                for param, cls, stand_in in zip(
                    self._params[index], self._classes[index], stand_ins, strict=True
                ):
                    param.__class__ = _freed_class(cls)
                    param.data = stand_in
            flat = self.flats[index]
            self._ptrs.pop(flat.untyped_storage().data_ptr(), None)
            flat.data = empty
            self._gathered[index] = False

    def _prefetch(self, index: int) -> None:
        if 0 <= index < len(self.flats):
            self._start(index)

    def _before_forward(self, units: list[int], module: torch.nn.Module, args: Any) -> None:
        """A module's forward is about to run: its units gathered, and the unit forward
        reaches next (the buckets run from the last layers to the first) on its way."""
        for index in units:
            self._start(index)
        for index in units:
            self._gather(index)
        self._prefetch(units[0] - 1)

    def _after_forward(
        self, units: list[int], module: torch.nn.Module, args: Any, output: Any
    ) -> None:
        """A module's forward ran: a unit every holder of which has run since it was gathered
        is freed (the module's own aside, every unit while :meth:`gathered` holds, and any
        within backward, where the bucket frees it)."""
        if self._holding or self._backward:
            return
        for index in units:
            left = self._left[index]
            left.discard(id(module))
            if not left and index not in self.pinned:
                self._free(index)

    def _reduced(self, index: int) -> None:
        """Bucket ``index``'s gradients are taken for their reduce-scatter: backward needs
        its weights no more."""
        if not self._holding and index not in self.pinned:
            self._free(index)

    def _pack(self, tensor: torch.Tensor) -> Any:
        """A tensor that views a gathered unit's buffer as its place in it; any other as it
        is (one viewing a buffer in another way, of another dtype, keeps it)."""
        try:
            index = self._ptrs.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no storage of its own to view ours
            return tensor
        if index is None or tensor.dtype != self.flats[index].dtype or tensor.is_conj():
            return tensor
        if tensor.is_neg() or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return tensor
        return _Saved(index, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is not _Saved:
            return saved
        self._gather(saved.index)
        self._prefetch(saved.index + 1)  # the unit backward reaches next
        return self.flats[saved.index].as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------------ passes

    def begin(self) -> None:
        """Before a pass (a training batch, an evaluation): the module's own parameters
        gathered.

        Raises:
            EngineError: this rank's shard of the weights is missing (:meth:`take`).
        """
        if self.missing:
            raise EngineError(
                "sharded parameters: this worker's shard of the weights was not carried into "
                "the new membership and no commit was loaded since"
            )
        for index in sorted(self.pinned, reverse=True):
            self._start(index)
        for index in sorted(self.pinned, reverse=True):
            self._gather(index)

    def end(self) -> None:
        """After a pass: every unit freed (a failed collective's error is not raised again:
        the ring keeps it for the next collective or check)."""
        for index in range(len(self.flats)):
            self._free(index, quietly=True)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around a forward pass whose backward comes: the tensors autograd saves from a
        unit's weights gather it again when backward unpacks them."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around the backward pass: a forward run inside it (activation checkpointing's
        recomputation, whose saved tensors this cannot see) frees nothing; each unit is
        freed once its bucket's gradients are taken, or at :meth:`end`."""
        self._backward = True
        try:
            yield
        finally:
            self._backward = False

    @contextlib.contextmanager
    def gathered(self, *, write: bool = False) -> Iterator[None]:
        """Every unit gathered while the block runs (collective: every worker alike), then
        freed; with ``write``, what the block wrote into the weights (every worker alike: a
        broadcast) is kept."""
        for index in reversed(range(len(self.flats))):
            self._start(index)
        for index in reversed(range(len(self.flats))):
            self._gather(index)
        self._holding += 1
        try:
            yield
            if write:
                self._keep_shards()
        finally:
            self._holding -= 1
            if not self._holding:
                self.end()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The block writes whole weights (a rollback, a checkpoint loaded); each worker
        keeps its shard of them. Not collective: the buffers are allocated, not gathered,
        and only this rank's shard of each is read back."""
        self.end()
        rank, size = self.collective.rank, self.collective.world_size
        for index, flat in enumerate(self.flats):
            flat.data = torch.zeros_like(flat)
            with torch.no_grad():
                shard_of(flat, rank, size).copy_(self.shards[index])
            self._show(index)
        self._holding += 1
        try:
            yield
            self._keep_shards()
            self.missing = False
        finally:
            self._holding -= 1
            self.end()

    def _keep_shards(self) -> None:
        rank, size = self.collective.rank, self.collective.world_size
        with torch.no_grad():
            for flat, shard in zip(self.flats, self.shards, strict=True):
                shard.copy_(shard_of(flat, rank, size))

    def copies(self) -> dict[int, torch.Tensor]:
        """Every trainable parameter's whole value by ``id``, gathered into tensors of their
        own (collective: every worker alike), the module's buffers left as they are."""
        works, whole = [], {}
        for params, flat, shard in self._units:
            out = torch.empty_like(flat)
            works.append(self.collective.all_gather_into_async_(shard, out=out))
            offset = 0
            for param in params:
                whole[id(param)] = out[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
        for work in works:
            work.wait()
        return whole

    @property
    def _units(self) -> list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]:
        """Each unit's parameters, flat buffer and shard."""
        return list(zip(self._params, self.flats, self.shards, strict=True))

    # ------------------------------------------------------------------ membership

    def carry(self) -> tuple[Any, list[torch.Tensor]]:
        """This rank's shards, to :meth:`take` into the next layout (call before
        :meth:`release`)."""
        return self._key, self.shards

    def take(self, carried: tuple[Any, list[torch.Tensor]] | None) -> bool:
        """The shards :meth:`carry` kept of an earlier layout, where it is this one (the
        same rank of the same number of workers); whether it was. Else the weights are
        missing until whole weights are written."""
        if carried is None:
            return True
        key, shards = carried
        if key != self._key:
            self.missing = True
            return False
        with torch.no_grad():
            for mine, kept in zip(self.shards, shards, strict=True):
                mine.copy_(kept)
        self.missing = False
        return True

    def restore(self, shards: list[torch.Tensor]) -> None:
        """Take this rank's shards back from a commit of this layout (not collective)."""
        self.end()
        with torch.no_grad():
            for mine, kept in zip(self.shards, shards, strict=True):
                mine.copy_(kept)
        self.missing = False

    def release(self) -> None:
        """Remove the hooks and give every parameter storage of its own, zeroed (the ring,
        and so the layout, is about to change: the weights come from a commit or from
        :meth:`carry` then)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._buckets.launched = None
        self.end()
        with torch._C.DisableTorchFunctionSubclass():
            for params, classes in zip(self._params, self._classes, strict=True):
                for param, cls in zip(params, classes, strict=True):
                    param.data = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
                    param.__class__ = cls
                    _NAMES.pop(id(param), None)
        self._params, self.flats, self.shards, self._classes, self._empty = [], [], [], [], []
