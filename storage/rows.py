"""The steps both preprocessing engines take with a table's rows: listing and reading the
source (CSV, gzip'd CSV, Parquet), checking every value against the schema, keeping the
rejected rows with their reason, assigning splits, writing the Parquet shards, and
committing the dataset by its manifest, written last.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pv
import pyarrow.parquet as pq

from ringflow.storage.commit import commit_record
from ringflow.storage.fs import atomic_write, join, read_bytes, resolve, sha256
from ringflow.storage.schema import (
    FORMAT,
    LIMITS,
    MANIFEST,
    NUMBER_PATTERN,
    REJECTED,
    SPLITS,
    DataError,
    PreprocessResult,
    SchemaError,
    check_engine,
)

if TYPE_CHECKING:
    from ringflow.storage.schema import Column, TableSchema


_ACCEPTED = ".csv, .csv.gz, .parquet or a directory of .parquet files"


# Categories listed in full in a reason; longer lists are cut to this many.
_SHOWN_CATEGORIES = 10


@dataclass(frozen=True, kw_only=True)
class Listing:
    """The files of a source, in the order their rows are numbered; nothing read yet."""

    url: str
    kind: Literal["csv", "parquet"]
    names: tuple[str, ...]
    """File names relative to ``url``, sorted; ``("",)`` for a single file."""

    def file_url(self, name: str) -> str:
        return join(self.url, name) if name else self.url


@dataclass(frozen=True, kw_only=True)
class SourceFiles:
    """The raw bytes of a source, read once so that fingerprint and parse see the same data."""

    url: str
    kind: Literal["csv", "parquet"]
    files: tuple[tuple[str, bytes], ...]
    """(name relative to ``url``, bytes) per file; the name is ``""`` for a single file."""


@dataclass(frozen=True, kw_only=True)
class _Rows:
    """Source rows before value checks: the schema columns as strings, in source order."""

    table: pa.Table
    source_row: np.ndarray
    """1-based data row number of each row of ``table``."""
    unsplit: list[tuple[int, str, str]]
    """(source row, reason, raw text) of rows that could not be split into fields."""


def commit_dataset(dataset_url: str, manifest: dict[str, Any]) -> PreprocessResult:
    """Write the manifest, last: until it exists the directory is not a dataset, whatever
    else it holds."""
    commit_record(join(dataset_url, MANIFEST), manifest)
    return dataset_result(dataset_url, manifest)


def check_some_valid(source_url: str, dataset_url: str, valid: int, rejected: int) -> None:
    if valid == 0:
        raise DataError(
            f"all {rejected} rows of {source_url} were rejected, nothing to train on; "
            f"see the reasons in {join(dataset_url, REJECTED)}"
        )


def assign_splits(
    schema: TableSchema, labels: np.ndarray, fractions: tuple[float, ...], seed: int
) -> dict[str, np.ndarray]:
    """Positions into the valid rows (in source order) for each split, in the split's row
    order; ``labels`` are the valid rows' label values (category codes as numbers)."""
    if schema.task == "classification":
        return _split(labels, fractions, seed)
    return _shuffle_split(len(labels), fractions, seed)


def check_arguments(fractions: Any, seed: Any, rows_per_shard: Any, engine: Any = "auto") -> None:
    try:
        shares = [float(f) for f in fractions]
    except (TypeError, ValueError):
        shares = []
    if (
        len(shares) != 3
        or not all(math.isfinite(f) and f >= 0 for f in shares)
        or not math.isclose(sum(shares), 1.0, abs_tol=1e-9)
    ):
        raise ValueError(
            "fractions must be three non-negative numbers (train, validation, test) summing "
            f"to 1, got {fractions!r}"
        )
    if shares[0] <= 0:
        raise ValueError(f"fractions: the train share must be positive, got {fractions!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if (
        isinstance(rows_per_shard, bool)
        or not isinstance(rows_per_shard, int)
        or rows_per_shard < 1
    ):
        raise ValueError(f"rows_per_shard must be an integer of at least 1, got {rows_per_shard!r}")
    check_engine(engine)


def fingerprint_of(
    kind: str,
    digests: Sequence[tuple[str, str]],
    schema: TableSchema,
    fractions: tuple[float, ...],
    seed: int,
    rows_per_shard: int,
) -> str:
    """What the dataset is made of: the source files' SHA-256 (``(name, digest)`` in row
    order), the schema, the split and the shard size (which changes the shards written)."""
    identity = {
        "format": FORMAT,
        "kind": kind,
        "files": [[name, digest] for name, digest in digests],
        "schema": schema_json(schema),
        "fractions": list(fractions),
        "seed": seed,
        "rows_per_shard": rows_per_shard,
    }
    return sha256(json.dumps(identity, sort_keys=True).encode())


def schema_json(schema: TableSchema) -> dict[str, Any]:
    return schema.to_json()


def committed_result(dataset_url: str, fingerprint: str) -> PreprocessResult | None:
    """The result recorded by an earlier run, or ``None`` if no valid manifest exists."""
    fs, path = resolve(dataset_url)
    if not fs.exists(join(path, MANIFEST)):
        return None
    try:
        manifest = load_manifest(dataset_url)
    except DataError:
        return None  # a damaged manifest commits nothing; rebuilding replaces it
    if manifest.get("fingerprint") != fingerprint:
        return None
    return dataset_result(dataset_url, manifest)


def dataset_result(dataset_url: str, manifest: dict[str, Any]) -> PreprocessResult:
    rejected = manifest["rejected_rows"]
    return PreprocessResult(
        dataset_url=dataset_url,
        fingerprint=manifest["fingerprint"],
        rows=dict(manifest["rows"]),
        source_rows=manifest["source_rows"],
        rejected_rows=rejected,
        rejected_url=join(dataset_url, REJECTED) if rejected else None,
    )


def dataset_manifest(
    *,
    source_url: str,
    fingerprint: str,
    schema: TableSchema,
    fractions: tuple[float, ...],
    seed: int,
    files: list[dict[str, Any]],
    source_rows: int,
    rejected_rows: int,
) -> dict[str, Any]:
    shards = [f for f in files if f["split"] is not None]
    return {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "source_url": source_url,
        "schema": schema_json(schema),
        "fractions": list(fractions),
        "seed": seed,
        "rows": {s: sum(f["rows"] for f in shards if f["split"] == s) for s in SPLITS},
        "source_rows": source_rows,
        "rejected_rows": rejected_rows,
        "files": files,
    }


def load_source(url: str) -> SourceFiles:
    listing = list_source(url)
    files = tuple((n, read_bytes(listing.file_url(n))) for n in listing.names)
    return SourceFiles(url=url, kind=listing.kind, files=files)


def list_source(url: str) -> Listing:
    fs, path = resolve(url)
    if not fs.exists(path):
        raise DataError(f"source {url} does not exist; expected {_ACCEPTED}")
    if fs.isdir(path):
        return _parquet_directory(url, fs, path)
    name = path.lower()
    if name.endswith((".csv", ".csv.gz")):
        kind: Literal["csv", "parquet"] = "csv"
    elif name.endswith(".parquet"):
        kind = "parquet"
    else:
        raise DataError(f"source {url} has an unsupported format; expected {_ACCEPTED}")
    return Listing(url=url, kind=kind, names=("",))


def _parquet_directory(url: str, fs: Any, path: str) -> Listing:
    prefix = path.rstrip("/") + "/"
    names = sorted(p[len(prefix) :] for p in fs.find(path) if p.endswith(".parquet"))
    # Names starting with _ or . are metadata or in-progress files of other writers.
    names = [n for n in names if not any(part[:1] in "_." for part in n.split("/"))]
    if not names:
        raise DataError(f"source directory {url} holds no .parquet files; expected {_ACCEPTED}")
    return Listing(url=url, kind="parquet", names=tuple(names))


def read_rows(source: SourceFiles, names: list[str]) -> _Rows:
    """The columns ``names`` of every row of ``source``, as strings."""
    if source.kind == "csv":
        return _read_csv(source.url, source.files[0][1], names)
    tables = [
        _read_parquet(join(source.url, n) if n else source.url, d, names) for n, d in source.files
    ]
    table = pa.concat_tables(tables)
    return _Rows(table=table, source_row=np.arange(1, table.num_rows + 1), unsplit=[])


def file_rows(url: str, kind: str, data: bytes, names: list[str]) -> _Rows:
    """The rows of one file of a source, numbered from 1 within the file."""
    if kind == "csv":
        return _read_csv(url, data, names)
    table = _read_parquet(url, data, names)
    return _Rows(table=table, source_row=np.arange(1, table.num_rows + 1), unsplit=[])


def _read_parquet(url: str, data: bytes, names: list[str]) -> pa.Table:
    try:
        table = pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as err:
        raise DataError(f"{url} is not a readable Parquet file: {err}") from err
    require_columns(url, table.column_names, names)
    columns = {}
    for name in names:
        try:
            columns[name] = pc.cast(table[name], pa.string())
        except pa.ArrowException as err:
            kind = table.schema.field(name).type
            raise SchemaError(
                f"{url}: column {name} has type {kind}, expected numbers or text"
            ) from err
    return pa.table(columns)


def _read_csv(url: str, data: bytes, names: list[str]) -> _Rows:
    if url.lower().endswith(".gz"):
        data = gunzip(url, data)
    header = csv_header(url, data)
    require_columns(url, header, names)
    invalid: list[pv.InvalidRow] = []

    def keep_aside(row: pv.InvalidRow) -> str:
        invalid.append(row)
        return "skip"

    # Strings first: a bad value must become a reject naming it, not a failed read.
    # Single-threaded so that every invalid row knows its row number.
    try:
        table = pv.read_csv(
            pa.BufferReader(data),
            read_options=pv.ReadOptions(use_threads=False),
            parse_options=pv.ParseOptions(invalid_row_handler=keep_aside),
            convert_options=pv.ConvertOptions(
                column_types={name: pa.string() for name in header},
                include_columns=names,
            ),
        )
    except pa.ArrowException as err:
        raise DataError(f"{url} is not a readable UTF-8 CSV file: {err}") from err
    return _number_csv_rows(table, invalid)


def gunzip(url: str, data: bytes) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError) as err:
        raise DataError(f"{url} is not a valid gzip file: {err}") from err


def csv_header(url: str, data: bytes) -> list[str]:
    first = data.lstrip(b"\r\n").split(b"\n", 1)[0].rstrip(b"\r")
    if not first.strip():
        raise DataError(f"{url} is empty; it needs a header row naming the columns")
    return next(csv.reader([first.decode("utf-8-sig", errors="replace")]))


def require_columns(url: str, found: list[str], names: list[str]) -> None:
    missing = [n for n in names if n not in found]
    if missing:
        raise SchemaError(
            f"{url} lacks the schema columns {missing}; columns found: {list(found)}. "
            "Rename the header or fix the schema."
        )
    repeated = sorted({n for n in names if found.count(n) > 1})
    if repeated:
        raise SchemaError(f"{url} has more than one column named {repeated}; rename them")


def _number_csv_rows(table: pa.Table, invalid: list[pv.InvalidRow]) -> _Rows:
    """Give every row its data row number; pyarrow's row numbers count the header as 1."""
    if any(row.number is None or row.number < 1 for row in invalid):
        raise RuntimeError("pyarrow did not number the invalid CSV rows; read single-threaded")
    unsplit = [
        (
            row.number - 1,
            f"expected {row.expected_columns} fields, found {row.actual_columns}",
            row.text,
        )
        for row in invalid
    ]
    total = table.num_rows + len(invalid)
    skipped = np.array([number for number, _, _ in unsplit], dtype=np.int64)
    numbers = np.setdiff1d(np.arange(1, total + 1), skipped)
    return _Rows(table=table, source_row=numbers, unsplit=unsplit)


def validate_rows(
    table: pa.Table, schema: TableSchema, *, features_only: bool = False
) -> tuple[dict[str, np.ndarray], dict[int, str]]:
    """Parse every column (the features only, for a table to predict on, which has no label);
    return the values and a reason for each row index that failed.

    Values are float64, with a category's code as its value and NaN where a check failed.
    """
    values: dict[str, np.ndarray] = {}
    reasons: dict[int, list[str]] = {}
    for column in schema.features if features_only else schema.columns:
        text = pc.utf8_trim_whitespace(table[column.name].combine_chunks())
        missing = _mask(pc.or_kleene(pc.is_null(text), pc.equal(text, "")))
        if column.dtype == "category":
            values[column.name], checks = _category_checks(column, text, missing)
        else:
            values[column.name], checks = _number_checks(column, text, missing)
        if column.name == schema.label.name and schema.task == "classification":
            checks.append(_class_check(values[column.name], schema.classes))
        for index, reason in _first_problems(column.name, text, checks).items():
            reasons.setdefault(index, []).append(reason)
    return values, {i: "; ".join(r) for i, r in sorted(reasons.items())}


_Checks = list[tuple[Any, str]]
"""(mask of failing rows, reason template formatted with the raw value) in check order."""


def _number_checks(
    column: Column, text: pa.Array, missing: np.ndarray
) -> tuple[np.ndarray, _Checks]:
    numeric = _mask(pc.match_substring_regex(text, NUMBER_PATTERN, ignore_case=True)) & ~missing
    values = pc.cast(pc.if_else(numeric, text, "nan"), pa.float64()).to_numpy(zero_copy_only=False)
    low = -np.inf if column.min is None else column.min
    high = np.inf if column.max is None else column.max
    checks = [
        (missing, "value is missing"),
        (~numeric, "{!r} is not a number"),
        (~np.isfinite(values), "{!r} is not finite"),
        (column.dtype == "int" and values != np.round(values), "{!r} is not an integer"),
        (np.abs(values) > LIMITS[column.dtype], f"{{}} does not fit a {column.dtype} column"),
        (values < low, f"{{}} is below the minimum {number_text(column.min)}"),
        (values > high, f"{{}} is above the maximum {number_text(column.max)}"),
    ]
    return values, checks


def _category_checks(
    column: Column, text: pa.Array, missing: np.ndarray
) -> tuple[np.ndarray, _Checks]:
    assert column.categories is not None
    codes = pc.index_in(text, value_set=pa.array(column.categories, pa.string()))
    values = pc.cast(codes, pa.float64()).to_numpy(zero_copy_only=False)  # null -> NaN
    listed = _categories_text(column.categories).replace("{", "{{").replace("}", "}}")
    checks = [
        (missing, "value is missing"),
        (np.isnan(values), "{!r} is not one of the categories " + listed),
    ]
    return values, checks


def _class_check(values: np.ndarray, classes: int | None) -> tuple[np.ndarray, str]:
    """A class id is 0 .. classes - 1 (or any integer from 0 when the count is not known)."""
    if classes is None:
        return values < 0, "{} is not a class id (0 or more)"
    return (values < 0) | (values > classes - 1), f"{{}} is outside the classes 0..{classes - 1}"


def _categories_text(categories: tuple[str, ...]) -> str:
    """The categories as a list, cut short when long."""
    if len(categories) <= _SHOWN_CATEGORIES:
        return str(list(categories))
    shown = ", ".join(repr(c) for c in categories[: _SHOWN_CATEGORIES - 2])
    return f"[{shown}, ... {len(categories) - _SHOWN_CATEGORIES + 2} more]"


def _first_problems(name: str, text: pa.Array, checks: _Checks) -> dict[int, str]:
    """Report only the first failed check of a value: later ones assume the earlier passed."""
    failed = np.zeros(len(text), dtype=bool)
    problems: dict[int, str] = {}
    for mask, template in checks:
        hits = np.flatnonzero(mask & ~failed)
        for index in hits:
            problems[int(index)] = f"column {name}: " + template.format(text[int(index)].as_py())
        failed[hits] = True
    return problems


def _mask(array: pa.Array) -> np.ndarray:
    return pc.fill_null(array, False).to_numpy(zero_copy_only=False)


def number_text(value: float | None) -> str:
    return str(int(value)) if value is not None and value.is_integer() else str(value)


def rejects_table(
    rows: _Rows, problems: dict[int, str], schema: TableSchema, *, features_only: bool = False
) -> pa.Table:
    """The rejected rows, with the raw strings of their schema columns (the features only,
    as :func:`validate_rows` checked them) (for :func:`sorted_rejects`)."""
    index = np.fromiter(problems, dtype=np.int64, count=len(problems))
    bad = rows.table.take(pa.array(index, type=pa.int64()))
    names = [c.name for c in (schema.features if features_only else schema.columns)]
    unsplit = pa.table(
        {
            "source_row": pa.array([r for r, _, _ in rows.unsplit], pa.int64()),
            "reason": pa.array([why for _, why, _ in rows.unsplit], pa.string()),
            "text": pa.array([text for _, _, text in rows.unsplit], pa.string()),
            **{n: pa.nulls(len(rows.unsplit), pa.string()) for n in names},
        }
    )
    failed = pa.table(
        {
            "source_row": pa.array(rows.source_row[index], pa.int64()),
            "reason": pa.array(list(problems.values()), pa.string()),
            "text": pa.nulls(len(index), pa.string()),
            **{n: bad[n] for n in names},
        }
    )
    return pa.concat_tables([unsplit, failed])


def sorted_rejects(parts: Sequence[pa.Table]) -> pa.Table:
    """Rejected rows of every part in ``source_row`` order, as one chunk: what is written."""
    return pa.concat_tables(parts).sort_by("source_row").combine_chunks()


def _split(labels: np.ndarray, fractions: tuple[float, ...], seed: int) -> dict[str, np.ndarray]:
    """Positions into ``labels`` for each split, cut per class so each keeps the class balance."""
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    _, starts = np.unique(labels[order], return_index=True)
    cuts = np.cumsum(fractions)[:2]
    parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    for members in np.split(order, starts[1:]):
        shuffled = rng.permutation(members)
        bounds = np.rint(len(shuffled) * cuts).astype(int)
        for split, chunk in zip(SPLITS, np.split(shuffled, bounds), strict=True):
            parts[split].append(chunk)
    # Shuffled again so that a split's rows are not grouped by class.
    return {s: rng.permutation(np.concatenate(parts[s])) for s in SPLITS}


def _shuffle_split(rows: int, fractions: tuple[float, ...], seed: int) -> dict[str, np.ndarray]:
    """Positions ``0 .. rows - 1`` for each split: one seeded shuffle, cut by the fractions."""
    shuffled = np.random.default_rng(seed).permutation(rows)
    bounds = np.rint(rows * np.cumsum(fractions)[:2]).astype(int)
    return dict(zip(SPLITS, np.split(shuffled, bounds), strict=True))


def typed_table(values: dict[str, np.ndarray], schema: TableSchema, index: np.ndarray) -> pa.Table:
    return pa.table(
        {c.name: values[c.name][index].astype(_storage_type(schema, c)) for c in schema.columns}
    )


def _storage_type(schema: TableSchema, column: Column) -> type[np.generic]:
    """float32 for floats and a regression's label, int64 for ints and category codes."""
    if column.name == schema.label.name and schema.task == "regression":
        return np.float32
    return np.float32 if column.dtype == "float" else np.int64


def write_split(dataset_url: str, split: str, table: pa.Table, rows_per_shard: int) -> list[dict]:
    """Write ``table`` as shards; an empty split still gets one (empty) shard with the schema."""
    files = []
    for number, start in enumerate(range(0, max(table.num_rows, 1), rows_per_shard)):
        shard = table.slice(start, rows_per_shard)
        files.append(write_parquet(dataset_url, f"{split}/part-{number:05d}.parquet", shard, split))
    return files


def write_rejects(dataset_url: str, rejected: pa.Table) -> list[dict]:
    if rejected.num_rows == 0:
        return []
    return [write_parquet(dataset_url, REJECTED, rejected, None)]


def write_parquet(dataset_url: str, name: str, table: pa.Table, split: str | None) -> dict:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    data = sink.getvalue()
    # Atomic so that a concurrent run with the same fingerprint never sees a torn shard.
    atomic_write(join(dataset_url, name), data)
    entry = {
        "split": split,
        "path": name,
        "rows": table.num_rows,
        "size": len(data),
        "sha256": sha256(data),
    }
    if split is not None:  # what a streaming reader, which reads row groups, checks
        metadata = pq.read_metadata(pa.BufferReader(data))
        entry["row_groups"] = row_group_entries(metadata, lambda at, size: data[at : at + size])
    return entry


def row_group_range(group: pq.RowGroupMetaData) -> tuple[int, int]:
    """``(offset, size)`` of a row group's bytes in its file: its column chunks, which a
    Parquet writer stores one after the other."""
    starts, ends = [], []
    for i in range(group.num_columns):
        chunk = group.column(i)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
        start = chunk.data_page_offset if start is None else start
        starts.append(start)
        ends.append(start + chunk.total_compressed_size)
    return min(starts), max(ends) - min(starts)


def row_group_entries(
    metadata: pq.FileMetaData, read: Callable[[int, int], bytes]
) -> list[dict[str, Any]]:
    """Each row group's ``rows``, ``offset``, ``size`` and ``sha256`` of its bytes, for a
    shard's manifest entry; ``read(offset, size)`` gives the file's bytes."""
    entries = []
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        offset, size = row_group_range(group)
        digest = sha256(read(offset, size))
        entries.append({"rows": group.num_rows, "offset": offset, "size": size, "sha256": digest})
    return entries


def remove_leftovers(dataset_url: str, files: list[dict]) -> None:
    """Delete shards of an interrupted earlier attempt that this attempt did not rewrite."""
    fs, path = resolve(dataset_url)
    keep = {join(path, f["path"]) for f in files}
    patterns = [join(path, s, "part-*.parquet") for s in SPLITS] + [join(path, REJECTED)]
    for pattern in patterns:
        for stale in set(fs.glob(pattern)) - keep:
            fs.rm(stale)


def load_manifest(dataset_url: str) -> dict[str, Any]:
    url = join(dataset_url, MANIFEST)
    try:
        manifest = json.loads(read_bytes(url))
    except FileNotFoundError as err:
        raise DataError(
            f"{dataset_url} is not a committed dataset: {MANIFEST} is missing; run preprocess"
        ) from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{url} is not valid JSON ({err}); run preprocess again") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{url}: unknown dataset format; expected {FORMAT!r}")
    return manifest
