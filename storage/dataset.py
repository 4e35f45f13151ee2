"""Turn a raw CSV or Parquet drop into validated, split, content-addressed Parquet shards.

:func:`preprocess` reads a source file, checks every value against a :class:`TableSchema`,
writes the rows that fail aside (never dropping them silently), splits the rest into
train/validation/test stratified by label and writes the splits as Parquet shards under
``{output_url}/datasets/{fingerprint}``. The fingerprint covers the source bytes, the schema,
the split fractions and the seed, so the same inputs always land in the same directory.

A dataset directory exists only once its ``_manifest.json`` is there: the manifest is written
last and lists every shard with its size and SHA-256, so a half-written directory is never read
and a finished one is never rebuilt.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pv
import pyarrow.parquet as pq

from ringflow.storage.fs import atomic_write, join, read_bytes, resolve, sha256

__all__ = [
    "Column",
    "DataError",
    "PreprocessResult",
    "SchemaError",
    "TableSchema",
    "preprocess",
    "read_split",
]

SPLITS = ("train", "validation", "test")
_FORMAT = "ringflow.dataset/1"
_MANIFEST = "_manifest.json"
_REJECTED = "rejected.parquet"
_ACCEPTED = ".csv, .csv.gz, .parquet or a directory of .parquet files"

# A finite decimal or scientific number, or a spelled-out non-finite one (rejected later with
# its own reason, so "nan" is reported as "not finite" rather than "not a number").
_NUMBER = r"^[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|nan|inf|infinity)$"

# Beyond these magnitudes a value would be silently changed by its storage type: float32
# overflows to inf, and int columns pass through float64, exact only up to 2**53.
_LIMITS = {"float": float(np.finfo(np.float32).max), "int": 2.0**53}


@dataclass(frozen=True, kw_only=True)
class Column:
    """One column of a table: its name, type and the inclusive range of accepted values."""

    name: str
    """Header name in the source file."""
    dtype: Literal["float", "int"]
    """``"float"`` is stored as float32, ``"int"`` as int64 and accepts integral values only."""
    min: float | None = None
    """Smallest accepted value (inclusive); ``None`` for no lower bound."""
    max: float | None = None
    """Largest accepted value (inclusive); ``None`` for no upper bound."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Column name must be a non-empty string")
        if self.dtype not in ("float", "int"):
            raise ValueError(
                f"column {self.name}: dtype must be 'float' or 'int', got {self.dtype!r}"
            )
        # Normalised so that min=0 and min=0.0 describe (and fingerprint) the same schema.
        for bound in ("min", "max"):
            value = getattr(self, bound)
            if value is not None:
                object.__setattr__(self, bound, float(value))
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"column {self.name}: min {self.min} is greater than max {self.max}")


@dataclass(frozen=True, kw_only=True)
class TableSchema:
    """The columns a source must provide: model inputs and the class label to predict."""

    features: tuple[Column, ...]
    """Model inputs, in the order :func:`read_split` returns them."""
    label: Column
    """The class label; must be an ``"int"`` column because splits are stratified by class."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        if not self.features:
            raise ValueError("TableSchema needs at least one feature column")
        if self.label.dtype != "int":
            raise ValueError(f"label column {self.label.name} must have dtype 'int' (a class id)")
        names = [c.name for c in self.columns]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"TableSchema column names must be unique; repeated: {duplicates}")

    @property
    def columns(self) -> tuple[Column, ...]:
        """All columns, features first, then the label."""
        return (*self.features, self.label)


class DataError(ValueError):
    """A source or dataset cannot be used; the message says what to fix."""


class SchemaError(DataError):
    """The columns of a file do not match the schema."""


@dataclass(frozen=True, kw_only=True)
class PreprocessResult:
    """What :func:`preprocess` wrote (or found already written)."""

    dataset_url: str
    """URL of the committed dataset directory; pass it to :func:`read_split`."""
    fingerprint: str
    """SHA-256 hex digest of the source bytes, schema, split fractions and seed."""
    rows: dict[str, int]
    """Rows per split: ``{"train": n, "validation": n, "test": n}``."""
    source_rows: int
    """Data rows read from the source, valid and rejected."""
    rejected_rows: int
    """Rows that failed validation and were written to ``rejected_url``."""
    rejected_url: str | None
    """Parquet file of rejected rows with their reasons; ``None`` if no row was rejected."""


@dataclass(frozen=True, kw_only=True)
class _Source:
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


# --------------------------------------------------------------------------- preprocess


def preprocess(
    source_url: str,
    output_url: str,
    schema: TableSchema,
    *,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    seed: int = 0,
    rows_per_shard: int = 100_000,
) -> PreprocessResult:
    """Validate, split and shard ``source_url`` into ``{output_url}/datasets/{fingerprint}``.

    Rows with a bad value go to ``{dataset_url}/rejected.parquet`` with the columns
    ``source_row``, ``reason``, ``text`` and the schema columns as the raw strings read.
    ``source_row`` is the 1-based data row number: the header is not counted, and for CSV
    neither are blank lines, while a quoted value spanning lines counts once. In a CSV without
    blank lines or multi-line values the row sits on line ``source_row + 1``. ``text`` holds the
    raw record of CSV rows whose fields could not be split out (wrong field count).

    Calling again with the same source bytes, schema, fractions and seed returns the committed
    result without writing anything.

    Args:
        source_url: fsspec URL or local path of a ``.csv``, ``.csv.gz`` or ``.parquet`` file,
            or of a directory of ``.parquet`` files (read in sorted path order).
        output_url: fsspec URL or local path under which ``datasets/`` is created.
        schema: columns to read; other columns of the source are ignored.
        fractions: train, validation and test shares of every class; they sum to 1.
        seed: seed of the shuffle that assigns rows to splits.
        rows_per_shard: most rows in one Parquet shard.

    Raises:
        ValueError: an argument is out of range.
        SchemaError: the source lacks a schema column.
        DataError: the source does not exist, has an unsupported format, or has no valid row.
    """
    _check_arguments(fractions, seed, rows_per_shard)
    fractions = (float(fractions[0]), float(fractions[1]), float(fractions[2]))
    source = _load_source(source_url)
    fingerprint = _fingerprint(source, schema, fractions, seed)
    dataset_url = join(output_url, "datasets", fingerprint)
    existing = _committed_result(dataset_url, fingerprint)
    if existing is not None:
        return existing
    manifest = _build(
        source,
        schema,
        dataset_url=dataset_url,
        fingerprint=fingerprint,
        fractions=fractions,
        seed=seed,
        rows_per_shard=rows_per_shard,
    )
    # Last: until this file exists the directory is not a dataset, whatever else it holds.
    atomic_write(join(dataset_url, _MANIFEST), json.dumps(manifest, indent=2).encode())
    return _result(dataset_url, manifest)


def _build(
    source: _Source,
    schema: TableSchema,
    *,
    dataset_url: str,
    fingerprint: str,
    fractions: tuple[float, float, float],
    seed: int,
    rows_per_shard: int,
) -> dict[str, Any]:
    """Write the rejects and every shard; return the manifest that commits them."""
    rows = _read_rows(source, schema)
    values, problems = _validate(rows.table, schema)
    rejected = _rejects_table(rows, problems, schema)
    files = _write_rejects(dataset_url, rejected)
    valid = np.setdiff1d(np.arange(rows.table.num_rows), np.fromiter(problems, np.int64))
    if len(valid) == 0:
        raise DataError(
            f"all {rejected.num_rows} rows of {source.url} were rejected, nothing to train on; "
            f"see the reasons in {join(dataset_url, _REJECTED)}"
        )
    for split, order in _split(values[schema.label.name][valid], fractions, seed).items():
        table = _typed_table(values, schema, valid[order])
        files += _write_split(dataset_url, split, table, rows_per_shard)
    _remove_leftovers(dataset_url, files)
    return _manifest(
        source=source,
        fingerprint=fingerprint,
        schema=schema,
        fractions=fractions,
        seed=seed,
        files=files,
        source_rows=rows.table.num_rows + len(rows.unsplit),
        rejected_rows=rejected.num_rows,
    )


def _check_arguments(fractions: Any, seed: Any, rows_per_shard: Any) -> None:
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


def _fingerprint(
    source: _Source, schema: TableSchema, fractions: tuple[float, ...], seed: int
) -> str:
    identity = {
        "format": _FORMAT,
        "kind": source.kind,
        "files": [[name, sha256(data)] for name, data in source.files],
        "schema": _schema_json(schema),
        "fractions": list(fractions),
        "seed": seed,
    }
    return sha256(json.dumps(identity, sort_keys=True).encode())


def _schema_json(schema: TableSchema) -> dict[str, Any]:
    return {"features": [asdict(c) for c in schema.features], "label": asdict(schema.label)}


def _committed_result(dataset_url: str, fingerprint: str) -> PreprocessResult | None:
    """The result recorded by an earlier run, or ``None`` if no valid manifest exists."""
    fs, path = resolve(dataset_url)
    if not fs.exists(join(path, _MANIFEST)):
        return None
    try:
        manifest = _load_manifest(dataset_url)
    except DataError:
        return None  # a damaged manifest commits nothing; rebuilding replaces it
    if manifest.get("fingerprint") != fingerprint:
        return None
    return _result(dataset_url, manifest)


def _result(dataset_url: str, manifest: dict[str, Any]) -> PreprocessResult:
    rejected = manifest["rejected_rows"]
    return PreprocessResult(
        dataset_url=dataset_url,
        fingerprint=manifest["fingerprint"],
        rows=dict(manifest["rows"]),
        source_rows=manifest["source_rows"],
        rejected_rows=rejected,
        rejected_url=join(dataset_url, _REJECTED) if rejected else None,
    )


def _manifest(
    *,
    source: _Source,
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
        "format": _FORMAT,
        "fingerprint": fingerprint,
        "source_url": source.url,
        "schema": _schema_json(schema),
        "fractions": list(fractions),
        "seed": seed,
        "rows": {s: sum(f["rows"] for f in shards if f["split"] == s) for s in SPLITS},
        "source_rows": source_rows,
        "rejected_rows": rejected_rows,
        "files": files,
    }


# --------------------------------------------------------------------------- reading sources


def _load_source(url: str) -> _Source:
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
    return _Source(url=url, kind=kind, files=(("", fs.cat_file(path)),))


def _parquet_directory(url: str, fs: Any, path: str) -> _Source:
    prefix = path.rstrip("/") + "/"
    names = sorted(p[len(prefix) :] for p in fs.find(path) if p.endswith(".parquet"))
    # Names starting with _ or . are metadata or in-progress files of other writers.
    names = [n for n in names if not any(part[:1] in "_." for part in n.split("/"))]
    if not names:
        raise DataError(f"source directory {url} holds no .parquet files; expected {_ACCEPTED}")
    return _Source(
        url=url, kind="parquet", files=tuple((n, fs.cat_file(prefix + n)) for n in names)
    )


def _read_rows(source: _Source, schema: TableSchema) -> _Rows:
    if source.kind == "csv":
        return _read_csv(source.url, source.files[0][1], schema)
    tables = [
        _read_parquet(join(source.url, n) if n else source.url, d, schema) for n, d in source.files
    ]
    table = pa.concat_tables(tables)
    return _Rows(table=table, source_row=np.arange(1, table.num_rows + 1), unsplit=[])


def _read_parquet(url: str, data: bytes, schema: TableSchema) -> pa.Table:
    try:
        table = pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as err:
        raise DataError(f"{url} is not a readable Parquet file: {err}") from err
    _require_columns(url, table.column_names, schema)
    columns = {}
    for column in schema.columns:
        try:
            columns[column.name] = pc.cast(table[column.name], pa.string())
        except pa.ArrowException as err:
            kind = table.schema.field(column.name).type
            raise SchemaError(
                f"{url}: column {column.name} has type {kind}, expected numbers"
            ) from err
    return pa.table(columns)


def _read_csv(url: str, data: bytes, schema: TableSchema) -> _Rows:
    if url.lower().endswith(".gz"):
        data = _gunzip(url, data)
    header = _csv_header(url, data)
    _require_columns(url, header, schema)
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
                include_columns=[c.name for c in schema.columns],
            ),
        )
    except pa.ArrowException as err:
        raise DataError(f"{url} is not a readable UTF-8 CSV file: {err}") from err
    return _number_csv_rows(table, invalid)


def _gunzip(url: str, data: bytes) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError) as err:
        raise DataError(f"{url} is not a valid gzip file: {err}") from err


def _csv_header(url: str, data: bytes) -> list[str]:
    first = data.lstrip(b"\r\n").split(b"\n", 1)[0].rstrip(b"\r")
    if not first.strip():
        raise DataError(f"{url} is empty; it needs a header row naming the columns")
    return next(csv.reader([first.decode("utf-8-sig", errors="replace")]))


def _require_columns(url: str, found: list[str], schema: TableSchema) -> None:
    missing = [c.name for c in schema.columns if c.name not in found]
    if missing:
        raise SchemaError(
            f"{url} lacks the schema columns {missing}; columns found: {list(found)}. "
            "Rename the header or fix the schema."
        )
    repeated = sorted({c.name for c in schema.columns if found.count(c.name) > 1})
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


# --------------------------------------------------------------------------- validation


def _validate(table: pa.Table, schema: TableSchema) -> tuple[dict[str, np.ndarray], dict[int, str]]:
    """Parse every column; return the values and a reason for each row index that failed."""
    values: dict[str, np.ndarray] = {}
    reasons: dict[int, list[str]] = {}
    for column in schema.columns:
        values[column.name], problems = _check_column(column, table[column.name].combine_chunks())
        for index, reason in problems.items():
            reasons.setdefault(index, []).append(reason)
    return values, {i: "; ".join(r) for i, r in sorted(reasons.items())}


def _check_column(column: Column, raw: pa.Array) -> tuple[np.ndarray, dict[int, str]]:
    text = pc.utf8_trim_whitespace(raw)
    missing = _mask(pc.or_kleene(pc.is_null(text), pc.equal(text, "")))
    numeric = _mask(pc.match_substring_regex(text, _NUMBER, ignore_case=True)) & ~missing
    values = pc.cast(pc.if_else(numeric, text, "nan"), pa.float64()).to_numpy(zero_copy_only=False)
    low = -np.inf if column.min is None else column.min
    high = np.inf if column.max is None else column.max
    checks = [
        (missing, "value is missing"),
        (~numeric, "{!r} is not a number"),
        (~np.isfinite(values), "{!r} is not finite"),
        (column.dtype == "int" and values != np.round(values), "{!r} is not an integer"),
        (np.abs(values) > _LIMITS[column.dtype], f"{{}} does not fit a {column.dtype} column"),
        (values < low, f"{{}} is below the minimum {_number(column.min)}"),
        (values > high, f"{{}} is above the maximum {_number(column.max)}"),
    ]
    return values, _first_problems(column.name, text, checks)


def _first_problems(name: str, text: pa.Array, checks: list[tuple[Any, str]]) -> dict[int, str]:
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


def _number(value: float | None) -> str:
    return str(int(value)) if value is not None and value.is_integer() else str(value)


def _rejects_table(rows: _Rows, problems: dict[int, str], schema: TableSchema) -> pa.Table:
    """All rejected rows in source order, with the raw strings of their schema columns."""
    index = np.fromiter(problems, dtype=np.int64, count=len(problems))
    bad = rows.table.take(pa.array(index, type=pa.int64()))
    names = [c.name for c in schema.columns]
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
    return pa.concat_tables([unsplit, failed]).sort_by("source_row")


# --------------------------------------------------------------------------- split and write


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


def _typed_table(values: dict[str, np.ndarray], schema: TableSchema, index: np.ndarray) -> pa.Table:
    types = {"float": np.float32, "int": np.int64}
    return pa.table({c.name: values[c.name][index].astype(types[c.dtype]) for c in schema.columns})


def _write_split(dataset_url: str, split: str, table: pa.Table, rows_per_shard: int) -> list[dict]:
    """Write ``table`` as shards; an empty split still gets one (empty) shard with the schema."""
    files = []
    for number, start in enumerate(range(0, max(table.num_rows, 1), rows_per_shard)):
        shard = table.slice(start, rows_per_shard)
        files.append(
            _write_parquet(dataset_url, f"{split}/part-{number:05d}.parquet", shard, split)
        )
    return files


def _write_rejects(dataset_url: str, rejected: pa.Table) -> list[dict]:
    if rejected.num_rows == 0:
        return []
    return [_write_parquet(dataset_url, _REJECTED, rejected, None)]


def _write_parquet(dataset_url: str, name: str, table: pa.Table, split: str | None) -> dict:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    data = sink.getvalue()
    # Atomic so that a concurrent run with the same fingerprint never sees a torn shard.
    atomic_write(join(dataset_url, name), data)
    return {
        "split": split,
        "path": name,
        "rows": table.num_rows,
        "size": len(data),
        "sha256": sha256(data),
    }


def _remove_leftovers(dataset_url: str, files: list[dict]) -> None:
    """Delete shards of an interrupted earlier attempt that this attempt did not rewrite."""
    fs, path = resolve(dataset_url)
    keep = {join(path, f["path"]) for f in files}
    patterns = [join(path, s, "part-*.parquet") for s in SPLITS] + [join(path, _REJECTED)]
    for pattern in patterns:
        for stale in set(fs.glob(pattern)) - keep:
            fs.rm(stale)


# --------------------------------------------------------------------------- reading datasets


def read_split(dataset_url: str, split: str, schema: TableSchema) -> tuple[np.ndarray, np.ndarray]:
    """Read one split of a committed dataset, verifying every shard against the manifest.

    Returns:
        ``(features, labels)``: float32 of shape ``(n, len(schema.features))`` in schema order,
        and int64 of shape ``(n,)``.

    Raises:
        ValueError: ``split`` is not one of ``train``, ``validation``, ``test``.
        DataError: no valid manifest (the dataset was never committed) or a shard is missing
            or does not match its size and checksum.
        SchemaError: the dataset lacks a schema column or stores it with another dtype.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    manifest = _load_manifest(dataset_url)
    _check_stored_schema(dataset_url, manifest, schema)
    names = [c.name for c in schema.columns]
    shards = [f for f in manifest["files"] if f["split"] == split]
    table = pa.concat_tables([_read_shard(dataset_url, f, names) for f in shards])
    features = np.empty((table.num_rows, len(schema.features)), dtype=np.float32)
    for i, column in enumerate(schema.features):
        features[:, i] = table[column.name].to_numpy()
    return features, table[schema.label.name].to_numpy().astype(np.int64)


def _load_manifest(dataset_url: str) -> dict[str, Any]:
    url = join(dataset_url, _MANIFEST)
    try:
        manifest = json.loads(read_bytes(url))
    except FileNotFoundError as err:
        raise DataError(
            f"{dataset_url} is not a committed dataset: {_MANIFEST} is missing; run preprocess"
        ) from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{url} is not valid JSON ({err}); run preprocess again") from err
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise DataError(f"{url}: unknown dataset format; expected {_FORMAT!r}")
    return manifest


def _check_stored_schema(dataset_url: str, manifest: dict[str, Any], schema: TableSchema) -> None:
    stored = manifest["schema"]
    dtypes = {c["name"]: c["dtype"] for c in [*stored["features"], stored["label"]]}
    wrong = [c.name for c in schema.columns if dtypes.get(c.name) != c.dtype]
    if wrong:
        raise SchemaError(
            f"dataset {dataset_url} has no column of the requested dtype for {wrong}; "
            f"it stores {dtypes}"
        )


def _read_shard(dataset_url: str, entry: dict[str, Any], names: list[str]) -> pa.Table:
    url = join(dataset_url, entry["path"])
    try:
        data = read_bytes(url)
    except FileNotFoundError as err:
        raise DataError(
            f"shard {url} listed in the manifest is missing; run preprocess again"
        ) from err
    if len(data) != entry["size"] or sha256(data) != entry["sha256"]:
        raise DataError(f"shard {url} does not match its manifest size and checksum")
    return pq.read_table(pa.BufferReader(data), columns=names)
