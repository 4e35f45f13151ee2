"""Preprocessing as a Ray Data job: the dataset :func:`storage.dataset.preprocess` writes, byte
for byte, with the reading, validation and shard writing spread over a Ray cluster.

The job runs in four passes over the source files (listed and ordered as the single-process
path lists them):

1. every file's SHA-256, one task per file, streamed: the fingerprint, hence the dataset's
   directory, is known before anything is parsed, and a committed dataset is returned as is;
2. every file is read and validated in ``map_batches``, one task per file, by the same
   functions the single-process path calls (``file_rows``, ``validate_rows``, ``rejects_table``):
   each output row carries its file index and 1-based row number within the file, valid rows
   their parsed values, rejected rows their reason and raw strings;
3. the driver collects ``(file, row, valid, label)`` of every row, numbers the rows globally
   (files in listing order, rows in file order: no dependence on Ray Data's block order) and
   assigns the valid rows to splits with the single-process path's seeded split;
4. each row is sent to its shard (``groupby`` on split and shard number) and each shard is
   written by one task with the single-process path's writer; the driver writes the rejects,
   the empty splits' shards and, last, the manifest.

The driver holds about 50 bytes per source row (row numbers, labels and destinations), the
workers one file (reading) or one shard (writing) each. A single CSV file is read by one task,
as Ray Data reads any one CSV file; a directory of Parquet files is read in parallel.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ringflow.storage.fs import join, resolve
from ringflow.storage.rows import (
    Listing,
    assign_splits,
    check_arguments,
    check_some_valid,
    commit_dataset,
    committed_result,
    dataset_manifest,
    file_rows,
    fingerprint_of,
    list_source,
    rejects_table,
    remove_leftovers,
    sorted_rejects,
    typed_table,
    validate_rows,
    write_parquet,
    write_rejects,
    write_split,
)
from ringflow.storage.schema import SPLITS, DataError, PreprocessResult, TableSchema

__all__ = ["preprocess_with_ray"]

# A shard's group key: the split's index above these bits, the shard's number below.
_SHARD_BITS = 40
# Rows per block the parsing tasks emit: blocks of a few MB whatever a file's size.
_BLOCK_ROWS = 65_536
_HASH_CHUNK = 16 << 20
# Shuffle partitions that route rows to their shards, at most (Ray Data's default number).
_MAX_PARTITIONS = 200
# What Ray Data appends to the message of an exception raised in a task (advice on retries).
_RAY_ADVICE = "\nFailed to apply UDF transform"


def preprocess_with_ray(
    source_url: str,
    output_url: str,
    schema: TableSchema,
    *,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    seed: int = 0,
    rows_per_shard: int = 100_000,
) -> PreprocessResult:
    """:func:`storage.dataset.preprocess` as a Ray Data job; the same arguments, the same
    dataset (directory, shards, rejects and manifest), the same errors.

    Runs on the Ray this process is connected to; Ray Data starts a local one otherwise.
    """
    check_arguments(fractions, seed, rows_per_shard)
    fractions = (float(fractions[0]), float(fractions[1]), float(fractions[2]))
    listing = list_source(source_url)
    with _data_errors():
        digests = _digests(listing)
        fingerprint = fingerprint_of(listing.kind, digests, schema, fractions, seed, rows_per_shard)
        dataset_url = join(output_url, "datasets", fingerprint)
        existing = committed_result(dataset_url, fingerprint)
        if existing is not None:
            return existing
        parsed = _parse(listing, schema)
        keys = _row_keys(parsed, schema)
        rejected = _collect_rejects(parsed, keys.offsets, schema)
        files = write_rejects(dataset_url, rejected)
        check_some_valid(source_url, dataset_url, int(keys.valid.sum()), rejected.num_rows)
        destinations = _destinations(keys, schema, fractions, seed)
        files += _write_shards(parsed, destinations, dataset_url, schema, rows_per_shard)
    remove_leftovers(dataset_url, files)
    manifest = dataset_manifest(
        source_url=source_url,
        fingerprint=fingerprint,
        schema=schema,
        fractions=fractions,
        seed=seed,
        files=files,
        source_rows=int(keys.offsets[-1]),
        rejected_rows=rejected.num_rows,
    )
    return commit_dataset(dataset_url, manifest)


@contextmanager
def _data_errors() -> Iterator[None]:
    """Raise a bad source's :class:`DataError` (raised in a Ray task) as the single-process
    path raises it: its own type and message, without Ray's wrapping."""
    try:
        yield
    except Exception as err:
        found = _data_error_in(err)
        if found is None:
            raise
        message = str(found).split(_RAY_ADVICE, 1)[0]
        if found is err and message == str(err):
            raise  # raised here, not in a task
        raise type(found)(message) from err


def _data_error_in(err: BaseException) -> DataError | None:
    from ray.exceptions import RayTaskError

    # The exception as the task raised it is a RayTaskError's cause; the one Ray Data raises
    # in the driver has Ray's advice on retries appended to its message.
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    found = None
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, RayTaskError) and isinstance(current.cause, DataError):
            return current.cause
        if found is None and isinstance(current, DataError):
            found = current
        pending += [current.__cause__, current.__context__, getattr(current, "cause", None)]
    return found


# --------------------------------------------------------------------------- 1. fingerprint


def _digests(listing: Listing) -> list[tuple[str, str]]:
    """``(name, SHA-256)`` of every file, in listing order."""
    import ray.data

    items = [{"file": i, "name": n} for i, n in enumerate(listing.names)]
    rows = (
        ray.data.from_items(items, override_num_blocks=len(items))
        .map(_digest, fn_kwargs={"source_url": listing.url})
        .take_all()
    )
    return [(r["name"], r["sha256"]) for r in sorted(rows, key=lambda r: r["file"])]


def _digest(row: dict[str, Any], *, source_url: str) -> dict[str, Any]:
    fs, path = resolve(join(source_url, row["name"]) if row["name"] else source_url)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return {**row, "sha256": digest.hexdigest()}


# --------------------------------------------------------------------------- 2. read, validate


def _parse(listing: Listing, schema: TableSchema) -> Any:
    """Every row of every file, validated, as a materialized Ray Dataset of ``file``, ``row``
    (1-based in its file), ``reason`` (null for a valid row), ``text``, ``value{i}`` (float64,
    schema column ``i`` parsed) and ``raw{i}`` (its string, rejected rows only)."""
    import ray.data

    items = [{"file": i, "name": n} for i, n in enumerate(listing.names)]
    return (
        ray.data.from_items(items, override_num_blocks=len(items))
        .map_batches(
            _parse_files,
            batch_size=1,
            batch_format="pyarrow",
            fn_kwargs={"source_url": listing.url, "kind": listing.kind, "schema": schema},
        )
        .materialize()
    )


def _parse_files(
    batch: pa.Table, *, source_url: str, kind: str, schema: TableSchema
) -> Iterator[pa.Table]:
    from ringflow.storage.fs import read_bytes

    names = [c.name for c in schema.columns]
    for file, name in zip(batch["file"].to_pylist(), batch["name"].to_pylist(), strict=True):
        url = join(source_url, name) if name else source_url
        table = _validated(file, file_rows(url, kind, read_bytes(url), names), schema)
        for start in range(0, table.num_rows, _BLOCK_ROWS):
            yield table.slice(start, _BLOCK_ROWS)


def _validated(file: int, rows: Any, schema: TableSchema) -> pa.Table:
    """One file's rows, checked by the single-process path's validation."""
    values, problems = validate_rows(rows.table, schema)
    rejected = rejects_table(rows, problems, schema)
    valid = np.ones(rows.table.num_rows, dtype=bool)
    valid[np.fromiter(problems, np.int64, count=len(problems))] = False
    valid_rows = np.flatnonzero(valid)
    good = {
        "file": np.full(len(valid_rows), file, dtype=np.int32),
        "row": rows.source_row[valid_rows].astype(np.int64),
        "reason": pa.nulls(len(valid_rows), pa.string()),
        "text": pa.nulls(len(valid_rows), pa.string()),
    }
    bad = {
        "file": np.full(rejected.num_rows, file, dtype=np.int32),
        "row": rejected["source_row"].combine_chunks(),
        "reason": rejected["reason"].combine_chunks(),
        "text": rejected["text"].combine_chunks(),
    }
    for i, column in enumerate(schema.columns):
        good[f"value{i}"] = values[column.name][valid_rows]
        good[f"raw{i}"] = pa.nulls(len(valid_rows), pa.string())
        bad[f"value{i}"] = np.full(rejected.num_rows, np.nan)
        bad[f"raw{i}"] = rejected[column.name].combine_chunks().cast(pa.string())
    return pa.concat_tables([pa.table(good), pa.table(bad)])


# --------------------------------------------------------------------------- 3. number, split


class _RowKeys:
    """Every source row's place and whether it is valid, in the global row order."""

    def __init__(self, file: np.ndarray, row: np.ndarray, valid: np.ndarray, label: np.ndarray):
        counts = np.bincount(file, minlength=1)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        """Rows before each file (and, last, all rows): a row's global index is
        ``offsets[file] + row - 1``."""
        position = self.offsets[file] + row - 1
        order = np.argsort(position, kind="stable")
        if not np.array_equal(position[order], np.arange(len(position))):
            raise RuntimeError("the parsed rows do not number each source row once")
        self.valid = valid[order]
        self.labels = label[order][self.valid]
        """Label values of the valid rows, in source order."""


def _row_keys(parsed: Any, schema: TableSchema) -> _RowKeys:
    label = f"value{len(schema.columns) - 1}"
    blocks = [
        pa.table(
            {
                "file": b["file"],
                "row": b["row"],
                "valid": pc.is_null(b["reason"]),
                "label": b[label],
            }
        )
        for b in parsed.iter_batches(batch_size=None, batch_format="pyarrow")
    ]
    table = pa.concat_tables(blocks) if blocks else _empty_keys()
    return _RowKeys(
        table["file"].to_numpy(),
        table["row"].to_numpy(),
        table["valid"].to_numpy(),
        table["label"].to_numpy(),
    )


def _empty_keys() -> pa.Table:
    return pa.table(
        {
            "file": pa.array([], pa.int32()),
            "row": pa.array([], pa.int64()),
            "valid": pa.array([], pa.bool_()),
            "label": pa.array([], pa.float64()),
        }
    )


def _collect_rejects(parsed: Any, offsets: np.ndarray, schema: TableSchema) -> pa.Table:
    """The rejected rows, numbered in the whole source, as the single-process path has them."""
    blocks = list(
        parsed.map_batches(_rejected_only, batch_format="pyarrow").iter_batches(
            batch_size=None, batch_format="pyarrow"
        )
    )
    table = pa.concat_tables(blocks) if blocks else _rejected_only(_empty_parsed(schema))
    source_row = offsets[table["file"].to_numpy()] + table["row"].to_numpy()
    rejects = {
        "source_row": pa.array(source_row, pa.int64()),
        "reason": table["reason"].cast(pa.string()),
        "text": table["text"].cast(pa.string()),
        **{c.name: table[f"raw{i}"].cast(pa.string()) for i, c in enumerate(schema.columns)},
    }
    return sorted_rejects([pa.table(rejects)])


def _rejected_only(batch: pa.Table) -> pa.Table:
    keep = [n for n in batch.column_names if not n.startswith("value")]
    return batch.filter(pc.is_valid(batch["reason"])).select(keep)


def _empty_parsed(schema: TableSchema) -> pa.Table:
    columns: dict[str, pa.Array] = {
        "file": pa.array([], pa.int32()),
        "row": pa.array([], pa.int64()),
        "reason": pa.array([], pa.string()),
        "text": pa.array([], pa.string()),
    }
    for i in range(len(schema.columns)):
        columns[f"value{i}"] = pa.array([], pa.float64())
        columns[f"raw{i}"] = pa.array([], pa.string())
    return pa.table(columns)


def _destinations(
    keys: _RowKeys, schema: TableSchema, fractions: tuple[float, ...], seed: int
) -> dict[str, np.ndarray]:
    """Per global row: its split's index (-1 for a rejected row) and its position in the
    split, as the single-process path assigns them."""
    valid_rows = np.flatnonzero(keys.valid)
    split = np.full(len(keys.valid), -1, dtype=np.int8)
    position = np.zeros(len(keys.valid), dtype=np.int64)
    splits = assign_splits(schema, keys.labels, fractions, seed)
    for index, name in enumerate(SPLITS):
        rows = valid_rows[splits[name]]
        split[rows] = index
        position[rows] = np.arange(len(rows))
    return {"offsets": keys.offsets, "split": split, "position": position}


# --------------------------------------------------------------------------- 4. write shards


def _write_shards(
    parsed: Any,
    destinations: dict[str, np.ndarray],
    dataset_url: str,
    schema: TableSchema,
    rows_per_shard: int,
) -> list[dict[str, Any]]:
    """Write every split's shards; return their manifest entries in the single-process
    path's order (splits in order, shards by number)."""
    import ray

    shards = _shard_count(destinations, rows_per_shard)
    written = _write_routed(
        parsed, ray.put(destinations), dataset_url, schema, rows_per_shard, shards
    )
    entries: dict[str, list[tuple[int, dict]]] = {s: [] for s in SPLITS}
    for row in written:
        entries[SPLITS[row["split"]]].append((row["number"], json.loads(row["entry"])))
    files = []
    for index, split in enumerate(SPLITS):
        if not entries[split]:  # an empty split still gets one (empty) shard with the schema
            empty = typed_table(_empty_values(schema), schema, np.zeros(0, dtype=np.int64))
            files += write_split(dataset_url, split, empty, rows_per_shard)
            continue
        found = sorted(entries[split], key=lambda e: e[0])
        expected = int(np.ceil((destinations["split"] == index).sum() / rows_per_shard))
        if [n for n, _ in found] != list(range(expected)):
            raise RuntimeError(f"split {split}: shards {[n for n, _ in found]} were written")
        files += [entry for _, entry in found]
    return files


def _write_routed(
    parsed: Any,
    where: Any,
    dataset_url: str,
    schema: TableSchema,
    rows_per_shard: int,
    shards: int,
) -> list[dict[str, Any]]:
    """Route the valid rows to their shards and write each shard in one task; one row per
    shard: ``split`` (index), ``number`` and its manifest ``entry`` as JSON."""
    from ray.data.context import ShuffleStrategy

    routed = parsed.map_batches(
        _routed,
        batch_format="pyarrow",
        fn_kwargs={"where": where, "rows_per_shard": rows_per_shard},
    )
    # Ray Data's default shuffle starts aggregator actors, seconds each (every one imports
    # this package) and holding CPUs after the job; the sort-based shuffle runs as tasks.
    # The context is this dataset's own copy.
    routed.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    return (
        routed.groupby("group", num_partitions=max(1, min(shards, _MAX_PARTITIONS)))
        .map_groups(
            _write_shard,
            batch_format="pyarrow",
            fn_kwargs={
                "dataset_url": dataset_url,
                "schema": schema,
                "rows_per_shard": rows_per_shard,
            },
        )
        .take_all()
    )


def _shard_count(destinations: dict[str, np.ndarray], rows_per_shard: int) -> int:
    """Shards of all splits together, empty splits not counted."""
    counts = np.bincount(destinations["split"][destinations["split"] >= 0], minlength=3)
    return int(sum(-(-int(count) // rows_per_shard) for count in counts))


def _empty_values(schema: TableSchema) -> dict[str, np.ndarray]:
    return {c.name: np.zeros(0) for c in schema.columns}


def _routed(batch: pa.Table, *, where: Any, rows_per_shard: int) -> pa.Table:
    """The valid rows of ``batch`` with their shard (``group``) and position in the split."""
    if not isinstance(where, dict):  # an ObjectRef not resolved by the task's arguments
        import ray

        where = ray.get(where)
    batch = batch.filter(pc.is_null(batch["reason"]))
    index = where["offsets"][batch["file"].to_numpy()] + batch["row"].to_numpy() - 1
    split = where["split"][index].astype(np.int64)
    position = where["position"][index]
    if np.any(split < 0):
        raise RuntimeError("a valid row has no split")
    group = (split << _SHARD_BITS) + position // rows_per_shard
    values = [n for n in batch.column_names if n.startswith("value")]
    return pa.table({"group": group, "position": position, **{n: batch[n] for n in values}})


def _write_shard(
    group: pa.Table, *, dataset_url: str, schema: TableSchema, rows_per_shard: int
) -> pa.Table:
    """One shard: its rows in split order, written as the single-process path writes it."""
    key = int(group["group"][0].as_py())
    split, number = key >> _SHARD_BITS, key & ((1 << _SHARD_BITS) - 1)
    position = group["position"].to_numpy()
    order = np.argsort(position, kind="stable")
    first = number * rows_per_shard
    if not np.array_equal(position[order], np.arange(first, first + len(order))):
        raise RuntimeError(f"shard {number} of split {SPLITS[split]} is not contiguous")
    values = {c.name: group[f"value{i}"].to_numpy() for i, c in enumerate(schema.columns)}
    table = typed_table(values, schema, order)
    path = f"{SPLITS[split]}/part-{number:05d}.parquet"
    entry = write_parquet(dataset_url, path, table, SPLITS[split])
    return pa.table({"split": [split], "number": [number], "entry": [json.dumps(entry)]})
