"""Data beyond tables: a ``LightningDataModule`` or map-style torch ``Dataset``s, sharded across
the workers the way tables are.

Whatever the input, a worker sees a split as :class:`Samples`: a length and a way to build the
batch of any list of sample indices. The global order is ringflow's (a seeded permutation per
epoch, ``engine.worker.epoch_batches``), so N workers see the global batches 1 worker sees and a
resumed run continues on the same sample; each worker builds only its part of every batch
(its samples, through the dataset's ``__getitem__`` and the loader's ``collate_fn``).

From a DataModule ringflow takes what its dataloaders hold, not the loaders themselves:
``prepare_data`` runs once in the driver, ``setup`` in every worker, and of each
``*_dataloader()`` the ``dataset`` and ``collate_fn``. The batch size is ``TrainConfig.batch_size``
(the global batch, split across the workers), and the order is ringflow's, whatever sampler the
loader has; a loader whose ``batch_size`` differs is named in a warning.

The order (:class:`EpochOrder`) follows the split's :class:`Layout`, its blocks (a Parquet
dataset's row groups): each epoch shuffles the blocks, shuffles the rows inside each window of
``window`` consecutive blocks of that order, cuts the result into global batches and groups
each batch's rows by block. A streaming reader (``storage.stream``) can follow it holding a
window of blocks, and each rank's contiguous part of a batch touches about ``window / ranks``
of them. Data without blocks (tensors, datasets, data modules) is one block: its order is one
seeded ``torch.randperm`` of the split per epoch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ringflow.engine.seeding import generator_states, seed_host_generators, set_generator_states
from ringflow.storage.stream import Layout

__all__ = [
    "DataModuleData",
    "DatasetData",
    "EpochOrder",
    "Layout",
    "ModuleData",
    "Samples",
    "TableSamples",
    "as_data",
    "has_split",
    "layout_of",
]

log = logging.getLogger("ringflow.engine")

_LOADERS = {"train": "train_dataloader", "validation": "val_dataloader", "test": "test_dataloader"}
_STAGES = {"train": "fit", "validation": "fit", "test": "test"}


class Samples(Protocol):
    """One split as a worker reads it.

    It may also have a ``layout`` (:class:`Layout`; none means one block) and a
    ``follow(position, plan)`` method, which ``engine.worker.epoch_batches`` calls with the
    ``(step, indices)`` it is about to ask :meth:`batch` for, so that a reader can prefetch.
    A stream of rows per rank (a Ray Dataset's splits, ``engine.ray_data``) has an
    ``epoch_order(config, epoch=, world_size=, batch_size=)`` instead of a layout.
    """

    def __len__(self) -> int: ...

    def batch(self, indices: torch.Tensor) -> Any:
        """The batch of the samples at ``indices`` (in host memory)."""


def layout_of(samples: Samples) -> Layout:
    """``samples``' layout; one block where it has none."""
    return getattr(samples, "layout", None) or Layout((len(samples),))


_BLOCK_STREAM = 2**31 - 1
"""The generator stream that shuffles blocks; window ``w`` shuffles its rows with stream ``w``."""


def _generator(seed: int, epoch: int, stream: int) -> torch.Generator:
    # Stream 0 is seeded ``seed + epoch``: one block's order is the randperm it always was.
    return torch.Generator().manual_seed((seed + epoch + (stream << 32)) % 2**63)


class EpochOrder:
    """The global order of one epoch: a seeded function of the layout, ``seed`` and ``epoch``.

    Blocks are shuffled; each window of ``layout.window`` consecutive blocks of that order has
    its rows shuffled together; the concatenation is cut into batches of ``batch_size``, and
    each batch's rows are grouped by block (stably; by the block's place in its window, then
    by window), which changes no batch's content and keeps each rank's part in the same few
    blocks of every window. Windows are computed
    when a batch needs them and only the last few are kept, so the order of any step costs
    about one window, never the whole split.
    """

    def __init__(self, layout: Layout, *, seed: int, epoch: int, batch_size: int) -> None:
        self.layout, self.seed, self.epoch, self.batch_size = layout, seed, epoch, batch_size
        blocks = torch.tensor(layout.blocks, dtype=torch.int64)
        self.size = int(blocks.sum())
        self.steps = -(-self.size // batch_size)
        self._ends = torch.cumsum(blocks, 0)
        self._starts = self._ends - blocks
        if len(blocks) > 1:
            shuffled = torch.randperm(len(blocks), generator=_generator(seed, epoch, _BLOCK_STREAM))
        else:
            shuffled = torch.arange(len(blocks))
        self._windows = torch.split(shuffled, layout.window)
        sizes = torch.stack([blocks[w].sum() for w in self._windows])
        self._window_ends = torch.cumsum(sizes, 0)
        # Where a block's rows go in a batch: by its place in its window, then by window, so
        # that a batch spanning two windows gives each rank the same band of both.
        place = torch.empty_like(shuffled)
        place[shuffled] = torch.arange(len(shuffled))
        self._key = (place % layout.window) * len(self._windows) + place // layout.window
        self._cache: dict[int, torch.Tensor] = {}

    def batch(self, step: int) -> torch.Tensor:
        """The row indices of global batch ``step``, grouped by block."""
        start = step * self.batch_size
        end = min(start + self.batch_size, self.size)
        first = int(torch.searchsorted(self._window_ends, start, right=True))
        pieces = []
        for w in range(first, len(self._windows)):
            offset = int(self._window_ends[w - 1]) if w else 0
            if offset >= end:
                break
            pieces.append(self._window(w)[max(start - offset, 0) : end - offset])
        rows = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if len(self.layout.blocks) > 1:
            keys = self._key[torch.searchsorted(self._ends, rows, right=True)]
            rows = rows[torch.sort(keys, stable=True).indices]
        return rows

    def _window(self, w: int) -> torch.Tensor:
        if w not in self._cache:
            rows = torch.cat(
                [torch.arange(self._starts[b], self._ends[b]) for b in self._windows[w].tolist()]
            )
            perm = torch.randperm(len(rows), generator=_generator(self.seed, self.epoch, w))
            self._cache[w] = rows[perm]
            for old in [k for k in self._cache if k < w - 1]:
                del self._cache[old]
        return self._cache[w]


@dataclass(frozen=True)
class TableSamples:
    """A table's split: ``(features[indices], labels[indices])``."""

    x: torch.Tensor
    y: torch.Tensor
    layout: Layout | None = None
    """How the split is stored (it sets the order); ``None`` for one block."""

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]


@dataclass(frozen=True)
class _DatasetSamples:
    dataset: Any
    collate_fn: Any

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, indices: torch.Tensor) -> Any:
        return self.collate_fn([self.dataset[i] for i in indices.tolist()])


class StreamOrder:
    """An epoch of a stream in the stream's own order: global batch ``step`` is the
    ``batch_size`` samples after the first ``step * batch_size``."""

    def __init__(self, size: int, batch_size: int) -> None:
        self.size, self.batch_size = size, batch_size
        self.steps = -(-size // batch_size)

    def batch(self, step: int) -> torch.Tensor:
        start = step * self.batch_size
        return torch.arange(start, min(start + self.batch_size, self.size))


class _StreamSamples:
    """An ``IterableDataset``'s split, read as a stream: the samples at positions
    ``indices`` of the current epoch's pass over it.

    Global batches are the stream's consecutive samples, in its own order; each worker reads
    the stream from its start and keeps its part of every batch. A resume, a rollback or a
    new epoch asks for a position behind the reader: the stream is started again
    (``set_epoch(epoch)`` first, where the dataset has it) and read up to there. So that the
    stream gives the same samples however often and by whichever worker it is read, it
    draws from torch's, numpy's and Python's generators with states of their own, seeded by
    the run's seed and the epoch, never the training's (which ringflow reseeds at every step).
    """

    def __init__(self, dataset: Any, collate_fn: Any, what: str) -> None:
        self.dataset, self.collate_fn, self.what = dataset, collate_fn, what
        self._seed, self._epoch = 0, 0
        self._reader: Any = None
        self._at = 0  # the position the reader yields next
        self._rng: tuple[Any, ...] | None = None
        self._size: int | None = None
        self._last = 0  # the position of the epoch's last batch

    def __len__(self) -> int:
        if self._size is None:
            try:
                self._size = len(self.dataset)
            except TypeError:  # no __len__: counted by one pass, once
                with self._own_generator():
                    self._size = sum(1 for _ in self._restart())
                self._reader = None
        return self._size

    def epoch_order(
        self, config: Any, *, epoch: int, world_size: int, batch_size: int | None = None
    ) -> StreamOrder:
        """This epoch's order (``engine.worker.epoch_batches`` asks for it), in global batches
        of ``batch_size`` (``None``: ``config.batch_size``)."""
        if (config.seed, epoch) != (self._seed, self._epoch):
            self._seed, self._epoch, self._reader = config.seed, epoch, None
        order = StreamOrder(len(self), batch_size or config.batch_size)
        self._last = (order.steps - 1) * order.batch_size
        return order

    def batch(self, indices: torch.Tensor) -> Any:
        if not len(indices):
            return self.collate_fn([])
        first, count = int(indices[0]), len(indices)
        with self._own_generator():
            if self._reader is None or first < self._at:
                self._reader, self._at = self._restart(), 0
            for _ in range(first - self._at):
                next(self._reader)
            items = [next(self._reader) for _ in range(count)]
            self._at = first + count
            if first >= self._last:
                self._run_to_end()
        return self.collate_fn(items)

    def _run_to_end(self) -> None:
        """Read the stream past its last sample, as Trainer's loader does at an epoch's end,
        so that what its ``__iter__`` runs after the last ``yield`` (clearing a rollout) runs."""
        for _ in self._reader:
            pass
        self._reader, self._at = None, 0

    def _restart(self) -> Any:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._epoch)
        seed = (self._seed + self._epoch) % 2**63
        torch.default_generator.manual_seed(seed)
        seed_host_generators(seed)
        return iter(self.dataset)

    @contextlib.contextmanager
    def _own_generator(self) -> Iterator[None]:
        training = generator_states()
        if self._rng is not None:
            set_generator_states(self._rng)
        try:
            yield
        finally:
            self._rng = generator_states()
            set_generator_states(training)


def _stream_of(dataset: Any, collate_fn: Any, what: str) -> _StreamSamples:
    """``dataset`` (an ``IterableDataset``) as a stream ringflow can read again.

    Raises:
        ValueError: it is a one-shot iterator (its ``__iter__`` returns itself), which cannot
            be read again for a resume or a rollback.
    """
    if iter(dataset) is dataset:
        raise ValueError(
            f"{what} is a {type(dataset).__name__} whose __iter__ returns itself, a stream that "
            "cannot be read again: ringflow restarts a stream to resume a run or roll it back. "
            "Give an IterableDataset whose __iter__ starts the stream anew, or a map-style "
            "dataset"
        )
    return _StreamSamples(dataset, collate_fn, what)


def _default_collate() -> Any:
    from torch.utils.data import default_collate

    return default_collate


def _is_stream(dataset: Any) -> bool:
    return isinstance(dataset, torch.utils.data.IterableDataset) or (
        hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")
    )


def _check_dataset(dataset: Any, what: str) -> None:
    if _is_stream(dataset):
        _stream_of(dataset, None, what)
        return
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ValueError(
            f"{what} is a {type(dataset).__name__}, neither a map-style dataset (__getitem__ "
            "and __len__) nor an IterableDataset"
        )


def _samples(dataset: Any, collate_fn: Any, what: str) -> Samples:
    if _is_stream(dataset):
        return _stream_of(dataset, collate_fn, what)
    return _DatasetSamples(dataset, collate_fn)


@dataclass(frozen=True, kw_only=True)
class DatasetData:
    """Map-style torch ``Dataset``s by split, batched with ``collate_fn`` (torch's default
    collation when ``None``)."""

    train: Any
    validation: Any = None
    test: Any = None
    collate_fn: Any = None

    def __post_init__(self) -> None:
        for split in ("train", "validation", "test"):
            if getattr(self, split) is not None:
                _check_dataset(getattr(self, split), f"DatasetData.{split}")

    def prepare(self) -> None:
        """Nothing to do once per run."""

    def has(self, split: str) -> bool:
        return split in _LOADERS and getattr(self, split) is not None

    def samples(self, split: str) -> Samples:
        dataset = getattr(self, split if split in _LOADERS else "", None)
        if dataset is None:
            raise ValueError(f"DatasetData has no {split!r} split; give it as {split}=...")
        return _samples(dataset, self.collate_fn or _default_collate(), f"DatasetData.{split}")

    def identity(self) -> str:
        return f"datasets:{type(self.train).__module__}.{type(self.train).__qualname__}"


@dataclass(kw_only=True)
class DataModuleData:
    """A ``LightningDataModule``: ``prepare_data`` once (:meth:`prepare`, in the driver),
    ``setup`` once in each worker, its loaders' datasets and collate functions."""

    datamodule: Any
    batch_size: int | None = None
    """The run's global batch, to warn when a loader's ``batch_size`` differs."""
    _stages: set[str] = field(default_factory=set)

    def prepare(self) -> None:
        self.datamodule.prepare_data()

    def has(self, split: str) -> bool:
        """Whether the DataModule has its own loader of ``split`` (Lightning's defaults raise)."""
        from ringflow.engine.hooks import overrides

        return split in _LOADERS and overrides(self.datamodule, _LOADERS[split])

    def samples(self, split: str) -> Samples:
        if split not in _LOADERS:
            raise ValueError(f"a LightningDataModule has no split {split!r}; use {list(_LOADERS)}")
        stage = _STAGES[split]
        if stage not in self._stages:
            self.datamodule.setup(stage)
            self._stages.add(stage)
        name = f"{type(self.datamodule).__name__}.{_LOADERS[split]}()"
        loader = getattr(self.datamodule, _LOADERS[split])()
        dataset = getattr(loader, "dataset", None)
        if dataset is None:
            raise ValueError(f"{name} returned {type(loader).__name__}, not a torch DataLoader")
        _check_dataset(dataset, f"{name}.dataset")
        size = getattr(loader, "batch_size", None)
        if split == "train" and size is not None and self.batch_size not in (None, size):
            log.warning(
                "%s has batch_size=%d; ringflow batches with the run's global batch_size=%d "
                "(split across the workers) in its own seeded order",
                name,
                size,
                self.batch_size,
            )
        collate_fn = getattr(loader, "collate_fn", None) or _default_collate()
        return _samples(dataset, collate_fn, f"{name}.dataset")

    def identity(self) -> str:
        cls = type(self.datamodule)
        return f"datamodule:{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class ModuleData:
    """The module's own data (``fit(data=None)``): its ``*_dataloader()`` methods, called in
    each worker on the module that trains (:meth:`bind`), so that a loader may serve what
    the module gathers as it trains (a replay buffer, rollouts of its current policy).

    Raises:
        ValueError: the module has no ``train_dataloader()`` of its own.
    """

    module_cls: Any

    def __post_init__(self) -> None:
        if not self.has("train"):
            raise ValueError(
                f"{self.module_cls.__name__} has no train_dataloader() and no data was given: "
                "define train_dataloader() in the module, or pass data=..."
            )

    def prepare(self) -> None:
        """Nothing: the module's own ``prepare_data`` runs in ``fit``, as for any module."""

    def has(self, split: str) -> bool:
        from ringflow.engine.hooks import overrides

        return split in _LOADERS and overrides(self.module_cls, _LOADERS[split])

    def evaluation_split(self) -> str | None:
        """The split a trained module is evaluated on: ``test`` where it has its own
        ``test_dataloader()`` and ``test_step``, else ``validation`` (``val_dataloader()`` and
        ``validation_step``), else ``None``: it has no data to evaluate on."""
        from ringflow.engine.hooks import overrides

        steps = {"test": "test_step", "validation": "validation_step"}
        return next(
            (s for s, step in steps.items() if self.has(s) and overrides(self.module_cls, step)),
            None,
        )

    def bind(self, module: Any, batch_size: int) -> DataModuleData:
        """``module``'s loaders, read as a DataModule's; its ``setup`` is not called here:
        the worker calls it as Trainer does, before the first loader."""
        return DataModuleData(datamodule=module, batch_size=batch_size, _stages={"fit", "test"})

    def identity(self) -> str:
        return f"module:{self.module_cls.__module__}.{self.module_cls.__qualname__}"


def has_split(data: Any, split: str) -> bool:
    """Whether ``data`` has ``split`` (a table is taken to have every split it is asked for)."""
    has = getattr(data, "has", None)
    return True if has is None else has(split)


def _is_lightning_module(data: Any) -> bool:
    import lightning as L

    cls = data if isinstance(data, type) else type(data)
    return issubclass(cls, L.LightningModule)


def as_data(data: Any, *, batch_size: int | None = None, module_cls: type | None = None) -> Any:
    """``data`` as the engine takes it: a table (``DataSpec``, ``TensorData``), a
    ``LightningDataModule``, a map-style ``Dataset`` (its ``train`` split), a
    ``ray.data.Dataset`` (its ``train`` split, ``engine.ray_data.RayDatasetData``), or
    ``None`` or the module itself for ``module_cls``'s own loaders (:class:`ModuleData`)."""
    if module_cls is not None and (data is None or _is_lightning_module(data)):
        return ModuleData(module_cls)
    if hasattr(data, "samples") or hasattr(data, "read"):
        return data
    if all(hasattr(data, hook) for hook in ("prepare_data", "setup", "train_dataloader")):
        return DataModuleData(datamodule=data, batch_size=batch_size)
    if isinstance(data, torch.utils.data.Dataset):
        return DatasetData(train=data)
    from ringflow.engine.ray_data import RayDatasetData, is_ray_dataset

    if is_ray_dataset(data):
        return RayDatasetData(train=data)
    raise ValueError(
        f"data is a {type(data).__name__}; give a DataSpec (a preprocessed dataset), TensorData, "
        "a LightningDataModule, DatasetData(train=..., validation=...) of map-style datasets, "
        "or a ray.data.Dataset (RayDatasetData(train=..., validation=...))"
    )


def samples_of(data: Any, split: str) -> Samples:
    """``split`` of any data the engine takes."""
    if hasattr(data, "samples"):
        return data.samples(split)
    return TableSamples(*data.read(split))
