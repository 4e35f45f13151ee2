"""Sharded data parallel: ZeRO-1 (``TrainConfig.shard="optimizer"``), each worker keeping the
optimizer state of its shard of the flat parameters only, ZeRO-2 (``"gradients"``), its
shard of the gradients too, and ZeRO-3 (``"parameters"``), its shard of the parameters too.

The gradient buckets (``engine.collective.buckets``) are padded to ``world_size`` equal
shards and reduce-scattered, so rank ``r`` ends holding the averaged gradient of shard ``r``
of every bucket. The module's parameters become views of flat parameter buffers laid out as
the buckets are; the optimizer's param groups hold this rank's pieces of them instead (a
parameter cut by a shard's edge gives a piece to each side), with the bucket's gradient
shard as their ``.grad``. The optimizer steps those pieces in place, and every bucket's
parameter buffer is then all-gathered: every worker holds the whole updated model.
Under ZeRO-2 the buckets keep only that shard of their sums (``GradientBuckets``'s
``keep_shards``), reduce-scattered at every backward pass (with gradient accumulation, each
batch's sums are added to the shard) and their whole buffers let go once reduced: the
parameters hold no gradient after backward, and the pieces' gradients are views of the
kept shards.

Only optimizers that update each element from its own gradient and state alone may step
pieces instead of parameters (``ELEMENTWISE``): the result is then what stepping the whole
parameters gives. Clipping by norm takes the whole model's norm: the squared norms of the
shards, summed over the workers; where that norm may clip, the norm ``shard="none"``
computes from whole gradients, bit for bit (:meth:`ShardedOptimizer.norm_across`): the
sum's last bit may differ, and under ``bf16-mixed`` weights a last bit apart drift apart
(each forward rounds them to bfloat16, where one such bit may round the other way).

A checkpoint holds each worker's own shard, written by that worker, nothing gathered
(``storage.reshard``'s ``zero-{rank}`` shards): the optimizer state of its pieces
(:meth:`ShardedOptimizer.state_pieces`) and its pieces of the weights, by parameter name and
element range; any number of workers, sharded or not, assembles what it needs from them
(:meth:`ShardedOptimizer.load_pieces` takes a worker's pieces). An in-memory commit keeps
two shards of the sharded state, this worker's and the next one's
(:meth:`ShardedOptimizer.commit_state`): a worker rolling back in the same layout takes its
own back; where the members changed, they assemble the whole from what each kept
(``engine.sharded_commit``) and take their pieces of the new layout from it.

ZeRO-3 (``"parameters"``) keeps only this rank's shard of the parameters too
(``engine.sharded_parameters``): the pieces view it, the step updates it in place, and the
next forward gathers each bucket's parameters where they are used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ringflow.engine.collective import Collective, GradientBuckets, shard_of
from ringflow.engine.errors import EngineError, ModelError
from ringflow.storage.checkpoint import CheckpointError
from ringflow.storage.reshard import optimizer_state_by_name, piece_key, restore_hyperparameters

if TYPE_CHECKING:
    from ringflow.engine.sharded_parameters import ShardedParameters

__all__ = ["ELEMENTWISE", "ShardedOptimizer", "check_elementwise"]

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)
"""torch's optimizers that update each element of a parameter from its own gradient and
state alone (and a step count): stepping any cut of the elements gives the same result."""


def check_elementwise(optimizer: Any) -> None:
    """Refuse an optimizer that cannot step shards of its parameters.

    Raises:
        ModelError: in one line, naming it and those that can.
    """
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(o.__name__ for o in ELEMENTWISE)
        raise ModelError(
            f"a sharded optimizer steps each worker's shard of the parameters, which "
            f"{type(optimizer).__name__} may not update element by element: use one of "
            f"{names}, or shard='none'"
        )


@dataclass(frozen=True, slots=True)
class _Piece:
    """The elements ``[start, stop)`` of ``param`` that fall in this rank's shard of its
    bucket; ``tensor`` views them in the bucket's parameter buffer."""

    param: torch.Tensor
    start: int
    stop: int
    tensor: torch.Tensor
    grad: torch.Tensor


class ShardedOptimizer:
    """A torch optimizer made to step this rank's shard of the parameters only.

    Stands where the worker's optimizer stands for commits and checkpoints: ``param_groups``
    and ``state`` name the module's whole parameters, ``state_dict`` /
    ``load_state_dict`` take the whole state (gathering it is collective).

    Args:
        optimizer: the module's optimizer (``check_elementwise``); its param groups are
            given this rank's pieces and its state is cleared.
        buckets: the gradient buckets, reduce-scattered (``scatter=True``; under ZeRO-2
            keeping their shards only, ``keep_shards=True``).
        collective: the ring of this rank.
        parameters: under ZeRO-3 (``shard="parameters"``), the sharded parameters
            (``engine.sharded_parameters``): the pieces are views of this rank's shards
            of their buffers, which hold the parameters between steps.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buckets: GradientBuckets,
        collective: Collective,
        *,
        parameters: ShardedParameters | None = None,
    ) -> None:
        check_elementwise(optimizer)
        if not buckets.scatter:
            raise ValueError("the buckets of a sharded optimizer must reduce-scatter")
        self.inner = optimizer
        self.collective = collective
        rank, size = collective.rank, collective.world_size
        self._groups = [list(group["params"]) for group in optimizer.param_groups]
        owner = {id(p): g for g, params in enumerate(self._groups) for p in params}
        idle = _ranks_without_pieces(buckets.shards, owner, size)
        if idle:
            total = sum(p.numel() for params in self._groups for p in params)
            raise ModelError(
                f"shard: on {size} workers, worker {idle[0]} would step no parameter: the "
                f"model's {total:,} trainable elements do not reach its shard of any bucket; "
                "use fewer workers or shard='none'"
            )
        self.parameters = parameters
        """Under ZeRO-3, the sharded parameters, whose shards the pieces view: stepped in
        place, they are gathered by the next forward, not after the step."""
        self.flats: list[torch.Tensor] = []
        """Each bucket's parameters, flat and padded: the module's parameters view them."""
        self._layout: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, offset)
        self._spans: list[tuple[torch.Tensor, int, int, int, int]] = []
        """Every bucketed parameter with elements in this rank's shard: (param, start, stop,
        bucket, where ``start`` is in the bucket's shard)."""
        self._buckets: list[tuple[list[torch.Tensor], int]] = []  # params, padded length
        pieces: list[list[_Piece]] = [[] for _ in self._groups]
        with torch.no_grad():
            for index, (params, numel, grads) in enumerate(buckets.shards):
                shard = numel // size
                low, high = rank * shard, (rank + 1) * shard
                if parameters is None:
                    flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
                    mine = flat[low:high]
                else:  # the parameters view it already; its storage is freed
                    flat, mine = parameters.flats[index], parameters.shards[index]
                offset = 0
                for param in params:
                    n = param.numel()
                    if parameters is None:
                        view = flat[offset : offset + n].view_as(param)
                        view.copy_(param)
                        param.data = view
                    self._layout[id(param)] = (index, offset)
                    start, stop = max(low, offset), min(high, offset + n)
                    if start < stop:
                        span = (param, start - offset, stop - offset, index, start - low)
                        self._spans.append(span)
                    if start < stop and id(param) in owner:
                        pieces[owner[id(param)]].append(
                            _Piece(
                                param,
                                start - offset,
                                stop - offset,
                                mine[start - low : stop - low],
                                grads[start - low : stop - low],
                            )
                        )
                    offset += n
                self.flats.append(flat)
                self._buckets.append((list(params), numel))
        self._pieces = pieces
        self._norm_plans: list[_NormPlan] | None = None
        self.missing = False
        """The state of this rank's shard is not here (:meth:`take`) until
        :meth:`load_state_dict`."""
        for group, mine in zip(optimizer.param_groups, pieces, strict=True):
            group["params"] = [piece.tensor for piece in mine]
        optimizer.state.clear()
        self.attach_grads()

    def release(self) -> None:
        """Give the optimizer its parameters back, its state cleared, and the parameters
        storage of their own (the ring, and so the layout, is about to change)."""
        with torch.no_grad():
            for params in self._groups:
                for param in params:
                    if id(param) in self._layout and self.parameters is None:
                        param.data = param.data.clone()
        for group, params in zip(self.inner.param_groups, self._groups, strict=True):
            group["params"] = params
        self.inner.state.clear()
        self.flats = []
        self.parameters = None
        self._spans = []

    def carry(self) -> list[tuple[torch.Tensor, int, int, dict[str, Any]]]:
        """This rank's state, piece by piece, to :meth:`take` into the next layout (call
        before :meth:`release`)."""
        return [
            (piece.param, piece.start, piece.stop, self.inner.state[piece.tensor])
            for mine in self._pieces
            for piece in mine
            if piece.tensor in self.inner.state
        ]

    def take(self, carried: list[tuple[torch.Tensor, int, int, dict[str, Any]]]) -> bool:
        """The state :meth:`carry` kept of an earlier layout, where every piece of this one
        is a piece it kept (the same rank of the same number of workers); whether it was."""
        kept = {(id(param), start, stop): entry for param, start, stop, entry in carried}
        pieces = [piece for mine in self._pieces for piece in mine]
        found = [kept.get((id(p.param), p.start, p.stop)) for p in pieces]
        if carried and any(entry is None for entry in found):
            self.missing = True  # until load_state_dict: a rollback's, which comes next
            return False
        self.inner.state.clear()
        for piece, entry in zip(pieces, found, strict=True):
            if entry is not None:
                self.inner.state[piece.tensor] = entry
        return True

    # ------------------------------------------------------------------ training

    def attach_grads(self) -> None:
        """Before a step: give every piece its gradient shard (a module's
        ``optimizer_zero_grad`` may have set it to ``None``).

        Raises:
            EngineError: the state of this rank's shard is missing (:meth:`take`).
        """
        if self.missing:
            raise EngineError(
                "a sharded optimizer: the state of this worker's shard was not carried "
                "into the new membership and no commit was loaded since"
            )
        for mine in self._pieces:
            for piece in mine:
                piece.tensor.grad = piece.grad

    def sum_across(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the workers (clipping's squared norms of the shards)."""
        return self.collective.allreduce_(tensor.reshape(1).clone()).reshape(tensor.shape)

    def norm_across(
        self,
        local: torch.Tensor,
        *,
        clip_val: float,
        then: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Clipping by norm's ``whole_norm`` (``Optimization.step``): the whole model's
        gradient norm from the norm of this rank's shard, ``local``, its square summed over
        the workers (every worker alike: collective), then ``then`` (over the workers holding
        the model's other parts: a pipeline's other stages). Where the norm may clip (it is
        within 0.1% of ``clip_val``, or above), the norm ``shard="none"`` computes from whole
        gradients instead (:meth:`whole_norm`, its square summed ``then``; collective too):
        the clipped gradients are then those of ``shard="none"``, bit for bit. Below,
        neither clips."""
        total = self.sum_across(local.float().square())
        total = (total if then is None else then(total)).sqrt()
        if bool(((total + 1e-6) * 1.001 < clip_val).item()):
            return total
        whole = self.whole_norm()
        return whole if then is None else then(whole.float().square()).sqrt()

    def whole_norm(self) -> torch.Tensor:
        """The norm of the gradients of the optimizer's parameters as
        ``torch.nn.utils.get_total_norm`` gives it from whole gradients (``shard="none"``'s
        clipping), bit for bit: each parameter's norm taken by the worker that holds it
        whole, or, cut by a shard's edge, from its pieces gathered; then the norm of those
        norms, in the optimizer's order. Collective: a bucket's norms and cut pieces are
        all-gathered at a time."""
        if self._norm_plans is None:
            size = self.collective.world_size
            self._norm_plans = [
                _plan_norms(params, numel, self._layout, self._groups, size)
                for params, numel in self._buckets
            ]
        mine = {id(piece.param): piece.grad for group in self._pieces for piece in group}
        norms: dict[int, torch.Tensor] = {}
        for plan in self._norm_plans:
            if plan.length:
                norms.update(self._bucket_norms(plan, mine))
        ordered: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for params in self._groups:  # get_total_norm's order: by device and dtype, then theirs
            for param in params:
                if id(param) in self._layout:
                    norm = norms.get(id(param))
                    if norm is None:  # no element
                        norm = torch.zeros((), dtype=param.dtype, device=param.device)
                    ordered.setdefault((param.device, param.dtype), []).append(norm)
        flat = [norm for norms_of in ordered.values() for norm in norms_of]
        if not flat:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack([n.to(flat[0].device) for n in flat]), 2.0)

    def _bucket_norms(
        self, plan: _NormPlan, mine: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """The norm of each gradient of one bucket (:meth:`whole_norm`), by ``id``, from
        this rank's gradient pieces ``mine``."""
        rank, size = self.collective.rank, self.collective.world_size
        first = next(iter(mine.values()))
        payload = torch.zeros(plan.length, dtype=first.dtype, device=first.device)
        whole = plan.whole[rank]
        if whole:
            norms = torch._foreach_norm([mine[id(p)] for p in whole], 2.0)
            payload[: len(whole)] = torch.stack(norms)
        at = len(whole)
        for param, low, high in plan.cut[rank]:
            payload[at : at + high - low] = mine[id(param)]
            at += high - low
        out = torch.empty(plan.length * size, dtype=first.dtype, device=first.device)
        self.collective.all_gather_into_(payload, out=out)
        found: dict[int, torch.Tensor] = {}
        parts: dict[int, list[torch.Tensor]] = {}
        for r in range(size):
            at = r * plan.length
            for k, param in enumerate(plan.whole[r]):
                found[id(param)] = out[at + k]
            at += len(plan.whole[r])
            for param, low, high in plan.cut[r]:
                parts.setdefault(id(param), []).append(out[at : at + high - low])
                at += high - low
        cut = [p for p in plan.order if id(p) in parts]
        if cut:
            grads = [torch.cat(parts[id(p)]) for p in cut]
            for param, norm in zip(cut, torch._foreach_norm(grads, 2.0), strict=True):
                found[id(param)] = norm
        return found

    def gather(self) -> None:
        """All-gather every bucket's parameters after this rank stepped its shard (under
        ZeRO-3 nothing: the next forward gathers them)."""
        if self.parameters is not None:
            return
        size, rank = self.collective.world_size, self.collective.rank
        works = [
            self.collective.all_gather_into_async_(shard_of(flat, rank, size), out=flat)
            for flat in self.flats
        ]
        for work in works:
            work.wait()

    # ------------------------------------------------------------------ this rank's shard

    def spans(self) -> list[tuple[torch.Tensor, int, int, torch.Tensor]]:
        """Every bucketed parameter's elements ``[start, stop)`` (of it flattened) that fall
        in this rank's shard, with a view of their values there: this rank's shard of the
        weights (under ZeRO-3 the shard kept, else the flat buffer's; the whole weights are
        the module's parameters then), which writing into changes."""
        spans = []
        for param, start, stop, index, at in self._spans:
            mine = self._mine(index)
            spans.append((param, start, stop, mine[at : at + stop - start]))
        return spans

    def _mine(self, index: int) -> torch.Tensor:
        """This rank's shard of bucket ``index``'s parameters."""
        if self.parameters is not None:
            return self.parameters.shards[index]
        return shard_of(self.flats[index], self.collective.rank, self.collective.world_size)

    @property
    def bucketed(self) -> frozenset[int]:
        """The ``id`` of every parameter laid out in the buckets (sharded)."""
        return frozenset(self._layout)

    def state_pieces(
        self, named_params: Iterable[tuple[str, torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's part of the optimizer state by parameter name, nothing gathered: each
        elementwise state tensor of a piece as ``{name}/{key}[{start}:{stop}]``
        (``storage.reshard.piece_key``), the others (the step count, every piece's alike)
        whole as ``{name}/{key}`` from the rank holding the parameter's first elements.
        The metadata is ``storage.reshard.optimizer_state_by_name``'s, for the parameters
        this rank holds pieces of (``merge_sharded_optimizer_metadata`` joins the ranks').
        The tensors alias the state."""
        named = list(named_params)
        names = {id(param): name for name, param in named}
        held = {
            piece.param: (piece, self.inner.state[piece.tensor])
            for mine in self._pieces
            for piece in mine
            if self.inner.state.get(piece.tensor)
        }
        view = _Whole(self.param_groups, {param: entry for param, (_, entry) in held.items()})
        by_name, metadata = optimizer_state_by_name(view, named)
        metadata["optimizer"] = type(self.inner).__name__
        piece_of = {names[id(param)]: piece for param, (piece, _) in held.items()}
        tensors: dict[str, torch.Tensor] = {}
        for key, value in by_name.items():
            name, state = key.rsplit("/", 1)
            piece = piece_of[name]
            if _elementwise(state, value):
                tensors[piece_key(key, piece.start, piece.stop)] = value
            elif piece.start == 0:
                tensors[key] = value
        return tensors, metadata

    def pieces(self) -> list[tuple[torch.Tensor, int, int]]:
        """This rank's pieces: each parameter an optimizer group steps, and which of its
        elements (flattened) this rank steps."""
        return [(p.param, p.start, p.stop) for mine in self._pieces for p in mine]

    def load_pieces(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]],
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, Any],
    ) -> None:
        """Take this rank's pieces of the optimizer state: ``tensors`` holds, for every
        state tensor of a piece's parameter saved in ``metadata``, the piece's elements under
        ``{name}/{key}[{start}:{stop}]`` or the whole tensor under ``{name}/{key}``; the
        groups' hyperparameters come from ``metadata`` (``optimizer_state_by_name``'s).

        Raises:
            CheckpointError: a tensor is missing, or a parameter has no hyperparameters.
        """
        names = {id(param): name for name, param in named_params}
        for group, params in zip(self.inner.param_groups, self._groups, strict=True):
            restore_hyperparameters(group, [names[id(p)] for p in params], metadata)
        self.inner.state.clear()
        self.missing = False
        for piece in (piece for mine in self._pieces for piece in mine):
            name = names[id(piece.param)]
            entry = metadata["state"].get(name)
            if not entry:
                continue
            state: dict[str, Any] = dict(entry["values"])
            for key in entry["tensors"]:
                ranged = piece_key(f"{name}/{key}", piece.start, piece.stop)
                value = tensors.get(ranged, tensors.get(f"{name}/{key}"))
                if value is None:
                    raise CheckpointError(f"optimizer tensor {name}/{key} is missing")
                if ranged not in tensors:  # whole: a step count, or a whole state's
                    value = self._piece_of(piece, key, value)
                state[key] = value.to(device=piece.tensor.device, copy=True)
            self.inner.state[piece.tensor] = state

    # ------------------------------------------------------------------ the whole state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups with the module's parameters in them."""
        return [
            {**group, "params": params}
            for group, params in zip(self.inner.param_groups, self._groups, strict=True)
        ]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Every parameter's whole state (gathered: collective)."""
        whole = self._gather_state()
        params = [p for params in self._groups for p in params]
        return {params[i]: entry for i, entry in whole.items()}

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's ``state_dict``, as the unsharded optimizer gives it
        (gathered from every worker: each calls it alike)."""
        return {"state": self._gather_state(), "param_groups": self._saved_groups()}

    def _saved_groups(self) -> list[dict[str, Any]]:
        """The param groups as ``state_dict`` saves them: hyperparameters, and the indices
        of their parameters, numbered across the groups."""
        groups, index = [], 0
        for group, params in zip(self.inner.param_groups, self._groups, strict=True):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": list(range(index, index + len(params)))})
            index += len(params)
        return groups

    def _own_shards(self) -> tuple[dict[str, Any], dict[str, list[torch.Tensor]]]:
        """This rank's shard of each bucket's elementwise optimizer state, by state key, laid
        out as the bucket's parameters (its pieces' values written in, the padding zero); and
        the other state values (the step count), every piece's alike. Empty before the
        first step."""
        rank, size = self.collective.rank, self.collective.world_size
        mine = [(piece, self.inner.state.get(piece.tensor)) for g in self._pieces for piece in g]
        first = next((entry for _, entry in mine if entry), None)
        if first is None:  # no step yet: every worker alike
            return {}, {}
        keys = sorted(k for k, v in first.items() if _elementwise(k, v))
        shards = {
            key: [
                torch.zeros(numel // size, dtype=first[key].dtype, device=first[key].device)
                for _, numel in self._buckets
            ]
            for key in keys
        }
        for piece, entry in mine:
            if not entry:
                continue
            index, offset = self._layout[id(piece.param)]
            at = offset + piece.start - rank * (self._buckets[index][1] // size)
            for key in keys:
                shards[key][index][at : at + piece.stop - piece.start].copy_(entry[key])
        return {k: v for k, v in first.items() if k not in keys}, shards

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's pieces of a whole optimizer's ``state_dict``."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self._groups):
            raise ValueError(
                f"the state holds {len(saved_groups)} param groups, the optimizer "
                f"{len(self._groups)}"
            )
        for group, saved in zip(self.inner.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.inner.state.clear()
        self.missing = False
        for saved, mine, params in zip(saved_groups, self._pieces, self._groups, strict=True):
            ids = {id(p): i for p, i in zip(params, saved["params"], strict=True)}
            for piece in mine:
                entry = state_dict["state"].get(ids[id(piece.param)])
                if entry:
                    self.inner.state[piece.tensor] = {
                        key: self._piece_of(piece, key, value) for key, value in entry.items()
                    }

    def _piece_of(self, piece: _Piece, key: str, value: Any) -> Any:
        """This piece's part of a parameter's state ``value``: a slice of an elementwise
        state (the parameter's shape), the rest (the step count) whole."""
        if not isinstance(value, torch.Tensor):
            return value
        if key != "step" and value.shape == piece.param.shape:
            value = value.reshape(-1)[piece.start : piece.stop]
        return value.to(device=piece.tensor.device, copy=True)

    def commit_state(self, step: int, names: Mapping[int, list[str]]) -> dict[str, Any]:
        """What an in-memory commit keeps of the sharded state (collective: every worker
        alike): this rank's shard of each bucket's optimizer state (under ZeRO-3 of its
        weights too, as ``param``) and a copy of the next rank's (``replica``), so that a
        lost worker's shard lives on in its neighbour's commit; with the layout they were
        cut by, which ``engine.sharded_commit.assemble`` rebuilds the whole state from.
        ``names``: the ``state_dict`` names of each parameter, by ``id``.

        Each state tensor's shards are all-gathered one bucket at a time (the next rank's is
        kept): a commit holds two shards, never the whole."""
        rank, size = self.collective.rank, self.collective.world_size
        others, flats = self._own_shards()
        if self.parameters is not None:
            flats["param"] = list(self.parameters.shards)
        replica: dict[str, list[torch.Tensor]] = {key: [] for key in flats}
        for index in range(len(self._buckets)):
            works = []
            for key, shards in flats.items():
                shard = shards[index]
                out = torch.empty(shard.numel() * size, dtype=shard.dtype, device=shard.device)
                works.append((key, out, self.collective.all_gather_into_async_(shard, out=out)))
            for key, out, work in works:
                work.wait()
                replica[key].append(shard_of(out, (rank + 1) % size, size).clone())
        params = [p for group in self._groups for p in group]
        return {
            "size": size,
            "rank": rank,
            "step": step,
            "held": True,
            "numels": [numel for _, numel in self._buckets],
            "dtypes": {
                key: str(shards[0].dtype).removeprefix("torch.")
                for key, shards in flats.items()
                if shards
            },
            "states": [
                (i, *self._layout[id(p)], list(p.shape))
                for i, p in enumerate(params)
                if id(p) in self._layout
            ],
            "weights": [  # named under ZeRO-3 only
                (name, *self._layout[id(p)], list(p.shape))
                for params_of, _ in self._buckets
                for p in params_of
                for name in names.get(id(p), [])
            ],
            "others": {k: _copied(v) for k, v in others.items()},
            "groups": self._saved_groups(),
            "own": flats,
            "replica": replica,
        }

    def holds(self, commit: Mapping[str, Any]) -> bool:
        """Whether this rank kept its own shards of ``commit`` as this layout cuts them (the
        same rank of as many workers): :meth:`restore_own` then needs no other worker."""
        return (
            commit["held"]
            and commit["size"] == self.collective.world_size
            and commit["rank"] == self.collective.rank
            and commit["numels"] == [numel for _, numel in self._buckets]
        )

    def restore_own(self, commit: Mapping[str, Any]) -> None:
        """Take this rank's shard of the state (under ZeRO-3 of the weights too) from the
        shards it kept in ``commit`` (:meth:`holds`); nothing is gathered."""
        rank, size = self.collective.rank, self.collective.world_size
        for group, saved in zip(self.inner.param_groups, commit["groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.inner.state.clear()
        self.missing = False
        keys = [key for key in commit["own"] if key != "param"]
        for piece in (piece for mine in self._pieces for piece in mine) if keys else ():
            index, offset = self._layout[id(piece.param)]
            at = offset + piece.start - rank * (self._buckets[index][1] // size)
            device = piece.tensor.device
            entry = {
                k: v.to(device=device, copy=True) if isinstance(v, torch.Tensor) else v
                for k, v in commit["others"].items()
            }
            for key in keys:
                kept = commit["own"][key][index][at : at + piece.stop - piece.start]
                entry[key] = kept.to(device=device, copy=True)
            self.inner.state[piece.tensor] = entry
        if self.parameters is not None:
            self.parameters.restore(commit["own"]["param"])

    def _gather_state(self) -> dict[int, dict[str, Any]]:
        """The whole state by parameter index: each elementwise state's shards all-gathered
        into flat buffers laid out as the parameters' (collective); the others (the step
        count) are every piece's alike."""
        size = self.collective.world_size
        others, shards = self._own_shards()
        if not others and not shards:  # no step yet: every worker alike
            return {}
        whole: dict[str, list[torch.Tensor]] = {}
        for key, mine in shards.items():
            whole[key] = [
                torch.empty(shard.numel() * size, dtype=shard.dtype, device=shard.device)
                for shard in mine
            ]
            works = [
                self.collective.all_gather_into_async_(shard, out=out)
                for shard, out in zip(mine, whole[key], strict=True)
            ]
            for work in works:
                work.wait()
        state: dict[int, dict[str, Any]] = {}
        params = [p for group in self._groups for p in group]
        for i, param in enumerate(params):
            if id(param) not in self._layout:
                continue
            index, offset = self._layout[id(param)]
            entry = {k: _copied(v) for k, v in others.items()}
            for key, flats in whole.items():
                entry[key] = flats[index][offset : offset + param.numel()].view_as(param).clone()
            state[i] = entry
        return state


@dataclass(frozen=True)
class _NormPlan:
    """Where one bucket's gradient norms come from (:meth:`ShardedOptimizer.whole_norm`):
    each rank sends the norms of the parameters it holds whole (``whole[r]``), then its
    pieces of those cut by a shard's edge (``cut[r]``: the parameter and its elements'
    place in the bucket), ``length`` elements in all, padded."""

    whole: list[list[torch.Tensor]]
    cut: list[list[tuple[torch.Tensor, int, int]]]
    order: list[torch.Tensor]
    length: int


def _plan_norms(
    params: list[torch.Tensor],
    numel: int,
    layout: dict[int, tuple[int, int]],
    groups: list[list[torch.Tensor]],
    size: int,
) -> _NormPlan:
    stepped = {id(p) for params in groups for p in params}
    shard = numel // size
    whole: list[list[torch.Tensor]] = [[] for _ in range(size)]
    cut: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in range(size)]
    order = []
    for param in params:
        offset, n = layout[id(param)][1], param.numel()
        if id(param) not in stepped or not n:
            continue
        order.append(param)
        first, last = offset // shard, (offset + n - 1) // shard
        if first == last:
            whole[first].append(param)
            continue
        for r in range(first, last + 1):
            cut[r].append((param, max(offset, r * shard), min(offset + n, (r + 1) * shard)))
    length = max(
        len(w) + sum(high - low for _, low, high in c) for w, c in zip(whole, cut, strict=True)
    )
    return _NormPlan(whole, cut, order, length)


def _ranks_without_pieces(shards: list[tuple[Any, int, Any]], owner: dict, size: int) -> list[int]:
    """The ranks whose shard of every bucket holds only padding (or parameters no optimizer
    group steps): each worker computes the same from the same layout."""
    holding: set[int] = set()
    for params, numel, _ in shards:
        shard = numel // size
        offset = 0
        for param in params:
            n = param.numel()
            if id(param) in owner and n:
                holding.update(range(offset // shard, min(size, -(-(offset + n) // shard))))
            offset += n
    return [rank for rank in range(size) if rank not in holding]


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _elementwise(key: str, value: Any) -> bool:
    """Whether a piece's state tensor ``key`` holds one value per element of the piece (as
    :meth:`ShardedOptimizer._gather_state` takes it), not one for the whole parameter."""
    return isinstance(value, torch.Tensor) and key != "step" and value.dim() == 1


@dataclass
class _Whole:
    """What ``optimizer_state_by_name`` reads of an optimizer: the module's parameters in
    their groups, with the state of this rank's piece of each."""

    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, dict[str, Any]]
