"""Read a split of a committed dataset while training runs, a few row groups at a time.

A :class:`SplitStream` is one split as a worker sees it (``engine.data.Samples``): its length,
its layout (the row groups of its shards, read from the Parquet footers) and the batch of any
rows. A worker tells it which rows it will ask for next (:meth:`SplitStream.follow`); a
background thread then reads the row groups those rows lie in and builds the batches ahead of
the training loop, at most ``prefetch`` batches ahead, keeping only the row groups that the
next batches need. Nothing reads a whole split, so a worker's memory is bounded by a few row
groups and ``prefetch`` batches, whatever the dataset's size.

The batches are the very values :func:`storage.dataset.read_split` gives (the same conversion,
:func:`storage.dataset.table_arrays`). Each shard's size, rows and row groups are checked
against the manifest when the stream opens, and each row group's bytes against the SHA-256 the
manifest lists for it before they are decoded (datasets committed before manifests listed row
groups get the size and row checks only).
"""

from __future__ import annotations

import io
import queue
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from ringflow.storage.dataset import (
    DataError,
    TableSchema,
    row_group_range,
    split_shards,
    table_arrays,
)
from ringflow.storage.fs import join, resolve, sha256

__all__ = ["Layout", "ParquetSplit", "SplitStream"]

_LOOKAHEAD = 16
"""Planned batches whose row groups the reader keeps: a row group used again within this many
batches is not read twice."""
_DIRECT_BLOCKS = 2
"""Row groups kept for reads outside a plan (evaluation reads its rows in order)."""


@dataclass(frozen=True)
class Layout:
    """How a split is stored, as far as its order depends on it (``engine.data.EpochOrder``)."""

    blocks: tuple[int, ...]
    """Rows in each block (a Parquet row group), in the split's row order."""
    window: int = 1
    """Blocks whose rows are shuffled together (``DataSpec.shuffle_window``)."""

    def __post_init__(self) -> None:
        if not self.blocks or min(self.blocks) < 0 or self.window < 1:
            raise ValueError(
                f"a layout has blocks of 0 or more rows and a window of 1 or more: {self}"
            )


class ParquetSplit:
    """The row groups of one split of a committed dataset, each readable on its own.

    Where the manifest lists a shard's row groups (``storage.dataset.row_group_entries``, as
    ``preprocess`` and ``commit_manifest`` write them), each row group's bytes are fetched in
    one range read and checked against their SHA-256 before they are decoded; otherwise only
    the shard's size and rows are checked, when the split opens.

    Raises:
        DataError: no committed dataset, or a shard's size, rows or row groups differ from the
            manifest.
        SchemaError: the dataset lacks a schema column (as ``read_split``).
    """

    def __init__(self, dataset_url: str, split: str, schema: TableSchema | None = None) -> None:
        self.schema, self._entries = split_shards(dataset_url, split, schema)
        self.names = [c.name for c in self.schema.columns]
        self._url = dataset_url
        self._fs, root = resolve(dataset_url)
        self._paths = [join(root, entry["path"]) for entry in self._entries]
        self._footers = [self._footer(shard) for shard in range(len(self._entries))]
        self._groups = [
            (shard, group)
            for shard, footer in enumerate(self._footers)
            for group in range(footer.num_row_groups)
        ]
        self.blocks = tuple(self._footers[s].row_group(g).num_rows for s, g in self._groups)
        """Rows in each row group, in the split's row order."""
        self.reads = 0
        """Row groups read so far (a row group read again counts again)."""

    def _footer(self, shard: int) -> pq.FileMetaData:
        entry, url = self._entries[shard], join(self._url, self._entries[shard]["path"])
        try:
            size = self._fs.size(self._paths[shard])
        except FileNotFoundError as err:
            raise DataError(
                f"shard {url} listed in the manifest is missing; run preprocess again"
            ) from err
        if size != entry["size"]:
            raise DataError(f"shard {url} has {size} bytes, its manifest says {entry['size']}")
        with self._fs.open(self._paths[shard], "rb") as f:
            footer = pq.read_metadata(f)
        groups = entry.get("row_groups")
        listed = None if groups is None else [(g["rows"], g["offset"], g["size"]) for g in groups]
        found = [
            (footer.row_group(g).num_rows, *row_group_range(footer.row_group(g)))
            for g in range(footer.num_row_groups)
        ]
        if footer.num_rows != entry["rows"] or listed not in (None, found):
            raise DataError(f"shard {url} does not hold the rows and row groups of its manifest")
        return footer

    def read(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """``(features, labels)`` of row group ``block``, as ``read_split`` converts them.

        Raises:
            DataError: the row group's bytes do not match their manifest checksum.
        """
        shard, group = self._groups[block]
        self.reads += 1
        listed = self._entries[shard].get("row_groups")
        if listed is None:
            with self._fs.open(self._paths[shard], "rb") as f:
                table = pq.ParquetFile(f).read_row_group(group, columns=self.names)
            return table_arrays(table, self.schema)
        offset, size = listed[group]["offset"], listed[group]["size"]
        data = self._fs.cat_file(self._paths[shard], start=offset, end=offset + size)
        if sha256(data) != listed[group]["sha256"]:
            url = join(self._url, self._entries[shard]["path"])
            raise DataError(
                f"row group {group} of shard {url} does not match its manifest checksum; "
                "run preprocess again"
            )
        source = _RowGroupBytes(self._entries[shard]["size"], offset, data)
        table = pq.ParquetFile(source, metadata=self._footers[shard]).read_row_group(
            group, columns=self.names
        )
        return table_arrays(table, self.schema)


class _RowGroupBytes(io.RawIOBase):
    """A shard as Parquet's reader sees it, holding only one row group's (checked) bytes: with
    the footer given, the reader asks for nothing else."""

    def __init__(self, size: int, offset: int, data: bytes) -> None:
        self._size, self._offset, self._data, self._at = size, offset, data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = base + offset
        return self._at

    def tell(self) -> int:
        return self._at

    def size(self) -> int:
        return self._size

    def read(self, size: int = -1) -> bytes:
        start = self._at - self._offset
        if size < 0 or start < 0 or start + size > len(self._data):
            raise OSError(f"read of {size} bytes at {self._at}, outside the row group read")
        self._at += size
        return self._data[start : start + size]


@dataclass
class _Failed:
    error: BaseException


class _Rows:
    """Rows of a split by index, through a cache of its row groups (what a stream and its
    reading thread share; the thread holds no reference to the stream, so a stream dropped
    mid-epoch is collected and its thread stopped)."""

    def __init__(self, split: ParquetSplit) -> None:
        self.split = split
        blocks = np.array(split.blocks or (0,), dtype=np.int64)
        self.ends = np.cumsum(blocks)
        self.starts = self.ends - blocks
        self.label_type = np.int64 if split.schema.task == "classification" else np.float32

    def blocks_of(self, rows: torch.Tensor) -> set[int]:
        return set(np.unique(np.searchsorted(self.ends, rows.numpy(), side="right")).tolist())

    def gather(self, rows: torch.Tensor, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ids = rows.numpy()
        which = np.searchsorted(self.ends, ids, side="right")
        x = np.empty((len(ids), self.split.schema.input_dim), dtype=np.float32)
        y = np.empty(len(ids), dtype=self.label_type)
        for block in np.unique(which).tolist():
            bx, by = self._block(block, cache)
            here = which == block
            local = ids[here] - self.starts[block]
            x[here], y[here] = bx[local], by[local]
        return torch.from_numpy(x), torch.from_numpy(y)

    def _block(self, block: int, cache: dict) -> tuple[np.ndarray, np.ndarray]:
        if block not in cache:
            cache[block] = self.split.read(block)
            if isinstance(cache, OrderedDict) and len(cache) > _DIRECT_BLOCKS:
                cache.popitem(last=False)
        elif isinstance(cache, OrderedDict):
            cache.move_to_end(block)
        return cache[block]


class _Plan:
    """A reading thread following one sequence of ``(step, rows)``, at most ``prefetch``
    batches ahead of the one taking them."""

    def __init__(
        self, position: tuple, rows: _Rows, cache: dict, parts: Iterable, prefetch: int
    ) -> None:
        self.position = position
        self.out: queue.Queue = queue.Queue(maxsize=prefetch)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=_read_ahead, args=(rows, cache, parts, self), name="ringflow-reader", daemon=True
        )
        self.thread.start()

    def put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _read_ahead(rows: _Rows, cache: dict, parts: Iterable, plan: _Plan) -> None:
    """The reading thread: build each planned batch, keeping the row groups that the next
    ``_LOOKAHEAD`` planned batches need and no other."""
    try:
        ahead: deque = deque()
        for step, part in parts:
            if plan.stop.is_set():
                return
            if len(part):  # a rank with no rows in a batch asks for nothing
                ahead.append((step, part, rows.blocks_of(part)))
            if len(ahead) > _LOOKAHEAD and not _serve(rows, cache, ahead, plan):
                return
        while ahead:
            if not _serve(rows, cache, ahead, plan):
                return
        plan.put(None)
    except BaseException as err:  # handed to the training thread, which raises it
        plan.put(_Failed(err))


def _serve(rows: _Rows, cache: dict, ahead: deque, plan: _Plan) -> bool:
    step, part, _ = ahead.popleft()
    batch = rows.gather(part, cache)
    needed = set().union(*(blocks for _, _, blocks in ahead))
    for block in [b for b in cache if b not in needed]:
        del cache[block]
    return plan.put((step, part, batch))


def _stop(plans: list[_Plan]) -> None:
    while plans:
        plans.pop().close()


class SplitStream:
    """One split of a committed dataset, read in row groups as training asks for rows.

    Args:
        dataset_url: the committed dataset.
        split: ``train``, ``validation`` or ``test``.
        schema: the columns to read (``None``: the dataset's own).
        window: row groups shuffled together (the layout's ``window``, which the order uses).
        prefetch: batches the background reader builds ahead of the training loop.
    """

    def __init__(
        self,
        dataset_url: str,
        split: str,
        schema: TableSchema | None = None,
        *,
        window: int,
        prefetch: int,
    ) -> None:
        self._rows = _Rows(ParquetSplit(dataset_url, split, schema))
        self.layout = Layout(self._rows.split.blocks or (0,), window)
        self.prefetch = prefetch
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the reading thread's
        self._direct: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._plans: list[_Plan] = []  # the running one, if any
        # Stops the thread when the stream is dropped, and before the interpreter exits
        # (a daemon thread killed inside Arrow's code aborts the process).
        self._finalizer = weakref.finalize(self, _stop, self._plans)

    def __len__(self) -> int:
        return int(self._rows.ends[-1])

    @property
    def row_groups_read(self) -> int:
        """Row groups read so far, by the reading thread and by direct reads."""
        return self._rows.split.reads

    def follow(self, position: Hashable, parts: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Read ahead the ``(step, rows)`` of ``parts``, which :meth:`batch` will be asked for
        in that order. ``position`` names where ``parts`` starts; a plan already at that
        position (the next steps of the one running) goes on, any other replaces it."""
        if self._plans and self._plans[0].position == position:
            return
        self.close()
        self._plans.append(_Plan(position, self._rows, self._cache, parts, self.prefetch))

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features, labels)`` of the rows at ``indices``: the read-ahead batch when they
        are the plan's next rows, else read now."""
        if self._plans:
            plan = self._plans[0]
            item = plan.out.get()
            if isinstance(item, _Failed):
                self.close()
                raise item.error
            if item is not None and torch.equal(item[1], indices):
                step, _, batch = item
                plan.position = (*plan.position[:3], step + 1, *plan.position[4:])
                return batch
            self.close()  # asked for other rows than planned: stop reading ahead
        return self._rows.gather(indices, self._direct)

    def close(self) -> None:
        """Stop the reading thread, if one runs."""
        _stop(self._plans)
