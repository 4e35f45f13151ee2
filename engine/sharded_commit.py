"""The sharded state of an in-memory commit, whole again.

Under ``TrainConfig.shard`` a commit keeps, of the sharded state, each worker's own shard of
every bucket's optimizer state (under ZeRO-3 of its weights too) and a copy of the next
worker's (``ShardedOptimizer.commit_state``): two shards of it per worker, never the whole.
When the members change (a worker lost, a replacement joining) every member calls
:func:`assemble` alike: each old shard comes from the member that kept it, its own or as the
copy of its neighbour's, and every member ends with the whole state, from which it takes its
pieces of the new layout. Nothing is read from storage; a shard that no member kept (a worker
and the neighbour holding its copy both lost) fails the rollback in one line.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any

import torch

from ringflow.engine.collective import Collective, GradientBuckets
from ringflow.engine.errors import EngineError

if TYPE_CHECKING:
    from ringflow.engine.sharded_parameters import ShardedParameters
    from ringflow.engine.sharding import ShardedOptimizer
    from ringflow.engine.worker import Worker

__all__ = ["ShardedCommits", "assemble", "handed"]


def handed(commit: dict[str, Any]) -> dict[str, Any]:
    """``commit`` as a replacement worker takes it: the layout, none of the shards (it gets
    its pieces from the members' commits once it is in their ring, :func:`assemble`)."""
    return {**commit, "held": False, "own": {}, "replica": {}}


def assemble(
    commit: dict[str, Any], collective: Collective, device: torch.device
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The whole optimizer ``state_dict`` (as ``shard="none"`` gives it) and, under ZeRO-3,
    the whole weights by ``state_dict`` name, from the members' commits of one step
    (collective: every member calls it alike, with its commit or :func:`handed`'s).

    Raises:
        EngineError: an old worker's shard is kept by no member, or the members' commits
            are of different layouts.
    """
    size, members = commit["size"], collective.world_size
    mine = torch.tensor(
        [int(commit["held"]), size, commit["rank"]], dtype=torch.int64, device=device
    )
    table = [tuple(int(v) for v in row.tolist()) for row in collective.all_gather(mine)]
    if any(held and old_size != size for held, old_size, _ in table):
        raise EngineError("the workers' commits were cut for different numbers of workers")
    source: dict[int, tuple[int, int]] = {}
    for slot in (0, 1):  # a shard's owner first, then the neighbour holding its copy
        for member, (held, _, rank) in enumerate(table):
            old = rank if slot == 0 else (rank + 1) % size
            if held and old not in source:
                source[old] = (member, slot)
    lost = sorted(set(range(size)) - set(source))
    if lost:
        raise EngineError(
            f"the commit's shards of worker {lost[0]} (of {size}) are lost with the workers "
            "that kept them (a worker and the neighbour keeping its copy lost together): the "
            "run cannot go on from memory; a retried run resumes from its last checkpoint"
        )
    wholes: dict[str, list[torch.Tensor]] = {}
    for key, dtype in commit["dtypes"].items():
        wholes[key] = []
        for index, numel in enumerate(commit["numels"]):
            shard = numel // size
            if commit["held"]:
                own, kept = commit["own"][key][index], commit["replica"][key][index]
                block = torch.cat([own.to(device), kept.to(device)])
            else:
                block = torch.zeros(2 * shard, dtype=getattr(torch, dtype), device=device)
            out = torch.empty(2 * shard * members, dtype=block.dtype, device=device)
            collective.all_gather_into_(block, out=out)
            parts = [
                out[(2 * member + slot) * shard : (2 * member + slot + 1) * shard]
                for member, slot in (source[old] for old in range(size))
            ]
            wholes[key].append(torch.cat(parts))
    state: dict[int, dict[str, Any]] = {}
    keys = [key for key in wholes if key != "param"]
    if keys:
        for index, bucket, offset, shape in commit["states"]:
            entry = copy.deepcopy(commit["others"])
            numel = math.prod(shape)
            for key in keys:
                entry[key] = wholes[key][bucket][offset : offset + numel].view(shape).clone()
            state[index] = entry
    weights = {
        name: wholes["param"][bucket][offset : offset + math.prod(shape)].view(shape)
        for name, bucket, offset, shape in commit["weights"]
    }
    return {"state": state, "param_groups": commit["groups"]}, weights


class ShardedCommits:
    """The in-memory commits of a step whose ring shards the optimizer state
    (``TrainConfig.shard``): a data-parallel worker's (``engine.data_parallel``), a pipeline
    stage's over its replicas (``engine.pipeline.step``). The step sets ``worker``,
    ``collective``, ``sharded`` and ``weights`` (ZeRO-3's sharded parameters, else ``None``)."""

    worker: Worker
    collective: Collective | None
    buckets: GradientBuckets | None
    sharded: ShardedOptimizer | None
    weights: ShardedParameters | None

    def leave_ring(self) -> None:
        """Let the ring go: the sharded optimizer gives the optimizer its parameters back
        (the next ring's shards are laid out anew), the buckets and the collective close."""
        if self.sharded is not None:
            self.sharded.release()
            self.worker.optimizer = self.sharded.inner
            self.sharded = None
        if self.buckets is not None:
            self.buckets.close()
            self.buckets = None
        if self.collective is not None:
            self.collective.close()
            self.collective = None

    def lay_out_again(self, carried: list[Any], weights: Any) -> None:
        """After joining a new ring: the optimizer state (under ZeRO-3 the weights too) laid
        out anew. Taken from the commit this worker's state is at (survivors rolled back, a
        replacement adopted), else carried over where this worker keeps its shard (the same
        rank of as many workers: ``carried``, ``weights``); else it is missing until a
        rollback loads it, and a step before that raises ``EngineError``."""
        committed = self.worker.commit_at_state()
        if self._all_at(None if committed is None else committed[1]["step"]):
            self._assemble(*committed[:2])
        else:
            self.sharded.take(carried)
            if self.weights is not None:
                self.weights.take(weights)

    def _all_at(self, step: int | None) -> bool:
        """Whether every member's state is at the commit of the same ``step`` (collective:
        every member asks alike, ``None`` where it is at none)."""
        mine = torch.tensor([-1 if step is None else step], device=self.worker.device)
        points = {int(row.item()) for row in self.collective.all_gather(mine)}
        return step is not None and len(points) == 1

    def _assemble(self, model: dict[str, torch.Tensor], commit: dict[str, Any]) -> None:
        """Take this worker's pieces of the new layout from the whole state the members'
        commits hold between them (:func:`assemble`; collective)."""
        optimizer, weights = assemble(commit, self.collective, self.worker.device)
        if self.weights is not None:
            self.worker.write_model({**model, **weights})
        self.sharded.load_state_dict(optimizer)

    def commit_parts(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a commit of ``step`` copies of a sharded worker (collective: every worker
        alike): of the module's ``state_dict`` what is not sharded (under ZeRO-1/2 all of
        it), and the sharded state's commit (``ShardedOptimizer.commit_state``)."""
        model, names = {}, {}
        bucketed = self.sharded.bucketed if self.weights is not None else frozenset()
        for name, value in self.worker.module.state_dict(keep_vars=True).items():
            if id(value) in bucketed:
                names.setdefault(id(value), []).append(name)
            else:
                model[name] = value.detach()
        return model, self.sharded.commit_state(step, names)

    def restore_commit(
        self, model: dict[str, torch.Tensor], commit: dict[str, Any], *, in_ring: bool
    ) -> None:
        """A rollback's: the state of a sharded commit. This worker's own shards where it
        kept them in this layout (nothing gathered), else the pieces of the new layout from
        what the members kept (collective: where the members changed, every one rolls back
        alike); a replacement not yet ``in_ring`` takes the weights only where they are not
        sharded, and its shards once it is (:meth:`lay_out_again`)."""
        w = self.worker
        if self.sharded is None or not in_ring or not commit["held"]:
            if not commit["weights"]:  # ZeRO-1/2: the whole weights are every worker's
                w.write_model(model)
            if self.sharded is not None:
                self.sharded.missing = True
            return
        if not self.sharded.holds(commit):
            self._assemble(model, commit)  # under ZeRO-3 the whole weights written too
        else:
            self.sharded.restore_own(commit)  # under ZeRO-3 the weights' shards too
            if self.weights is not None:  # the tensors not sharded: buffers, frozen weights
                held = w.module.state_dict(keep_vars=True)
                with torch.no_grad():
                    for name, tensor in model.items():
                        held[name].copy_(tensor)
        if self.weights is None:  # ZeRO-1/2: every worker's weights are whole
            w.write_model(model)
