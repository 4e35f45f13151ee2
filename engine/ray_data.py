"""A ``ray.data.Dataset`` as training input: each worker reads its share of every epoch through
Ray Data's ``streaming_split`` (one split per worker, ``equal=True``).

The other inputs give the engine sample indices that any worker can read; a Ray Dataset gives
each worker a stream of its own rows. The global order is therefore Ray's, cut into ringflow's
global batches (:class:`SplitOrder`): with ``W`` workers, each epoch's dataset (shuffled by
Ray where asked, seeded by ``TrainConfig.seed`` and the epoch) is split into ``W`` equal
streams of ``rows // W`` rows (Ray drops the other ``rows % W`` rows of the epoch), and the
streams are interleaved: position ``j`` of the epoch is row ``(j - rows % W) // W`` of worker
``(j - rows % W) % W``'s stream. Global batch ``s`` holds positions ``s * batch_size`` onwards,
so each worker's part differs from the others' by at most one row, as on the other paths, and
the steps per epoch are ``ceil(rows / batch_size)`` whatever the worker count.

Resuming at step ``k`` of an epoch (a checkpoint, a rollback, a new worker count) asks the
splits for that epoch again and has each worker read and discard the rows of its stream that
steps ``0 .. k - 1`` took. With the same worker count and a deterministic dataset
(``preserve_order``, seeded shuffles) the resumed run reads the rows the uninterrupted one
read; with another worker count the rest of that epoch is split differently, so rows may be
read twice or not at all in it (docs/data.md).

The splits are made in one small actor per run (``_SplitService``, no CPU reserved), so that
every worker receives its iterator of the same ``streaming_split``. Validation and test
datasets are read by each worker from the start up to the end of its contiguous part, in
order, which gives the metrics one worker would compute.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ringflow.storage.dataset import TableSchema

__all__ = ["SHUFFLES", "RayDatasetData", "SplitOrder", "is_ray_dataset"]

SHUFFLES = ("none", "blocks", "rows")
"""``RayDatasetData.shuffle``: Ray's order as it is, ``randomize_block_order`` or
``random_shuffle``, each seeded with ``TrainConfig.seed + epoch``."""

_SPLITS = ("train", "validation", "test")


def is_ray_dataset(data: Any) -> bool:
    """Whether ``data`` is a ``ray.data.Dataset`` (without importing Ray when it is not)."""
    module = sys.modules.get("ray.data")
    return module is not None and isinstance(data, module.Dataset)


@dataclass(frozen=True)
class SplitOrder:
    """The global order of one epoch of ``rows`` rows read through ``world_size`` equal splits.

    Positions below ``rows % world_size`` are the rows Ray's equal split leaves out; they lie
    in the first global batch, which ``batch_size >= workers`` keeps from being empty.
    """

    rows: int
    batch_size: int
    world_size: int

    @property
    def steps(self) -> int:
        return -(-self.rows // self.batch_size)

    @property
    def _skipped(self) -> int:
        return self.rows % self.world_size

    def batch(self, step: int) -> torch.Tensor:
        """The positions of global batch ``step`` that some worker's split holds."""
        start = max(step * self.batch_size, self._skipped)
        return torch.arange(start, min((step + 1) * self.batch_size, self.rows))

    def part(self, batch: torch.Tensor, *, rank: int, world_size: int) -> torch.Tensor:
        """``rank``'s positions of ``batch``: those its split holds."""
        assert world_size == self.world_size, (world_size, self.world_size)
        return batch[(batch - self._skipped) % world_size == rank]

    def row(self, position: int) -> int:
        """Where ``position`` lies in its worker's split."""
        return (position - self._skipped) // self.world_size

    def before(self, step: int, rank: int) -> int:
        """Rows of ``rank``'s split that steps ``0 .. step - 1`` take."""
        held = max(min(step * self.batch_size, self.rows) - self._skipped, 0)
        return max(-(-(held - rank) // self.world_size), 0)


def _epoch_dataset(dataset: Any, *, shuffle: str, seed: int, epoch: int) -> Any:
    if shuffle == "blocks":
        return dataset.randomize_block_order(seed=seed + epoch)
    if shuffle == "rows":
        return dataset.random_shuffle(seed=seed + epoch)
    return dataset


class _SplitService:
    """Makes one ``streaming_split`` per position the workers start reading from, and hands
    each worker its iterator (a Ray actor: workers in other processes share its splits).

    Workers ask with the same key at the same call; a worker asking again for a key it was
    given (a repeated position) starts a new round of splits.
    """

    def __init__(self, dataset: Any, shuffle: str, preserve_order: bool) -> None:
        self._dataset, self._shuffle, self._preserve_order = dataset, shuffle, preserve_order
        self._key: tuple[int, ...] | None = None
        self._given: set[int] = set()
        self._iterators: list[Any] = []

    def split(self, *, seed: int, epoch: int, world_size: int, first: int, rank: int) -> Any:
        key = (seed, epoch, world_size, first)
        if key != self._key or rank in self._given:
            dataset = _epoch_dataset(self._dataset, shuffle=self._shuffle, seed=seed, epoch=epoch)
            dataset.context.execution_options.preserve_order = self._preserve_order
            self._iterators = dataset.streaming_split(world_size, equal=True)
            self._key, self._given = key, set()
        self._given.add(rank)
        return self._iterators[rank]


class _Columns:
    """Rows of a stream of numpy column batches, taken ``count`` at a time (views into the
    batches where a take lies in one, so a large block is never copied whole per take)."""

    def __init__(self, batches: Iterator[dict[str, np.ndarray]], what: str) -> None:
        self._batches, self._what = iter(batches), what
        self._batch: dict[str, np.ndarray] = {}
        self._size = self._offset = 0
        self.taken = 0

    def take(self, count: int) -> dict[str, np.ndarray]:
        pieces, needed = [], count
        while needed:
            if self._offset == self._size:
                self._next(needed)
            n = min(needed, self._size - self._offset)
            pieces.append({k: v[self._offset : self._offset + n] for k, v in self._batch.items()})
            self._offset += n
            needed -= n
        self.taken += count
        if len(pieces) == 1:
            return pieces[0]
        return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}

    def _next(self, needed: int) -> None:
        batch = next(self._batches, None)
        if batch is None:
            raise ValueError(
                f"{self._what} ended after {self.taken} rows, {needed} short of the epoch's: "
                "the dataset's row count changed since fit counted it (is it deterministic?)"
            )
        self._batch, self._size, self._offset = batch, len(next(iter(batch.values()))), 0

    def skip(self, count: int, chunk: int = 4096) -> None:
        while count > 0:
            self.take(min(count, chunk))
            count -= min(count, chunk)


def _tensors(columns: dict[str, np.ndarray], schema: TableSchema | None, collate_fn: Any) -> Any:
    """A batch as the module's steps take it: ``(features, labels)`` of the schema, as a
    ``DataSpec`` gives them; ``collate_fn(columns)``; or the columns as tensors."""
    if schema is not None:
        features = np.empty((len(columns[schema.label.name]), schema.input_dim), np.float32)
        for i, column in enumerate(schema.features):
            features[:, i] = columns[column.name]
        labels = columns[schema.label.name].astype(
            np.int64 if schema.task == "classification" else np.float32
        )
        return torch.from_numpy(features), torch.from_numpy(labels)
    if collate_fn is not None:
        return collate_fn(columns)
    return {name: torch.tensor(values) for name, values in columns.items()}


class _SplitRows:
    """A worker's view of the training dataset: its split of each epoch, read in order."""

    def __init__(self, data: RayDatasetData) -> None:
        self._data = data
        self._order: SplitOrder | None = None
        self._columns: _Columns | None = None
        self._position: tuple[int, ...] = ()

    def __len__(self) -> int:
        return self._data.rows

    def epoch_order(
        self, config: Any, *, epoch: int, world_size: int, batch_size: int | None = None
    ) -> SplitOrder:
        """The epoch's order (``engine.worker.epoch_batches`` asks for it), in global batches
        of ``batch_size`` (``None``: ``config.batch_size``)."""
        return SplitOrder(self._data.rows, batch_size or config.batch_size, world_size)

    def follow(self, position: tuple[int, ...], plan: Any) -> None:
        """Continue reading this epoch's split, or ask for the split again at step ``first``
        (a new epoch, a resume, a rollback or a new worker count) and skip what steps before
        it took. ``plan`` (other inputs' row indices) is not needed: the split is read in
        order."""
        import ray

        seed, batch_size, epoch, first, rank, world_size = position
        if self._data.rows < world_size:
            raise ValueError(
                f"the Ray Dataset has {self._data.rows} rows, fewer than the {world_size} "
                "workers its equal split feeds; train with fewer workers or more rows"
            )
        order = SplitOrder(self._data.rows, batch_size, world_size)
        where = (seed, epoch, rank, world_size)
        if (
            self._columns is not None
            and self._position == where
            and self._columns.taken == order.before(first, rank)
        ):
            return
        iterator = ray.get(
            self._data.splits.split.remote(
                seed=seed, epoch=epoch, world_size=world_size, first=first, rank=rank
            )
        )
        batches = iterator.iter_batches(batch_size=None, batch_format="numpy")
        self._columns = _Columns(batches, f"split {rank} of {world_size} of epoch {epoch}")
        self._columns.skip(order.before(first, rank))
        self._order, self._position = order, where

    def restart(self) -> None:
        """The members changed (``Worker.reconfigure``): every member asks for new splits
        at its next step, even one whose own position did not move (a loss while rank 0
        checkpoints), so that all read the same ``streaming_split``."""
        self._columns = None

    def batch(self, indices: torch.Tensor) -> Any:
        assert self._order is not None, "follow() comes first"
        assert self._columns is not None
        if self._order.row(int(indices[0])) != self._columns.taken:
            raise RuntimeError(
                f"rows of a Ray Dataset split are read in order: asked for row "
                f"{self._order.row(int(indices[0]))}, the split is at {self._columns.taken}"
            )
        return self._data.convert(self._columns.take(len(indices)))


class _DatasetRows:
    """A validation or test dataset, read in order by each worker up to its contiguous part."""

    def __init__(self, data: RayDatasetData, dataset: Any, split: str) -> None:
        self._data, self._dataset, self._split = data, dataset, split
        self._rows: int | None = None
        self._columns: _Columns | None = None

    def __len__(self) -> int:
        if self._rows is None:
            self._rows = self._dataset.count()
        return self._rows

    def batch(self, indices: torch.Tensor) -> Any:
        start = int(indices[0])
        if not torch.equal(indices, torch.arange(start, start + len(indices))):
            raise RuntimeError(f"a Ray Dataset's {self._split} rows are read in ranges")
        if self._columns is None or start < self._columns.taken:
            self._columns = _Columns(
                self._dataset.iter_batches(batch_format="numpy"), f"the {self._split} dataset"
            )
        self._columns.skip(start - self._columns.taken)
        return self._data.convert(self._columns.take(len(indices)))


class _NoRows:
    """No validation dataset: the epoch's validation runs its hooks over no rows."""

    def __len__(self) -> int:
        return 0

    def batch(self, indices: torch.Tensor) -> Any:
        raise AssertionError("no rows to batch")


@dataclass(kw_only=True)
class RayDatasetData:
    """``ray.data.Dataset``s by split; ``fit(data=dataset)`` is ``RayDatasetData(train=dataset)``.

    Each worker trains on its ``streaming_split`` of the training dataset (module docstring).
    A batch is ``(features, labels)`` tensors of ``schema`` (float32 features in schema order,
    int64 class ids or float32 targets), as a ``DataSpec`` gives them; without a schema,
    ``collate_fn`` of the batch's columns (a dict of numpy arrays, as Ray's
    ``iter_batches(batch_format="numpy")`` gives them); without either, that dict with each
    column as a tensor.

    ``preserve_order`` is set on the training dataset's ``DataContext`` (it is what makes
    the split deterministic); validation and test datasets are always read in order, each
    worker taking its contiguous range.

    Raises:
        ValueError: a split is not a Ray Dataset, or an option has no allowed value.
    """

    train: Any
    validation: Any = None
    test: Any = None
    schema: TableSchema | None = None
    """The feature and label columns (models then get ``input_dim`` and ``num_classes``)."""
    collate_fn: Callable[[dict[str, np.ndarray]], Any] | None = None
    """Builds a batch from its columns when there is no schema."""
    shuffle: str = "none"
    """One of :data:`SHUFFLES`, applied to the training dataset every epoch."""
    preserve_order: bool = True
    """Ray Data's ``execution_options.preserve_order`` for ``train``: ``False`` is faster and
    not repeatable."""
    rows: int = field(default=0, init=False)
    """Rows of the training dataset, counted by :meth:`prepare`."""
    splits: Any = field(default=None, init=False, repr=False)
    """The actor that makes the training splits, started by :meth:`prepare`."""

    def __post_init__(self) -> None:
        for split in _SPLITS:
            dataset = getattr(self, split)
            if dataset is not None and not is_ray_dataset(dataset):
                raise ValueError(
                    f"RayDatasetData.{split} is a {type(dataset).__name__}, not a "
                    "ray.data.Dataset; map-style torch datasets go in DatasetData"
                )
            if dataset is not None:  # each worker reads its range of validation and test
                order = self.preserve_order if split == "train" else True
                dataset.context.execution_options.preserve_order = order
        if self.train is None:
            raise ValueError("RayDatasetData needs a train dataset")
        if self.shuffle not in SHUFFLES:
            raise ValueError(
                f"RayDatasetData.shuffle must be one of {SHUFFLES}, got {self.shuffle!r}"
            )
        if self.schema is not None and self.collate_fn is not None:
            raise ValueError(
                "RayDatasetData takes a schema (batches of features and labels) or a "
                "collate_fn (batches of your own), not both"
            )

    def prepare(self) -> None:
        """In the driver, before any worker starts: check the columns, count the training rows
        and start the actor that makes the splits.

        Raises:
            ValueError: a dataset lacks a column of ``schema``, or the training one is empty.
        """
        import ray

        for split in _SPLITS:
            if getattr(self, split) is not None and self.schema is not None:
                self._check_columns(split)
        self.rows = self.train.count()
        if self.rows == 0:
            raise ValueError("RayDatasetData.train has no rows")
        if self.splits is not None:
            ray.kill(self.splits)
        service = ray.remote(num_cpus=0)(_SplitService)
        self.splits = service.remote(self.train, self.shuffle, self.preserve_order)

    def _check_columns(self, split: str) -> None:
        assert self.schema is not None
        names = set(getattr(self, split).schema().names)
        missing = [c.name for c in self.schema.columns if c.name not in names]
        if missing:
            raise ValueError(
                f"RayDatasetData.{split} has no column {missing[:5]} of the schema; it has "
                f"{sorted(names)[:10]}: rename them, or give the schema of its columns"
            )

    def has(self, split: str) -> bool:
        return split in _SPLITS and getattr(self, split) is not None

    def samples(self, split: str) -> Any:
        if split == "validation" and self.validation is None:
            return _NoRows()  # as Trainer without a val_dataloader: no validation metrics
        if split not in _SPLITS or getattr(self, split) is None:
            raise ValueError(f"RayDatasetData has no {split!r} split; give it as {split}=...")
        if split != "train":
            return _DatasetRows(self, getattr(self, split), split)
        if self.splits is None:
            raise ValueError("RayDatasetData.prepare() must run before training (fit runs it)")
        if self.rows < 1:
            raise ValueError("RayDatasetData.train has no rows")
        return _SplitRows(self)

    def convert(self, columns: dict[str, np.ndarray]) -> Any:
        """A batch of ``columns`` as the module's steps take it."""
        return _tensors(columns, self.schema, self.collate_fn)

    def identity(self) -> str:
        columns = [c.name for c in self.schema.columns] if self.schema else "columns"
        return f"ray_dataset:{columns}:shuffle={self.shuffle}"
