"""Training state keyed by full parameter name, so checkpoints load into another layout.

torch optimizers key their state by the position of a parameter in their own parameter list,
which means nothing once the model is split differently (and collides across pipeline
stages, where every stage's optimizer starts at 0). Here every tensor is keyed by the full
name of its parameter in the whole model:

- ``model/{name}``: a parameter or buffer of the module;
- ``optim/{name}/{state}``: a tensor of the optimizer state of that parameter (``exp_avg``);

and the rest of the optimizer state (hyperparameters, non-tensor state) goes to JSON,
also keyed by parameter name. Loading is bitwise exact.

Layouts:

- data parallel with W ranks: the replicated state (model and optimizer, identical on every
  rank) is written once, by rank 0, as shard ``replicated``; each rank adds its own shard
  ``rank-{r:05d}`` (RNG state, sampler position). Any number W' of ranks loads the
  replicated shard; a new rank r' < W also gets rank r's own shard.
- pipeline with P stages: shard ``stage-{s:05d}`` holds the state of the parameters stage s
  owns, under their full names. A new stage of any P' takes, from whichever old stages hold
  them, exactly the names it owns.
- sharded data parallel (ZeRO) with W ranks: rank r writes shard ``zero-{r:05d}``, its own
  pieces of the state and nothing gathered. A piece is the elements ``[start, stop)`` of a
  tensor flattened, named ``{key}[{start}:{stop}]`` (``model/fc.weight[0:120]``,
  ``optim/fc.weight/exp_avg[0:120]``): a parameter cut by the edge of a rank's shard gives a
  piece to each side. Tensors that are not cut (buffers, a step count) keep their plain key,
  written by one rank. The manifest's metadata ``pieces`` records each cut parameter's shape
  and the other names a parameter has in the module's ``state_dict`` (tied weights). Any
  number of ranks, sharded or not, assembles what it needs by name and range
  (:func:`read_pieces`), reading only the shards that hold some of it;
  :func:`load_data_parallel` assembles the whole state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ringflow.storage.checkpoint import CheckpointError
from ringflow.storage.store import CheckpointStore, CommittedCheckpoint
from ringflow.storage.tensorfile import dtype_of

__all__ = [
    "REPLICATED",
    "RankState",
    "data_parallel_shards",
    "is_sharded",
    "load_data_parallel",
    "load_optimizer_state_by_name",
    "load_pipeline_stage",
    "load_training_state",
    "load_whole",
    "merge_optimizer_metadata",
    "merge_sharded_optimizer_metadata",
    "optimizer_state_by_name",
    "piece_key",
    "pieced_keys",
    "pipeline_shards",
    "rank_shard",
    "read_pieces",
    "restore_hyperparameters",
    "split_piece_key",
    "stage_shard",
    "training_state",
    "zero_shard",
]

REPLICATED = "replicated"
"""Name of the shard holding the state every data-parallel rank shares."""
_FORMAT = "ringflow.optimizer/1"


def rank_shard(rank: int) -> str:
    """Name of the shard holding data-parallel rank ``rank``'s own state."""
    return f"rank-{rank:05d}"


def stage_shard(stage: int) -> str:
    """Name of the shard holding pipeline stage ``stage``'s state."""
    return f"stage-{stage:05d}"


ZERO = "zero-"
"""The names of a sharded data-parallel checkpoint's shards start so: ``zero-{rank:05d}``."""


def zero_shard(rank: int) -> str:
    """Name of the shard sharded data-parallel rank ``rank`` writes: its pieces of the state."""
    return f"{ZERO}{rank:05d}"


# ---------------------------------------------------------------------------- optimizer


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    named_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer``'s state into tensors and JSON, both keyed by parameter name.

    The tensors alias the optimizer's state (copy them if they must not change; the store
    and :class:`~storage.checkpointer.AsyncCheckpointer` copy on save).

    Args:
        optimizer: any torch optimizer.
        named_params: ``module.named_parameters()`` of the whole model, or a mapping of full
            names to the parameters the optimizer holds.

    Returns:
        ``({"{name}/{state key}": tensor}, metadata)``. The JSON metadata lists each
        parameter group's hyperparameters with the names of its parameters, and each
        parameter's state keys, with the values of those that are not tensors.

    Raises:
        ValueError: the optimizer holds a parameter ``named_params`` does not name, a
            hyperparameter is a tensor, or a state value is neither a tensor nor a number
            (LBFGS keeps lists of tensors).
    """
    names = _names_by_id(named_params)
    tensors: dict[str, torch.Tensor] = {}
    groups: list[dict[str, Any]] = []
    state: dict[str, Any] = {}
    states = optimizer.state  # read once: a composite of several optimizers builds it
    for group in optimizer.param_groups:
        hyper = {key: _hyper_json(key, value) for key, value in group.items() if key != "params"}
        group_names = [_name_of(names, param) for param in group["params"]]
        groups.append({"hyper": hyper, "params": group_names})
        for name, param in zip(group_names, group["params"], strict=True):
            entries = states.get(param)
            if entries:
                state[name] = _split_state(name, entries, tensors)
    metadata = {"format": _FORMAT, "optimizer": type(optimizer).__name__}
    return tensors, {**metadata, "groups": groups, "state": state}


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    named_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
) -> None:
    """Load state saved by :func:`optimizer_state_by_name` into ``optimizer``, by name.

    ``tensors`` and ``metadata`` may hold more parameters than ``optimizer`` (another
    pipeline stage's); only the names the optimizer holds are taken.

    Raises:
        CheckpointError: a parameter of ``optimizer`` has no saved state, or parameters of
            one group were saved with different hyperparameters.
    """
    if metadata.get("format") != _FORMAT:
        raise CheckpointError(
            f"optimizer metadata has format {metadata.get('format')!r}, expected {_FORMAT!r}"
        )
    names = _names_by_id(named_params)
    hyper_of = {name: g["hyper"] for g in metadata["groups"] for name in g["params"]}
    state_dict = optimizer.state_dict()  # the target's own numeric ids and group layout
    state: dict[int, dict[str, Any]] = {}
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
        group_names = [_name_of(names, param) for param in group["params"]]
        _restore_hyperparameters(saved_group, group_names, hyper_of)
        for name, index in zip(group_names, saved_group["params"], strict=True):
            if name in metadata["state"]:
                state[index] = _joined_state(name, metadata["state"][name], tensors)
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)


def merge_optimizer_metadata(metadatas: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the metadata of several optimizers (one per pipeline stage) into one.

    Raises:
        ValueError: two of them hold the same parameter.
    """
    merged: dict[str, Any] = {"format": _FORMAT, "groups": [], "state": {}}
    seen: set[str] = set()
    for metadata in metadatas:
        names = {name for group in metadata["groups"] for name in group["params"]}
        if names & seen:
            raise ValueError(f"parameters {sorted(names & seen)} appear in more than one optimizer")
        seen |= names
        merged["groups"] += metadata["groups"]
        merged["state"].update(metadata["state"])
        merged.setdefault("optimizer", metadata.get("optimizer"))
    return merged


def _split_state(
    name: str, entries: Mapping[str, Any], tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Put a parameter's tensor state into ``tensors``; return its JSON entry."""
    keys, values = [], {}
    for key, value in entries.items():
        if isinstance(value, torch.Tensor):
            tensors[f"{name}/{key}"] = value
            keys.append(key)
        else:
            values[key] = _state_json(name, key, value)
    return {"tensors": keys, "values": values}


def _joined_state(
    name: str, entry: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    try:
        joined = {key: tensors[f"{name}/{key}"] for key in entry["tensors"]}
    except KeyError as err:
        raise CheckpointError(f"optimizer tensor {name}/{err.args[0]} is missing") from err
    return {**joined, **entry["values"]}


def restore_hyperparameters(
    group: dict[str, Any], names: Sequence[str], metadata: Mapping[str, Any]
) -> None:
    """Set the hyperparameters of an optimizer's param ``group`` whose parameters are
    ``names`` to those :func:`optimizer_state_by_name` saved for them in ``metadata``.

    Raises:
        CheckpointError: a name has none saved, or they were saved in different groups
            with different hyperparameters.
    """
    hyper_of = {name: g["hyper"] for g in metadata["groups"] for name in g["params"]}
    _restore_hyperparameters(group, list(names), hyper_of)


def _restore_hyperparameters(
    saved_group: dict[str, Any], names: list[str], hyper_of: Mapping[str, Any]
) -> None:
    missing = [name for name in names if name not in hyper_of]
    if missing:
        raise CheckpointError(f"the checkpoint has no optimizer state for parameters {missing}")
    hyper = hyper_of[names[0]] if names else {}
    differing = [name for name in names if hyper_of[name] != hyper]
    if differing:
        raise CheckpointError(
            f"parameters {[names[0], *differing]} share an optimizer group now but were saved "
            "with different hyperparameters; split them into groups as when saved"
        )
    for key, value in hyper.items():
        current = saved_group.get(key)
        # JSON has no tuples; give back the type the optimizer uses (Adam's betas).
        saved_group[key] = tuple(value) if isinstance(current, tuple) else value


def _state_json(name: str, key: str, value: Any) -> Any:
    if value is not None and not isinstance(value, bool | int | float | str):
        raise ValueError(
            f"optimizer state {name}/{key} is a {type(value).__name__}; only tensors and "
            "plain numbers can be saved by name"
        )
    return value


def _hyper_json(key: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        raise ValueError(f"optimizer hyperparameter {key!r} is a tensor; use a number")
    return list(value) if isinstance(value, tuple) else value


def _names_by_id(
    named_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> dict[int, str]:
    pairs = named_params.items() if isinstance(named_params, Mapping) else named_params
    return {id(param): name for name, param in pairs}


def _name_of(names: Mapping[int, str], param: torch.Tensor) -> str:
    try:
        return names[id(param)]
    except KeyError as err:
        raise ValueError(
            f"the optimizer holds a parameter of shape {tuple(param.shape)} that named_params "
            "does not name; pass the whole model's named_parameters()"
        ) from err


# ---------------------------------------------------------------------------- module + optimizer


def training_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The module's state and its optimizer's as ``model/...`` and ``optim/...`` tensors.

    For a pipeline stage, ``module`` must name its parameters as in the whole model (keep
    the full model's structure and replace the layers the stage does not own by
    ``nn.Identity``, as torchtitan does).

    Returns:
        ``(tensors, optimizer metadata)``; the metadata is ``{}`` without an optimizer.
    """
    tensors = {f"model/{name}": value for name, value in module.state_dict().items()}
    if optimizer is None:
        return tensors, {}
    optim, metadata = optimizer_state_by_name(optimizer, module.named_parameters())
    tensors.update({f"optim/{key}": value for key, value in optim.items()})
    return tensors, metadata


def load_training_state(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
) -> None:
    """Load what :func:`training_state` produced (possibly merged from several shards).

    Raises:
        CheckpointError: a tensor of ``module`` or state of ``optimizer`` is missing.
    """
    model = {key[6:]: value for key, value in tensors.items() if key.startswith("model/")}
    missing = sorted(set(module.state_dict()) - set(model))
    if missing:
        raise CheckpointError(f"the checkpoint lacks module tensors {missing}")
    wanted = {name: model[name] for name in module.state_dict()}
    module.load_state_dict(wanted, strict=True)
    if optimizer is not None:
        optim = {key[6:]: value for key, value in tensors.items() if key.startswith("optim/")}
        load_optimizer_state_by_name(optimizer, module.named_parameters(), optim, metadata)


# ---------------------------------------------------------------------------- layouts


@dataclass(frozen=True, kw_only=True)
class RankState:
    """What one data-parallel rank loads from a checkpoint."""

    replicated: dict[str, torch.Tensor]
    """The state all ranks share (model and optimizer)."""
    own: dict[str, torch.Tensor] | None
    """This rank's own state from the old run, or ``None`` for a rank the old run lacked
    (seed it afresh)."""
    saved_world_size: int
    """How many ranks wrote the checkpoint."""


def data_parallel_shards(
    replicated: Mapping[str, torch.Tensor], per_rank: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Shards of a data-parallel checkpoint: the replicated state once, each rank's own."""
    shards = {REPLICATED: dict(replicated)}
    shards.update({rank_shard(rank): dict(own) for rank, own in enumerate(per_rank)})
    return shards


def load_data_parallel(
    store: CheckpointStore, checkpoint: CommittedCheckpoint, *, rank: int, world_size: int
) -> RankState:
    """Load what rank ``rank`` of ``world_size`` needs, whatever world size wrote it; a
    sharded checkpoint (``zero-*`` shards) gives the whole state, assembled from its pieces.

    Raises:
        ValueError: ``rank`` is not below ``world_size``.
        CheckpointError: the checkpoint has no replicated shard.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if is_sharded(checkpoint):  # every rank's pieces, assembled whole
        own_shard = rank_shard(rank) if rank_shard(rank) in checkpoint.shards else None
        own = None if own_shard is None else store.load(checkpoint, shards=[own_shard])
        return RankState(
            replicated=load_whole(store, checkpoint),
            own=None if own is None else own.shards[own_shard],
            saved_world_size=sum(1 for name in checkpoint.shards if name.startswith(ZERO)),
        )
    saved = sum(1 for name in checkpoint.shards if name.startswith("rank-"))
    names = [REPLICATED] + ([rank_shard(rank)] if rank_shard(rank) in checkpoint.shards else [])
    loaded = store.load(checkpoint, shards=names)
    own = loaded.shards.get(rank_shard(rank))
    return RankState(replicated=loaded.shards[REPLICATED], own=own, saved_world_size=saved)


def pipeline_shards(
    stages: Sequence[Mapping[str, torch.Tensor]],
) -> dict[str, dict[str, torch.Tensor]]:
    """Shards of a pipeline checkpoint: one per stage, tensors under their full names."""
    return {stage_shard(stage): dict(tensors) for stage, tensors in enumerate(stages)}


def load_pipeline_stage(
    store: CheckpointStore, checkpoint: CommittedCheckpoint, *, names: Collection[str]
) -> dict[str, torch.Tensor]:
    """The ``model/`` and ``optim/`` tensors of the module tensors ``names``, from any stages.

    Reads only the stage shards that hold one of ``names`` (the manifest lists every shard's
    tensors).

    Args:
        store: the store holding ``checkpoint``.
        checkpoint: a checkpoint written with :func:`pipeline_shards`.
        names: full names of the parameters and buffers the new stage owns, e.g.
            ``stage_module.state_dict().keys()``.

    Raises:
        CheckpointError: a name is in no stage, or two stages disagree on a tensor.
    """
    wanted = set(names)
    needed = [
        shard
        for shard, record in checkpoint.shards.items()
        if shard.startswith("stage-") and any(_owner(key) in wanted for key in record.tensors)
    ]
    merged: dict[str, torch.Tensor] = {}
    for shard, tensors in store.load(checkpoint, shards=needed).shards.items():
        for key, tensor in tensors.items():
            if _owner(key) not in wanted:
                continue
            if key in merged and not torch.equal(merged[key], tensor):
                raise CheckpointError(f"{checkpoint.url}: stages disagree on {key} ({shard})")
            merged[key] = tensor
    missing = sorted(wanted - {key[6:] for key in merged if key.startswith("model/")})
    if missing:
        raise CheckpointError(f"{checkpoint.url}: no stage holds {missing}")
    return merged


def _owner(key: str) -> str:
    """The module tensor a ``model/{name}`` or ``optim/{name}/{state}`` key belongs to."""
    kind, _, rest = key.partition("/")
    return rest.rsplit("/", 1)[0] if kind == "optim" else rest


# ---------------------------------------------------------------------------- sharded (ZeRO)

_PIECE = re.compile(r"^(.+)\[(\d+):(\d+)\]$")


def piece_key(key: str, start: int, stop: int) -> str:
    """The name of elements ``[start, stop)`` of tensor ``key`` flattened, in a shard."""
    return f"{key}[{start}:{stop}]"


def split_piece_key(name: str) -> tuple[str, int | None, int | None]:
    """``(key, start, stop)`` of a :func:`piece_key`; ``(name, None, None)`` for a whole one."""
    match = _PIECE.match(name)
    if match is None:
        return name, None, None
    return match.group(1), int(match.group(2)), int(match.group(3))


def is_sharded(checkpoint: CommittedCheckpoint) -> bool:
    """Whether sharded data-parallel ranks wrote ``checkpoint`` (``zero-*`` shards)."""
    return any(name.startswith(ZERO) for name in checkpoint.shards)


def pieced_keys(checkpoint: CommittedCheckpoint) -> set[str]:
    """The tensors a sharded ``checkpoint`` holds in pieces (the others are whole)."""
    return {key for key, stored in _stored(checkpoint).items() if stored.pieced}


def merge_sharded_optimizer_metadata(metadatas: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge what each sharded rank's :func:`optimizer_state_by_name` saw into the whole
    optimizer's metadata: the same groups everywhere, and each parameter's state entry from
    the ranks holding a piece of it.

    Raises:
        ValueError: the ranks disagree on the groups or on a parameter's entry.
    """
    metadatas = list(metadatas)
    if not metadatas:
        raise ValueError("no metadata to merge")
    merged = {**metadatas[0], "state": {}}
    for metadata in metadatas:
        if metadata["groups"] != merged["groups"]:
            raise ValueError("sharded ranks saved different optimizer param groups")
        for name, entry in metadata["state"].items():
            if merged["state"].setdefault(name, entry) != entry:
                raise ValueError(f"sharded ranks saved different optimizer state for {name}")
    return merged


def read_pieces(
    store: CheckpointStore,
    checkpoint: CommittedCheckpoint,
    wanted: Mapping[str, Sequence[tuple[int, int]] | None],
) -> dict[str, torch.Tensor]:
    """Assemble tensors of a sharded checkpoint by name and element range.

    Reads the shards that hold some of what is wanted, one at a time, and copies the parts
    of their pieces that fall in each wanted range; every returned tensor is storage of its
    own (nothing views a shard's buffer).

    Args:
        wanted: ``{key: ranges}``: ``None`` for the whole tensor (its shape), else a list of
            ``(start, stop)`` element ranges of it flattened.

    Returns:
        ``{key: tensor}`` for the whole ones, ``{piece_key(key, start, stop): flat tensor}``
        for the ranges.

    Raises:
        CheckpointError: a key is not in the checkpoint, or its pieces leave part of a
            wanted range uncovered (a shard missing) or cover it twice.
    """
    stored = _stored(checkpoint)
    targets = _targets(checkpoint, stored, wanted)
    shards = sorted(
        {
            piece.shard
            for target in targets
            for piece in stored[target.key].pieces
            if piece.start < target.stop and target.start < piece.stop
        }
    )
    out: dict[_Target, torch.Tensor] = {}
    filled: dict[_Target, int] = dict.fromkeys(targets, 0)
    for shard in shards:
        tensors = store.load(checkpoint, shards=[shard]).shards[shard]
        for target in targets:
            for piece in stored[target.key].pieces:
                if piece.shard == shard:
                    filled[target] += _copy_overlap(target, piece, tensors[piece.name], out)
        del tensors
    result: dict[str, torch.Tensor] = {}
    for target in targets:
        if filled[target] != target.stop - target.start:
            raise CheckpointError(
                f"{checkpoint.url}: the pieces of {target.key} cover {filled[target]} of its "
                f"elements [{target.start}:{target.stop}); its shards are "
                f"{sorted(checkpoint.shards)}"
            )
        tensor = out.get(target, torch.empty(0, dtype=stored[target.key].dtype))
        if target.whole:
            result[target.key] = tensor.reshape(stored[target.key].shape)
        else:
            result[piece_key(target.key, target.start, target.stop)] = tensor
    return result


def _targets(
    checkpoint: CommittedCheckpoint,
    stored: Mapping[str, _Stored],
    wanted: Mapping[str, Sequence[tuple[int, int]] | None],
) -> list[_Target]:
    targets: list[_Target] = []
    for key, ranges in wanted.items():
        if key not in stored:
            raise CheckpointError(f"{checkpoint.url} holds no {key}")
        whole = ranges is None
        for start, stop in [(0, stored[key].numel)] if whole else ranges:
            if not 0 <= start <= stop <= stored[key].numel:
                raise ValueError(f"{key} has {stored[key].numel} elements, not [{start}:{stop})")
            targets.append(_Target(key, start, stop, whole))
    return targets


def _copy_overlap(
    target: _Target, piece: _Piece, source: torch.Tensor, out: dict[_Target, torch.Tensor]
) -> int:
    """Copy what of ``piece`` (its values ``source``) falls in ``target``; how many."""
    low, high = max(piece.start, target.start), min(piece.stop, target.stop)
    if low >= high:
        return 0
    source = source.reshape(-1)
    if target not in out:
        out[target] = torch.empty(target.stop - target.start, dtype=source.dtype)
    out[target][low - target.start : high - target.start].copy_(
        source[low - piece.start : high - piece.start]
    )
    return high - low


def load_whole(store: CheckpointStore, checkpoint: CommittedCheckpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint whole, under the names :func:`training_state`
    gives them (the other names of tied parameters included): what
    :func:`load_training_state` takes."""
    whole = read_pieces(store, checkpoint, dict.fromkeys(_stored(checkpoint)))
    aliases = checkpoint.metadata.get("pieces", {}).get("aliases", {})
    whole.update({f"model/{alias}": whole[f"model/{name}"] for alias, name in aliases.items()})
    return whole


@dataclass(frozen=True)
class _Target:
    key: str
    start: int
    stop: int
    whole: bool


@dataclass(frozen=True)
class _Piece:
    shard: str
    name: str
    start: int
    stop: int


@dataclass
class _Stored:
    """A tensor of a sharded checkpoint: its shape and where its pieces are."""

    shape: list[int]
    dtype: torch.dtype
    pieces: list[_Piece]
    pieced: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _stored(checkpoint: CommittedCheckpoint) -> dict[str, _Stored]:
    """Each tensor of the ``zero-*`` shards by key, from the manifest alone."""
    shapes = checkpoint.metadata.get("pieces", {}).get("shapes", {})
    stored: dict[str, _Stored] = {}
    for shard, record in sorted(checkpoint.shards.items()):
        if not shard.startswith(ZERO):
            continue
        for name, (code, shape) in record.tensors.items():
            key, start, stop = split_piece_key(name)
            if start is None:
                start, stop = 0, math.prod(shape)
                entry = stored.setdefault(key, _Stored(list(shape), dtype_of(code), [], False))
            else:
                owner = _owner(key)
                if owner not in shapes:
                    raise CheckpointError(
                        f"{checkpoint.url}: {shard} holds a piece of {key}, whose shape its "
                        "manifest does not record"
                    )
                shape = shapes[owner]
                entry = stored.setdefault(key, _Stored(list(shape), dtype_of(code), [], True))
            if entry.pieced != (name != key):
                raise CheckpointError(f"{checkpoint.url}: {key} is held both whole and in pieces")
            entry.pieces.append(_Piece(shard, name, start, stop))
    return stored
