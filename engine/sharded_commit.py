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
from typing import Any

import torch

from ringflow.engine.collective import Collective
from ringflow.engine.errors import EngineError

__all__ = ["assemble", "handed"]


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
