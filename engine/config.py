"""What a training run asks of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from annotated_types import Ge, Gt

if TYPE_CHECKING:
    import torch

    from ringflow.storage.dataset import TableSchema

__all__ = [
    "PLACEMENTS",
    "PRECISIONS",
    "STREAM_ABOVE_BYTES",
    "TRANSPORTS",
    "WIRE_FORMATS",
    "DataSpec",
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
_SHIPPED_COLLECTIVES = ("ring", "native")
"""Registered by ``engine.collective.ring`` and ``.native``; another name is looked up in
the registry (``engine.collective.register_collective``)."""

STREAM_ABOVE_BYTES = 256 * 2**20
"""``DataSpec(stream=None)`` streams a split whose Parquet shards hold more bytes than this."""

PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict_spread": "STRICT_SPREAD"}
"""``TrainConfig.placement`` to the Ray placement-group strategy."""


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
    batch_size: Annotated[int, Ge(1)] = 64
    """Global batch: split across the workers, so the math does not depend on their number."""
    seed: Annotated[int, Ge(0)] = 0
    """Seeds weight initialisation and the per-epoch shuffle."""
    collective: str = "ring"
    """Gradient averaging by name: ``ring`` (ours) or ``native`` (``torch.distributed``); see
    ``engine.collective.available_collectives()``."""
    bucket_mb: Annotated[float, Gt(0)] = 25.0
    """Gradients are reduced in buckets of about this many MiB, each while backward runs."""
    compression: Compression = "none"
    """Gradients travel as ``none`` (float32), ``bf16`` or ``fp16``; summed in float32."""
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

    def __post_init__(self) -> None:
        _positive_int("workers", self.workers)
        _positive_int("epochs", self.epochs)
        _positive_int("batch_size", self.batch_size)
        if self.batch_size < self.workers:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be at least workers ({self.workers}): "
                "each worker takes a part of every global batch"
            )
        self._check_collective()
        if self.compression not in WIRE_FORMATS:
            raise ValueError(f"compression must be one of {WIRE_FORMATS}, got {self.compression!r}")
        self._check_elastic()
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
        self._check_timeline()

    def _check_collective(self) -> None:
        if self.collective in _SHIPPED_COLLECTIVES:
            return
        from ringflow.engine.collective import available_collectives

        if self.collective not in available_collectives():
            raise ValueError(
                f"collective must be one of {available_collectives()}, got {self.collective!r}"
            )

    def _check_timeline(self) -> None:
        if not isinstance(self.timeline, bool):
            raise ValueError(f"timeline must be True or False, got {self.timeline!r}")
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

    def read(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split not in self.splits:
            raise ValueError(f"TensorData has no split {split!r}; it has {sorted(self.splits)}")
        return self.splits[split]


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
