"""What a training run asks of the engine."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from annotated_types import Ge, Gt, Le

if TYPE_CHECKING:
    import torch

    from ringflow.storage.dataset import TableSchema

__all__ = [
    "LR_SCALINGS",
    "PLACEMENTS",
    "PRECISIONS",
    "STREAM_ABOVE_BYTES",
    "TRANSPORTS",
    "WIRE_FORMATS",
    "DataSpec",
    "SymmConfig",
    "TensorData",
    "TrainConfig",
]

# This module imports neither torch nor the rest of the engine: the flow's command line
# builds and checks a TrainConfig before anything heavy is imported.

Precision = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
"""Precisions as Lightning spells them (``engine.module`` applies them)."""
Compression = Literal["none", "bf16", "fp16"]
WIRE_FORMATS: tuple[str, ...] = get_args(Compression)
"""Wire formats of float32 all-reduces (``engine.collective`` maps each to its dtype)."""
RingTransport = Literal["auto", "shm", "gloo", "nccl", "symm"]
TRANSPORTS: tuple[str, ...] = get_args(RingTransport)
"""How the ring moves data; ``auto`` picks shared memory when every rank shares this host
(``shm`` on CPU, ``symm`` on GPUs, each rank on a GPU of its own), and ``gloo`` or ``nccl``
otherwise."""
Placement = Literal["pack", "spread", "strict_spread"]
ClipAlgorithm = Literal["norm", "value"]
LrScaling = Literal["none", "linear", "sqrt"]
ShardMode = Literal["none", "optimizer", "gradients", "parameters"]
SHARD_MODES: tuple[str, ...] = get_args(ShardMode)
LR_SCALINGS: tuple[str, ...] = get_args(LrScaling)
_SHIPPED_COLLECTIVES = ("ring", "native")
"""Registered by ``engine.collective.ring`` and ``.native``; another name is looked up in
the registry (``engine.collective.register_collective``)."""

STREAM_ABOVE_BYTES = 256 * 2**20
"""``DataSpec(stream=None)`` streams a split whose Parquet shards hold more bytes than this."""

PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict_spread": "STRICT_SPREAD"}
"""``TrainConfig.placement`` to the Ray placement-group strategy."""


@dataclass(frozen=True, kw_only=True)
class SymmConfig:
    """How the ring's ``symm`` transport runs (GPUs of one host writing into each other's
    memory: ``engine.collective._symm`` and its fused kernel, ``engine.collective._fused``).

    The defaults are the fastest measured (docs/benchmarks.md, "All-reduce: our ring
    against the native collective"); no setting changes the sums, only how fast they arrive.
    Each field has an environment variable, ``RINGFLOW_SYMM_`` and the field's name in capitals
    (``RINGFLOW_SYMM_DEPTH=4``), which overrides it in the process where it is set
    (:meth:`with_environment`); a run records the overrides its workers had beside its
    ``TrainConfig``.
    """

    __pydantic_config__ = {"extra": "forbid"}

    graphs: bool = True
    """Record each collective on a tensor as a CUDA graph once and replay it (one launch);
    ``False`` launches every kernel each time (slower below 64 MiB; for debugging)."""
    overlap: bool = True
    """Push one segment over NVLink while the other is added, on two streams; ``False``: one."""
    depth: Annotated[int, Ge(1)] = 2
    """Segments a chunk of the ring is cut into so that pushes and additions overlap (a
    segment is at least 16 MiB: smaller chunks stay whole)."""
    buckets: bool = True
    """Allocate gradient buckets in symmetric memory, so that the fused kernel writes each
    bucket's sums straight into every rank's copy; ``False`` keeps them in ordinary memory."""
    fused_below: Annotated[int, Ge(0)] | None = None
    """All-reduces of fewer bytes than this (float32, bfloat16 or float16, no compression) run
    as one Triton kernel instead of the ring's hops; ``None``: all of them; 0: none (also none
    where Triton is missing)."""
    fused_blocks: Annotated[int, Ge(1), Le(256)] = 64
    """Thread blocks of that kernel at most (never more than the GPU's SMs): fewer leave more
    of the GPU to the backward pass the all-reduces overlap with."""
    piece_mb: Annotated[int, Ge(1)] = 256
    """The largest piece of one all-reduce the kernel takes at once, in MiB (a power of two);
    larger all-reduces run one launch per piece."""
    rounds: Annotated[int, Ge(1), Le(16)] = 4
    """Rounds in which the kernel takes an all-reduce of a tensor the ring did not allocate:
    from 2 on, the copy of one round's sums into the tensor runs beside the next round's
    stores to the other GPUs; 1 takes it whole through each phase in turn."""
    rounds_from_mb: Annotated[int, Ge(0)] = 64
    """Pieces smaller than this many MiB go in one round."""

    def __post_init__(self) -> None:
        for f in fields(self):
            problem = _symm_problem(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"symm.{f.name} {problem}, got {getattr(self, f.name)!r}")

    @staticmethod
    def variable(name: str) -> str:
        """The environment variable that overrides field ``name``."""
        return f"RINGFLOW_SYMM_{name.upper()}"

    def with_environment(self, environ: Mapping[str, str] = os.environ) -> SymmConfig:
        """These settings with every field whose variable ``environ`` sets replaced by it.

        Raises:
            ValueError: a variable's value is not one its field takes; the message names it.
        """
        values = {}
        for f in fields(self):
            text = environ.get(self.variable(f.name))
            if text is None:
                continue
            value: Any = text.strip()
            if f.name in _SYMM_SWITCHES:
                value = {"1": True, "0": False}.get(value, value)
            elif value.isdigit():
                value = int(value)
            problem = _symm_problem(f.name, value)
            if problem:
                raise ValueError(f"{self.variable(f.name)} {problem}, got {text!r}")
            values[f.name] = value
        return replace(self, **values)


_SYMM_SWITCHES = ("graphs", "overlap", "buckets")
_SYMM_RANGES = {"depth": (1, None), "fused_blocks": (1, 256), "rounds": (1, 16)}


def _symm_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for ``SymmConfig``'s field ``name``, or ``None``."""
    if name in _SYMM_SWITCHES:
        return None if isinstance(value, bool) else "must be true or false (1 or 0)"
    if name == "fused_below" and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return "must be a whole number"
    low, high = _SYMM_RANGES.get(name, (0, None))
    if name == "piece_mb" and (value < 1 or value & (value - 1)):
        return "must be a power of two (MiB)"
    if value < low or (high is not None and value > high):
        return f"must be {low} to {high}" if high else f"must be {low} or more"
    return None


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How the engine trains, independent of the model.

    Every field is validated on construction; the error names the field. It is the flow's
    ``training`` parameter as it is: a JSON object of these fields, validated by pydantic
    (unknown fields refused; the bounds in the types are in the parameter schema a
    deployment enforces) and handed down unchanged.
    """

    __pydantic_config__ = {"extra": "forbid"}

    workers: Annotated[int, Ge(1)] = 2
    """Data-parallel workers (Ray actors), one process each."""
    epochs: Annotated[int, Ge(1)] = 10
    """Passes over the training split."""
    batch_size: Annotated[int, Ge(1)] | None = None
    """Global batch: split across the workers, so the math does not depend on their number
    (64 when neither it nor ``per_worker_batch_size`` is given)."""
    per_worker_batch_size: Annotated[int, Ge(1)] | None = None
    """Weak scaling: each worker trains on this many samples a step, so the global batch is
    this times ``workers`` and grows with them (then ``batch_size`` is left out or equal)."""
    lr_scaling: LrScaling = "none"
    """How the optimizers' learning rates follow the global batch, relative to
    ``lr_reference_batch``: ``none``, ``linear`` (times batch / reference, as Horovod's
    ``lr * hvd.size()`` and Goyal et al.) or ``sqrt`` (times its square root, for adaptive
    optimizers). Applied to every param group of every optimizer at each step, on top of the
    module's own schedule (``engine.module.LrScale``)."""
    lr_reference_batch: Annotated[int, Ge(1)] | None = None
    """The global batch the module's learning rate was chosen for; ``None``:
    ``per_worker_batch_size`` (one worker's batch, Horovod's convention)."""
    lr_warmup_steps: Annotated[int, Ge(0)] = 0
    """Optimizer steps over which the scaling ramps up linearly from 1 (the module's own
    learning rate) to its full factor (Goyal et al.'s gradual warm-up); 0: full from the
    first step."""
    seed: Annotated[int, Ge(0)] = 0
    """Seeds weight initialisation and the per-epoch shuffle."""
    collective: str = "ring"
    """Gradient averaging by name: ``ring`` (ours) or ``native`` (``torch.distributed``); see
    ``engine.collective.available_collectives()``."""
    bucket_mb: Annotated[float, Gt(0)] = 25.0
    """Gradients are reduced in buckets of about this many MiB, each while backward runs."""
    compression: str = "none"
    """Gradients travel as ``none`` (float32), ``bf16`` or ``fp16``, summed in float32;
    ``powersgd`` sends each gradient matrix as two rank-``powersgd_rank`` factors, with error
    feedback (``engine.collective.powersgd``); or the name of a communication hook that
    reduces each gradient bucket (``engine.collective.register_comm_hook``)."""
    powersgd_rank: Annotated[int, Ge(1)] = 4
    """``compression="powersgd"``: the rank of each gradient matrix's approximation."""
    powersgd_warmup_steps: Annotated[int, Ge(0)] = 100
    """``compression="powersgd"``: optimizer steps reduced whole before compression starts."""
    shard: ShardMode = "none"
    """Sharded data parallel (ZeRO): ``none`` (every worker holds the whole state),
    ``optimizer`` (ZeRO-1: each worker keeps the optimizer state of its shard of the flat
    parameters only; gradients are reduce-scattered, each worker steps its shard, and the
    parameters are all-gathered), ``gradients`` (ZeRO-2: its shard of the gradients too,
    reduce-scattered bucket by bucket during every backward pass) or ``parameters`` (ZeRO-3,
    FSDP's full sharding: its shard of the parameters too, each bucket's all-gathered just
    before the forward and the backward that use it and freed after;
    ``engine.sharded_parameters``)."""
    placement: Placement = "pack"
    """How workers spread over Ray nodes: ``pack`` (as few nodes as possible), ``spread``
    (as many as possible) or ``strict_spread`` (one worker per node)."""
    cpus_per_worker: Annotated[float, Gt(0)] = 1.0
    """Ray CPUs reserved for each worker; also its torch thread count (at least 1)."""
    gpus_per_worker: Annotated[int, Ge(0)] = 0
    """Ray GPUs reserved for each worker: 0 trains on CPU; more trains on the first of them
    (see ``engine.worker.worker_device``), and gradients travel over NCCL."""
    ring_transport: RingTransport = "auto"
    """How the ``ring`` collective moves data (:data:`TRANSPORTS`). ``auto``:
    through shared memory between workers of one host (``shm`` on CPU; ``symm`` on GPU, where
    they write into each other's GPU memory), else ``gloo`` or ``nccl``."""
    timeout_s: Annotated[float, Gt(0)] = 120.0
    """How long a worker start (placement, rendezvous) may wait before the run fails."""
    min_workers: Annotated[int, Ge(1)] | None = None
    """Training goes on after losing workers while at least this many remain (elastic);
    ``None`` means ``workers``: a lost worker is replaced before training goes on."""
    commit_every: Annotated[int, Ge(1)] = 10
    """Workers commit their state in memory every this many steps (and at epoch ends); a
    lost worker costs at most the steps since the last commit."""
    max_failures: Annotated[int, Ge(0)] = 3
    """Worker losses a run survives; one more fails it."""
    checkpoint_every: Annotated[int, Ge(0)] = 0
    """Checkpoint the training state every this many steps (and at every epoch end) when
    ``fit`` is given a store; 0 checkpoints at epoch ends only."""
    precision: Precision = "32-true"
    """As Lightning spells it: ``32-true``, ``bf16-mixed`` (autocast to bfloat16),
    ``16-mixed`` (autocast to float16 with a gradient scaler; GPU only) or ``bf16-true``
    (the module in bfloat16); see ``engine.module``."""
    accumulate_grad_batches: Annotated[int, Ge(1)] = 1
    """Step the optimizer every this many batches, on their summed gradients (Lightning's
    ``accumulate_grad_batches``); windows start at every epoch's start, and the last window of
    an epoch may be shorter. ``commit_every`` and ``checkpoint_every`` must be multiples."""
    gradient_clip_val: Annotated[float, Gt(0)] | None = None
    """Clip the averaged gradient (Lightning's ``gradient_clip_val``); ``None`` does not clip."""
    gradient_clip_algorithm: ClipAlgorithm = "norm"
    """``norm`` (the gradients' global 2-norm to at most ``gradient_clip_val``) or ``value``
    (each element into ``[-gradient_clip_val, gradient_clip_val]``), as Lightning's."""
    log_every_n_steps: Annotated[int, Ge(0)] = 50
    """Values a module logs every step reach the loggers every this many optimizer steps, as
    Lightning's ``log_every_n_steps``; 0 sends only epoch values."""
    reload_dataloaders_every_n_epochs: Annotated[int, Ge(0)] = 0
    """Lightning's: the training data is opened again (a DataModule's or the module's own
    ``train_dataloader()`` called again) every this many epochs; 0 opens it once."""
    sync_batchnorm: bool = False
    """Lightning's: every ``BatchNorm*d`` layer normalises with the statistics of the whole
    global batch, summed over the data-parallel workers in forward (and their gradients in
    backward), so several workers train as one process on the whole batch
    (``engine.sync_batchnorm``); ``False``: each worker's statistics are its part's, as DDP.
    Nothing changes on one worker; pipeline stages refuse it."""
    collective_timeout_s: Annotated[float, Gt(0)] = 10.0
    """Every collective's deadline: a worker that died or stopped answering makes the others
    fail with ``PeerLostError`` within this time."""
    timeline: bool = False
    """Record each worker's forward, backward, bucket all-reduces, gradient wait, optimizer
    step and data loading as a Chrome trace, with a summary of the communication hidden behind
    backward (``engine.timeline``; docs/timeline.md)."""
    timeline_warmup: Annotated[int, Ge(0)] = 5
    """Batches each worker trains before the timeline records (compilation, warm-up)."""
    timeline_steps: Annotated[int, Ge(1)] = 50
    """Batches the timeline records per worker after the warm-up: the trace stays small."""
    symm: SymmConfig = field(default_factory=SymmConfig)
    """How the ring's ``symm`` transport (GPU workers of one host) runs (:class:`SymmConfig`;
    a JSON object of its fields, e.g. ``{"depth": 4}``); no setting changes the results."""

    def __post_init__(self) -> None:
        self._check_symm()
        _positive_int("workers", self.workers)
        _positive_int("epochs", self.epochs)
        self._check_batch()
        if self.batch_size < self.workers:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be at least workers ({self.workers}): "
                "each worker takes a part of every global batch"
            )
        self._check_collective()
        _positive_int("powersgd_rank", self.powersgd_rank)
        warmup = self.powersgd_warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"powersgd_warmup_steps must be 0 or more, got {warmup!r}")
        if self.compression not in (*WIRE_FORMATS, "powersgd"):
            from ringflow.engine.collective.registry import comm_hook

            comm_hook(self.compression)  # raises naming the built-in and registered ones
        self._check_elastic()
        self._check_shard()
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int):
            raise ValueError(f"checkpoint_every must be an integer, got {self.checkpoint_every!r}")
        if self.checkpoint_every < 0:
            raise ValueError(
                f"checkpoint_every must be 0 (epoch ends only) or more, got {self.checkpoint_every}"
            )
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement must be one of {sorted(PLACEMENTS)}, got {self.placement!r}"
            )
        self._check_transport()
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be positive, got {self.cpus_per_worker}")
        if (
            isinstance(self.gpus_per_worker, bool)
            or not isinstance(self.gpus_per_worker, int)
            or self.gpus_per_worker < 0
        ):
            raise ValueError(
                "gpus_per_worker must be 0 (train on CPU) or a positive whole number of GPUs, "
                f"got {self.gpus_per_worker!r}"
            )
        self._check_clipping()
        self._check_accumulation()
        self._check_precision()
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.collective_timeout_s <= 0:
            raise ValueError(
                f"collective_timeout_s must be positive, got {self.collective_timeout_s}"
            )
        self._check_switches()
        self._check_timeline()

    def _check_batch(self) -> None:
        per_worker = self.per_worker_batch_size
        if per_worker is None:
            if self.batch_size is None:
                object.__setattr__(self, "batch_size", 64)
            _positive_int("batch_size", self.batch_size)
        else:
            _positive_int("per_worker_batch_size", per_worker)
            if self.batch_size is None:
                object.__setattr__(self, "batch_size", per_worker * self.workers)
            elif self.batch_size != per_worker * self.workers:
                raise ValueError(
                    f"batch_size ({self.batch_size}) differs from per_worker_batch_size "
                    f"({per_worker}) x workers ({self.workers}): give one of them"
                )
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"lr_scaling must be one of {LR_SCALINGS}, got {self.lr_scaling!r}")
        if self.lr_reference_batch is not None:
            _positive_int("lr_reference_batch", self.lr_reference_batch)
        if self.lr_scaling != "none" and self.reference_batch is None:
            raise ValueError(
                f"lr_scaling {self.lr_scaling!r} needs lr_reference_batch (the global batch "
                "the module's learning rate was chosen for) or per_worker_batch_size"
            )
        warmup = self.lr_warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"lr_warmup_steps must be 0 or a positive integer, got {warmup!r}")

    def with_changes(self, **changes: Any) -> TrainConfig:
        """``dataclasses.replace`` of these fields, where under ``per_worker_batch_size`` the
        global batch follows the new ``workers`` or batch per worker (unless ``changes`` set
        ``batch_size`` too)."""
        if self.per_worker_batch_size is not None and "batch_size" not in changes:
            changes["batch_size"] = None
        return replace(self, **changes)

    def with_workers(self, workers: int, **changes: Any) -> TrainConfig:
        """This configuration on ``workers`` workers (:meth:`with_changes`)."""
        return self.with_changes(workers=workers, **changes)

    @property
    def reference_batch(self) -> int | None:
        """The batch ``lr_scaling`` is relative to (``lr_reference_batch``, else one
        worker's ``per_worker_batch_size``)."""
        return self.lr_reference_batch or self.per_worker_batch_size

    @property
    def rejoin_timeout_s(self) -> float:
        """How long workers rebuilding their ring after a membership change wait for each
        other: every one of them is up already, so a peer missing this long is lost (a
        replacement that died as it joined), and the others fail the rebuild instead of
        waiting the whole ``timeout_s``."""
        return min(self.timeout_s, max(30.0, 3 * self.collective_timeout_s))

    @property
    def batch_follows_workers(self) -> bool:
        """Whether the global batch changes when elastic recovery changes the workers (weak
        scaling with ``min_workers`` below ``workers``): each epoch's is the batch per
        worker times the workers that start it (``engine.epochs``)."""
        return (
            self.per_worker_batch_size is not None
            and (self.min_workers or self.workers) < self.workers
        )

    def lr_factor(self, batch_size: int | None = None) -> float:
        """What ``lr_scaling`` multiplies the learning rates by once warmed up, for a global
        batch of ``batch_size`` (``None``: this configuration's)."""
        if self.lr_scaling == "none":
            return 1.0
        ratio = (batch_size or self.batch_size) / self.reference_batch
        return ratio if self.lr_scaling == "linear" else ratio**0.5

    def _check_symm(self) -> None:
        if isinstance(self.symm, Mapping):  # TrainConfig(**json): the nested object as given
            object.__setattr__(self, "symm", SymmConfig(**self.symm))
        if not isinstance(self.symm, SymmConfig):
            raise ValueError(f"symm must be a SymmConfig or its fields, got {self.symm!r}")

    def _check_collective(self) -> None:
        if self.collective in _SHIPPED_COLLECTIVES:
            return
        from ringflow.engine.collective.registry import available_collectives

        if self.collective not in available_collectives():
            raise ValueError(
                f"collective must be one of {available_collectives()}, got {self.collective!r}"
            )

    def _check_switches(self) -> None:
        for name in ("timeline", "sync_batchnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _check_timeline(self) -> None:
        if isinstance(self.timeline_warmup, bool) or not isinstance(self.timeline_warmup, int):
            raise ValueError(f"timeline_warmup must be an integer, got {self.timeline_warmup!r}")
        if self.timeline_warmup < 0:
            raise ValueError(f"timeline_warmup must be 0 or more, got {self.timeline_warmup}")
        _positive_int("timeline_steps", self.timeline_steps)

    def _check_transport(self) -> None:
        if self.ring_transport not in TRANSPORTS:
            raise ValueError(
                f"ring_transport must be one of {TRANSPORTS}, got {self.ring_transport!r}"
            )
        gpu = self.ring_transport in ("nccl", "symm")
        if self.ring_transport != "auto" and gpu != bool(self.gpus_per_worker):
            raise ValueError(
                f"ring_transport {self.ring_transport!r} is for "
                + (
                    "GPU workers: set gpus_per_worker, or use 'auto' on CPU"
                    if gpu
                    else "CPU workers (gpus_per_worker=0): GPU workers use 'auto', 'nccl' or 'symm'"
                )
            )

    def _check_accumulation(self) -> None:
        _positive_int("accumulate_grad_batches", self.accumulate_grad_batches)
        reload = self.reload_dataloaders_every_n_epochs
        if isinstance(reload, bool) or not isinstance(reload, int) or reload < 0:
            raise ValueError(
                f"reload_dataloaders_every_n_epochs must be 0 (never) or more, got {reload!r}"
            )
        if self.log_every_n_steps != 0:  # counts optimizer steps, as accumulation sets them
            _positive_int("log_every_n_steps", self.log_every_n_steps)
        window = self.accumulate_grad_batches
        for name in ("commit_every", "checkpoint_every"):
            if getattr(self, name) % window:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be a multiple of "
                    f"accumulate_grad_batches ({window}): a commit or checkpoint cannot fall "
                    "inside an accumulation window"
                )

    def _check_shard(self) -> None:
        if self.shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {list(SHARD_MODES)}, got {self.shard!r}")
        if self.shard == "none":
            return
        if self.compression not in WIRE_FORMATS:
            raise ValueError(
                f"shard={self.shard!r} does not compose with compression={self.compression!r} "
                "yet: communication hooks reduce whole buckets, sharding reduce-scatters them; "
                f"use one of {list(WIRE_FORMATS)}"
            )
        if self.precision == "16-mixed":
            raise ValueError(
                f"shard={self.shard!r} does not compose with precision='16-mixed' yet: its "
                "gradient scaler would find overflows in one shard only; use 'bf16-mixed'"
            )

    def _check_precision(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "16-mixed" and not self.gpus_per_worker:
            raise ValueError(
                "precision '16-mixed' needs GPU workers (gpus_per_worker); on CPU use "
                "'bf16-mixed', as Lightning does"
            )

    def _check_clipping(self) -> None:
        if self.gradient_clip_val is not None and not self.gradient_clip_val > 0:
            raise ValueError(
                f"gradient_clip_val must be positive (or None: no clipping), got "
                f"{self.gradient_clip_val!r}"
            )
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(
                "gradient_clip_algorithm must be 'norm' or 'value', got "
                f"{self.gradient_clip_algorithm!r}"
            )

    def _check_elastic(self) -> None:
        if self.min_workers is not None:
            _positive_int("min_workers", self.min_workers)
            if self.min_workers > self.workers:
                raise ValueError(
                    f"min_workers ({self.min_workers}) must not exceed workers ({self.workers})"
                )
        _positive_int("commit_every", self.commit_every)
        if isinstance(self.max_failures, bool) or not isinstance(self.max_failures, int):
            raise ValueError(f"max_failures must be an integer, got {self.max_failures!r}")
        if self.max_failures < 0:
            raise ValueError(f"max_failures must be 0 or more, got {self.max_failures}")


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """A preprocessed dataset written by ``storage.dataset.preprocess``."""

    dataset_url: str
    """URL of the dataset directory (holds ``_manifest.json``)."""
    schema: TableSchema | None = None
    """Feature and label columns; ``None`` reads the schema the dataset was written with."""
    stream: bool | None = None
    """``True``: workers read their rows of every batch from the shards' row groups while they
    train (``storage.stream``: memory bounded by a few row groups); ``False``: each split is
    read whole into every worker; ``None``: stream a split whose shards hold more than
    ``STREAM_ABOVE_BYTES`` (256 MiB), read smaller ones whole (faster when they fit). All give
    the same batches, bit for bit."""
    shuffle_window: int = 4
    """Row groups whose rows are shuffled together each epoch (after the row groups are
    shuffled): part of the order (``engine.data.EpochOrder``), whether streamed or not. A
    split stored in one row group is shuffled whole."""
    prefetch_batches: int = 4
    """Batches a streaming worker's background reader prepares ahead of training."""

    def __post_init__(self) -> None:
        if self.stream is not None and not isinstance(self.stream, bool):
            raise ValueError(f"stream must be True, False or None (by size), got {self.stream!r}")
        _positive_int("shuffle_window", self.shuffle_window)
        _positive_int("prefetch_batches", self.prefetch_batches)
        if self.schema is None:
            from ringflow.storage.dataset import dataset_schema

            object.__setattr__(self, "schema", dataset_schema(self.dataset_url))

    def read(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features, labels)`` of ``split``, verified against the dataset's manifest."""
        import torch

        from ringflow.storage.dataset import read_split

        x, y = read_split(self.dataset_url, split, self.schema)
        return torch.from_numpy(x), torch.from_numpy(y)

    def samples(self, split: str) -> Any:
        """``split`` as a worker reads it (``engine.data.Samples``): streamed, or read whole,
        with its row-group layout either way."""
        from ringflow.storage.dataset import split_shards
        from ringflow.storage.stream import SplitStream

        stream = self.stream
        if stream is None:
            _, shards = split_shards(self.dataset_url, split, self.schema)
            stream = sum(f["size"] for f in shards) > STREAM_ABOVE_BYTES
        if stream:
            return SplitStream(
                self.dataset_url,
                split,
                self.schema,
                window=self.shuffle_window,
                prefetch=self.prefetch_batches,
            )
        from ringflow.engine.data import TableSamples

        return TableSamples(*self.read(split), layout=self.layout(split))

    def layout(self, split: str) -> Any:
        """``split``'s row groups and ``shuffle_window`` (``engine.data.Layout``), which set
        its order; read from the shards' Parquet footers."""
        from ringflow.engine.data import Layout
        from ringflow.storage.stream import ParquetSplit

        blocks = ParquetSplit(self.dataset_url, split, self.schema).blocks
        return Layout(blocks or (0,), self.shuffle_window)


@dataclass(frozen=True, kw_only=True)
class TensorData:
    """A dataset given as tensors instead of a preprocessed ``DataSpec`` (tests, notebooks).

    Each split is ``(features, labels)`` with the samples along the first dimension.
    """

    splits: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def has(self, split: str) -> bool:
        """Whether ``split`` was given (no ``validation``: the run trains without it)."""
        return split in self.splits

    def read(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split not in self.splits:
            raise ValueError(f"TensorData has no split {split!r}; it has {sorted(self.splits)}")
        return self.splits[split]


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
