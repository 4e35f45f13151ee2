"""Turn a raw CSV or Parquet drop into validated, split, content-addressed Parquet shards.

:func:`preprocess` reads a source file, checks every value against a :class:`TableSchema`,
writes the rows that fail aside (never dropping them silently), splits the rest into
train/validation/test (stratified by class for a classification, a seeded shuffle for a
regression) and writes the splits as Parquet shards under ``{output_url}/datasets/{fingerprint}``.
The fingerprint covers the source bytes, the schema, the split fractions and the seed, so the
same inputs always land in the same directory. :func:`infer_schema` proposes the schema of a
user's own file.

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
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from numbers import Real
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
    "ENGINES",
    "RAY_CLUSTER_PREPROCESS_BYTES",
    "RAY_PREPROCESS_BYTES",
    "PreprocessResult",
    "SchemaError",
    "TableSchema",
    "commit_manifest",
    "choose_engine",
    "dataset_schema",
    "infer_schema",
    "preprocess",
    "read_split",
    "row_group_entries",
    "row_group_range",
    "split_shards",
    "table_arrays",
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

# How :func:`infer_schema` decides: an int label with more distinct values than this (or a
# negative one) is a number to predict, not a class id.
_MAX_INFERRED_CLASSES = 1000
# A pandas index written into a Parquet file as a column; not a feature by default.
_PANDAS_INDEX = r"^__index_level_\d+__$"
# Categories listed in full in a reason; longer lists are cut to this many.
_SHOWN_CATEGORIES = 10

ENGINES = ("auto", "local", "ray")
"""How :func:`preprocess` runs: ``"local"`` in this process, ``"ray"`` as a Ray Data job
(:mod:`ringflow.storage.ray_preprocess`), ``"auto"`` chooses (:func:`choose_engine`)."""

RAY_PREPROCESS_BYTES = 1 << 30
"""``engine="auto"`` runs a source of at least this many bytes (1 GiB, all files together)
on Ray Data: below it, one process is done before a Ray Data job has started its tasks."""

RAY_CLUSTER_PREPROCESS_BYTES = 64 << 20
"""The same threshold when ``RAY_ADDRESS`` names a cluster (64 MiB): a cluster's CPUs read a
directory of files in parallel and spare the flow's process the source's memory, but a small
source is still read in one process in well under a second, where a job costs seconds
(its tasks scheduled and started on the cluster's workers, e.g. 4 to 7 s on a 2-CPU head)."""


TASKS = ("classification", "regression")
"""What a dataset's label is: a class id to predict, or a number."""


@dataclass(frozen=True, kw_only=True)
class Column:
    """One column of a table: its name, type and the values it accepts."""

    name: str
    """Header name in the source file."""
    dtype: Literal["float", "int", "category"]
    """``"float"`` is stored as float32, ``"int"`` as int64 and accepts integral values only,
    ``"category"`` accepts one of ``categories`` and is stored as its index (int64)."""
    min: float | None = None
    """Smallest accepted value (inclusive); ``None`` for no lower bound. Numbers only."""
    max: float | None = None
    """Largest accepted value (inclusive); ``None`` for no upper bound. Numbers only."""
    categories: tuple[str, ...] | None = None
    """The values a ``"category"`` column accepts, in the order of their codes."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Column name must be a non-empty string")
        if self.dtype not in ("float", "int", "category"):
            raise ValueError(
                f"column {self.name}: dtype must be 'float', 'int' or 'category', "
                f"got {self.dtype!r}"
            )
        # Normalised so that min=0 and min=0.0 describe (and fingerprint) the same schema.
        for bound in ("min", "max"):
            value = getattr(self, bound)
            if value is not None:
                object.__setattr__(self, bound, float(value))
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"column {self.name}: min {self.min} is greater than max {self.max}")
        if self.dtype == "category":
            if not self.categories or self.min is not None or self.max is not None:
                raise ValueError(
                    f"column {self.name}: a category column lists its categories and has no "
                    "min or max"
                )
            object.__setattr__(self, "categories", tuple(str(c) for c in self.categories))
            if len(set(self.categories)) != len(self.categories):
                raise ValueError(f"column {self.name}: categories must be unique")
        elif self.categories is not None:
            raise ValueError(f"column {self.name}: only a 'category' column has categories")


@dataclass(frozen=True, kw_only=True)
class TableSchema:
    """The columns a source must provide: model inputs and the target to predict."""

    features: tuple[Column, ...]
    """Model inputs, in the order :func:`read_split` returns them."""
    label: Column
    """The target: a class id (an ``"int"`` from 0, or a ``"category"``) for classification,
    a number for regression."""
    task: Literal["classification", "regression"] = "classification"
    """Classification (splits are stratified by class) or regression."""
    classes: int | None = None
    """Classification: the number of classes, labels ``0 .. classes - 1``; ``None`` means
    ``label.max + 1`` (or the number of categories)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        if not self.features:
            raise ValueError("TableSchema needs at least one feature column")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        names = [c.name for c in self.columns]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"TableSchema column names must be unique; repeated: {duplicates}")
        if self.task == "regression":
            if self.label.dtype == "category":
                raise ValueError(
                    f"label column {self.label.name} is a category: use task 'classification'"
                )
            if self.classes is not None:
                raise ValueError("classes is for classification; a regression has none")
            return
        if self.label.dtype == "float":
            raise ValueError(
                f"label column {self.label.name} has dtype 'float': a class label is an 'int' "
                "or a 'category'; use task 'regression' to predict a number"
            )
        if self.classes is None:
            object.__setattr__(self, "classes", self._classes_from_label())
        if isinstance(self.classes, bool) or not isinstance(self.classes, int) or self.classes < 1:
            raise ValueError(f"classes must be a positive integer, got {self.classes!r}")

    def _classes_from_label(self) -> int | None:
        if self.label.categories is not None:
            return len(self.label.categories)
        return None if self.label.max is None else int(self.label.max) + 1

    @property
    def columns(self) -> tuple[Column, ...]:
        """All columns, features first, then the label."""
        return (*self.features, self.label)

    @property
    def input_dim(self) -> int:
        """The number of feature columns: the width of a model's input."""
        return len(self.features)

    def to_json(self) -> dict[str, Any]:
        """A JSON object that :meth:`from_json` turns back into this schema."""
        return {
            "features": [_column_json(c) for c in self.features],
            "label": _column_json(self.label),
            "task": self.task,
            "classes": self.classes,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> TableSchema:
        """The schema recorded by :meth:`to_json` (in a manifest or a model checkpoint)."""
        return cls(
            features=tuple(_column_from_json(c) for c in value["features"]),
            label=_column_from_json(value["label"]),
            task=value.get("task", "classification"),
            classes=value.get("classes"),
        )


def _column_json(column: Column) -> dict[str, Any]:
    value = asdict(column)
    if column.categories is None:
        del value["categories"]
    else:
        value["categories"] = list(column.categories)
    return value


def _column_from_json(value: dict[str, Any]) -> Column:
    categories = value.get("categories")
    return Column(**{**value, "categories": None if categories is None else tuple(categories)})


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
class _Listing:
    """The files of a source, in the order their rows are numbered; nothing read yet."""

    url: str
    kind: Literal["csv", "parquet"]
    names: tuple[str, ...]
    """File names relative to ``url``, sorted; ``("",)`` for a single file."""

    def file_url(self, name: str) -> str:
        return join(self.url, name) if name else self.url


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
    engine: str = "auto",
) -> PreprocessResult:
    """Validate, split and shard ``source_url`` into ``{output_url}/datasets/{fingerprint}``.

    Rows with a bad value go to ``{dataset_url}/rejected.parquet`` with the columns
    ``source_row``, ``reason``, ``text`` and the schema columns as the raw strings read.
    ``source_row`` is the 1-based data row number: the header is not counted, and for CSV
    neither are blank lines, while a quoted value spanning lines counts once. In a CSV without
    blank lines or multi-line values the row sits on line ``source_row + 1``. ``text`` holds the
    raw record of CSV rows whose fields could not be split out (wrong field count).

    Calling again with the same source bytes, schema, fractions, seed and ``rows_per_shard``
    returns the committed result without writing anything. Both engines write the same
    dataset: the same shards byte for byte, the same rejects, the same manifest.

    Args:
        source_url: fsspec URL or local path of a ``.csv``, ``.csv.gz`` or ``.parquet`` file,
            or of a directory of ``.parquet`` files (read in sorted path order).
        output_url: fsspec URL or local path under which ``datasets/`` is created.
        schema: columns to read; other columns of the source are ignored.
        fractions: train, validation and test shares (of every class, for a classification);
            they sum to 1.
        seed: seed of the shuffle that assigns rows to splits.
        rows_per_shard: most rows in one Parquet shard.
        engine: ``"local"`` (this process), ``"ray"`` (a Ray Data job on the Ray this process
            is connected to, else a local one) or ``"auto"`` (:func:`choose_engine`).

    Raises:
        ValueError: an argument is out of range.
        SchemaError: the source lacks a schema column.
        DataError: the source does not exist, has an unsupported format, or has no valid row.
    """
    _check_arguments(fractions, seed, rows_per_shard, engine)
    fractions = (float(fractions[0]), float(fractions[1]), float(fractions[2]))
    if choose_engine(source_url, engine, output_url) == "ray":
        from ringflow.storage.ray_preprocess import preprocess_with_ray

        return preprocess_with_ray(
            source_url,
            output_url,
            schema,
            fractions=fractions,
            seed=seed,
            rows_per_shard=rows_per_shard,
        )
    source = _load_source(source_url)
    digests = [(name, sha256(data)) for name, data in source.files]
    fingerprint = _fingerprint(source.kind, digests, schema, fractions, seed, rows_per_shard)
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
    return _commit(dataset_url, manifest)


def choose_engine(
    source_url: str, engine: str = "auto", output_url: str | None = None
) -> Literal["local", "ray"]:
    """Where :func:`preprocess` runs for ``engine``: ``"auto"`` picks Ray Data when the
    source holds at least :data:`RAY_PREPROCESS_BYTES`, or
    :data:`RAY_CLUSTER_PREPROCESS_BYTES` when ``RAY_ADDRESS`` names a Ray cluster (not
    ``local``), else this process; ``memory://`` URLs, which only this process sees, always
    run here.

    Raises:
        ValueError: ``engine`` is not one of :data:`ENGINES`, or is ``"ray"`` for a
            ``memory://`` URL.
    """
    _check_engine(engine)
    in_memory = [u for u in (source_url, output_url) if u and u.startswith("memory://")]
    if engine == "ray" and in_memory:
        raise ValueError(
            f"engine='ray' cannot preprocess {in_memory[0]}: memory:// lives in this process "
            "only, out of reach of Ray's workers; use engine='local' or a shared URL"
        )
    if engine != "auto" or in_memory:
        return "ray" if engine == "ray" else "local"
    on_cluster = os.environ.get("RAY_ADDRESS", "").strip() not in ("", "local")
    threshold = RAY_CLUSTER_PREPROCESS_BYTES if on_cluster else RAY_PREPROCESS_BYTES
    try:
        listing = _list_source(source_url)
    except DataError:
        return "local"  # which reports the missing or unsupported source
    fs, _ = resolve(source_url)
    size = sum(fs.size(resolve(listing.file_url(n))[1]) for n in listing.names)
    return "ray" if size >= threshold else "local"


def _check_engine(engine: Any) -> None:
    if engine not in ENGINES:
        raise ValueError(
            f"engine must be one of {', '.join(repr(e) for e in ENGINES)} (preprocess in this "
            f"process, with Ray Data, or chosen by size and RAY_ADDRESS), got {engine!r}"
        )


def _commit(dataset_url: str, manifest: dict[str, Any]) -> PreprocessResult:
    """Write the manifest, last: until it exists the directory is not a dataset, whatever
    else it holds."""
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
    rows = _read_rows(source, [c.name for c in schema.columns])
    values, problems = _validate(rows.table, schema)
    rejected = _sorted_rejects([_rejects_table(rows, problems, schema)])
    files = _write_rejects(dataset_url, rejected)
    valid = np.setdiff1d(np.arange(rows.table.num_rows), np.fromiter(problems, np.int64))
    _check_some_valid(source.url, dataset_url, len(valid), rejected.num_rows)
    splits = _assign_splits(schema, values[schema.label.name][valid], fractions, seed)
    for split, order in splits.items():
        table = _typed_table(values, schema, valid[order])
        files += _write_split(dataset_url, split, table, rows_per_shard)
    _remove_leftovers(dataset_url, files)
    return _manifest(
        source_url=source.url,
        fingerprint=fingerprint,
        schema=schema,
        fractions=fractions,
        seed=seed,
        files=files,
        source_rows=rows.table.num_rows + len(rows.unsplit),
        rejected_rows=rejected.num_rows,
    )


def _check_some_valid(source_url: str, dataset_url: str, valid: int, rejected: int) -> None:
    if valid == 0:
        raise DataError(
            f"all {rejected} rows of {source_url} were rejected, nothing to train on; "
            f"see the reasons in {join(dataset_url, _REJECTED)}"
        )


def _assign_splits(
    schema: TableSchema, labels: np.ndarray, fractions: tuple[float, ...], seed: int
) -> dict[str, np.ndarray]:
    """Positions into the valid rows (in source order) for each split, in the split's row
    order; ``labels`` are the valid rows' label values (category codes as numbers)."""
    if schema.task == "classification":
        return _split(labels, fractions, seed)
    return _shuffle_split(len(labels), fractions, seed)


def _check_arguments(fractions: Any, seed: Any, rows_per_shard: Any, engine: Any = "auto") -> None:
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
    _check_engine(engine)


def _fingerprint(
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
        "format": _FORMAT,
        "kind": kind,
        "files": [[name, digest] for name, digest in digests],
        "schema": _schema_json(schema),
        "fractions": list(fractions),
        "seed": seed,
        "rows_per_shard": rows_per_shard,
    }
    return sha256(json.dumps(identity, sort_keys=True).encode())


def _schema_json(schema: TableSchema) -> dict[str, Any]:
    return schema.to_json()


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
        "format": _FORMAT,
        "fingerprint": fingerprint,
        "source_url": source_url,
        "schema": _schema_json(schema),
        "fractions": list(fractions),
        "seed": seed,
        "rows": {s: sum(f["rows"] for f in shards if f["split"] == s) for s in SPLITS},
        "source_rows": source_rows,
        "rejected_rows": rejected_rows,
        "files": files,
    }


# --------------------------------------------------------------------------- inferring a schema


def infer_schema(
    source_url: str,
    *,
    label: str = "label",
    features: Sequence[str] | None = None,
    task: Literal["classification", "regression"] | None = None,
    bounds: Mapping[str, Sequence[float | None]] | None = None,
    classes: int | None = None,
    categorical: Sequence[str] | None = None,
) -> TableSchema:
    """Propose the :class:`TableSchema` of a source file, to pass to :func:`preprocess`.

    A column is a ``"category"`` if ``categorical`` lists it or if none of its non-empty
    values is a number; its categories are its distinct non-empty values (whitespace trimmed),
    sorted. Otherwise it is an ``"int"`` if every finite number in it is integral (and exact in
    float64), else a ``"float"``. A few bad values among numbers (``n/a``) leave the column
    numeric: :func:`preprocess` rejects those rows with their reason.

    Without ``task``, a category label is a classification, a float label a regression, and
    an int label a classification when no value is negative and it has at most 1000 distinct
    values, else a regression. A classification on an int label has ``max + 1`` classes (the
    bound's max when ``bounds`` gives one).

    The same file (and arguments) always gives the same schema, hence the same dataset
    fingerprint. Nothing is written.

    Args:
        source_url: the source, in any format :func:`preprocess` reads.
        label: the column to predict.
        features: the model inputs, in this order; ``None`` for every other column in file
            order (except a pandas index stored in a Parquet file, ``__index_level_0__``).
        task: ``"classification"`` or ``"regression"``; ``None`` to infer it from the label.
        bounds: ``{column: [min, max]}`` for numeric columns; either may be ``None``.
        classes: a classification's number of classes (labels ``0 .. classes - 1``; rows
            outside are rejected), where the data alone would not tell it.
        categorical: columns to treat as categories even when their values are numbers.

    Raises:
        ValueError: an argument is malformed, names a column outside the schema, or ``task``
            contradicts the label's values.
        SchemaError: the source lacks ``label`` or a listed feature, or a column is empty.
        DataError: the source does not exist, has an unsupported format, or has no data row.
    """
    _check_infer_arguments(label, features, task, bounds, categorical)
    bounds = dict(bounds or {})
    if classes is not None:
        if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
            raise ValueError(f"classes must be a positive integer, got {classes!r}")
        if task == "regression":
            raise ValueError("classes is for classification; leave it out for a regression")
        bounds.setdefault(label, [0, classes - 1])
    source = _load_source(source_url)
    names = _schema_names(source, label, features)
    categorical = list(dict.fromkeys(categorical or ()))
    _check_named("bounds", bounds, names)
    _check_named("categorical", categorical, names)
    rows = _read_rows(source, names)
    if rows.table.num_rows == 0:
        raise DataError(f"{source.url} has no data rows to infer a schema from; add rows")
    profiles = {
        n: _profile(source.url, n, rows.table[n].combine_chunks(), n in categorical) for n in names
    }
    for name in bounds:
        if profiles[name].dtype == "category":
            raise ValueError(
                f"bounds: column {name} holds categories, not numbers; bounds apply to numeric "
                "columns only, remove it from bounds"
            )
    label_column, task, classes = _label_column(profiles[label], task, bounds.get(label))
    return TableSchema(
        features=tuple(_feature_column(profiles[n], bounds.get(n)) for n in names[:-1]),
        label=label_column,
        task=task,
        classes=classes,
    )


@dataclass(frozen=True, kw_only=True)
class _Profile:
    """What :func:`infer_schema` learnt about one column."""

    name: str
    dtype: Literal["float", "int", "category"]
    categories: tuple[str, ...] | None = None
    numbers: np.ndarray | None = None
    """The finite numbers of a numeric column."""


def _check_infer_arguments(
    label: Any, features: Any, task: Any, bounds: Any, categorical: Any
) -> None:
    if not isinstance(label, str) or not label:
        raise ValueError(f"label must be the name of the column to predict, got {label!r}")
    for argument, value in (("features", features), ("categorical", categorical)):
        if isinstance(value, str) or (
            value is not None and not all(isinstance(n, str) for n in value)
        ):
            raise ValueError(
                f"{argument} must be a list of column names, e.g. {argument}=['x1'], got {value!r}"
            )
    if task is not None and task not in TASKS:
        raise ValueError(
            f"task must be 'classification', 'regression' or None (to infer it), got {task!r}"
        )
    if bounds is not None and not isinstance(bounds, Mapping):
        raise ValueError(f"bounds must be a dict {{column: [min, max]}}, got {bounds!r}")
    for name, pair in (bounds or {}).items():
        if not _is_bound_pair(pair):
            raise ValueError(
                f"bounds[{name!r}] must be [min, max], each a finite number or None, got {pair!r}"
            )


def _is_bound_pair(pair: Any) -> bool:
    if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
        return False
    return all(
        v is None or (isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v))
        for v in pair
    )


def _source_columns(source: _Source) -> list[str]:
    """The column names of ``source`` (of its first file, for a directory), in file order."""
    name, data = source.files[0]
    if source.kind == "csv":
        if source.url.lower().endswith(".gz"):
            data = _gunzip(source.url, data)
        return _csv_header(source.url, data)
    url = join(source.url, name) if name else source.url
    try:
        return list(pq.read_schema(pa.BufferReader(data)).names)
    except pa.ArrowException as err:
        raise DataError(f"{url} is not a readable Parquet file: {err}") from err


def _schema_names(source: _Source, label: str, features: Sequence[str] | None) -> list[str]:
    """The feature columns, then the label, checked against the columns of the source."""
    found = _source_columns(source)
    if label not in found:
        raise SchemaError(
            f"{source.url} has no label column {label!r}; columns found: {found}. "
            "Set label to the column to predict."
        )
    if features is None:
        chosen = [n for n in found if n != label and not re.match(_PANDAS_INDEX, n)]
        if "" in chosen:
            raise SchemaError(
                f"{source.url}: column {found.index('') + 1} of the header has no name; "
                "name it, or pass features=[...] to choose the input columns"
            )
    else:
        chosen = list(features)
        missing = [n for n in chosen if n not in found]
        if missing:
            raise SchemaError(
                f"{source.url} lacks the feature columns {missing}; columns found: {found}. "
                "Fix features."
            )
        if label in chosen:
            raise ValueError(
                f"features lists the label column {label!r}; remove it from features (the "
                "label is what the model predicts, not an input)"
            )
        repeated = sorted({n for n in chosen if chosen.count(n) > 1})
        if repeated:
            raise ValueError(f"features lists {repeated} more than once; list each column once")
    if not chosen:
        raise SchemaError(
            f"{source.url} has no feature column besides the label {label!r}; "
            "a model needs at least one input column"
        )
    names = [*chosen, label]
    _require_columns(source.url, found, names)  # the same name twice in the file
    return names


def _check_named(argument: str, named: Any, names: list[str]) -> None:
    unknown = [n for n in named if n not in names]
    if unknown:
        raise ValueError(
            f"{argument} names {unknown}, not among the schema's columns {names}; "
            f"fix {argument} (or add the column to features)"
        )


def _profile(url: str, name: str, raw: pa.Array, categorical: bool) -> _Profile:
    text = pc.utf8_trim_whitespace(raw)
    present = pc.filter(text, pc.not_equal(text, ""))  # nulls are dropped too
    if len(present) == 0:
        raise SchemaError(
            f"{url}: column {name} is empty in every row; fill it or leave it out of the schema"
        )
    numeric = pc.filter(present, pc.match_substring_regex(present, _NUMBER, ignore_case=True))
    if categorical or len(numeric) == 0:
        categories = tuple(sorted(pc.unique(present).to_pylist()))
        return _Profile(name=name, dtype="category", categories=categories)
    numbers = pc.cast(numeric, pa.float64()).to_numpy(zero_copy_only=False)
    finite = numbers[np.isfinite(numbers)]
    integral = finite.size > 0 and not np.any(_non_integral(finite))
    return _Profile(name=name, dtype="int" if integral else "float", numbers=finite)


def _non_integral(numbers: np.ndarray) -> np.ndarray:
    """Where a number cannot be an ``"int"``: it has a fraction or is beyond float64's exact
    integers."""
    return (numbers != np.round(numbers)) | (np.abs(numbers) > _LIMITS["int"])


def _feature_column(profile: _Profile, bound: Sequence[float | None] | None) -> Column:
    if profile.dtype == "category":
        return Column(name=profile.name, dtype="category", categories=profile.categories)
    low, high = bound or (None, None)
    return Column(name=profile.name, dtype=profile.dtype, min=low, max=high)


def _label_column(
    profile: _Profile, task: str | None, bound: Sequence[float | None] | None
) -> tuple[Column, Literal["classification", "regression"], int | None]:
    """The label column, the task and the number of classes."""
    name = profile.name
    if profile.dtype == "category":
        assert profile.categories is not None
        if task == "regression":
            raise ValueError(
                f"task='regression' needs a numeric label, but label column {name} holds text "
                f"such as {profile.categories[0]!r}; pass task='classification' (or leave task "
                "out), or choose a numeric label"
            )
        column = Column(name=name, dtype="category", categories=profile.categories)
        return column, "classification", len(profile.categories)
    assert profile.numbers is not None
    low, high = bound or (None, None)
    if task is None:
        task = _inferred_task(profile)
    if task == "regression":
        return Column(name=name, dtype=profile.dtype, min=low, max=high), "regression", None
    if profile.dtype == "float":
        bad = profile.numbers[_non_integral(profile.numbers)]
        example = _number(float(bad[0])) if bad.size else "nan"
        raise ValueError(
            f"task='classification' needs integer class ids, but label column {name} has "
            f"values such as {example}; pass task='regression' to predict a number, or list "
            f"{name!r} in categorical to treat its values as class names"
        )
    top = float(profile.numbers.max()) if high is None else high
    if top < 0:
        raise ValueError(
            f"task='classification' needs class ids from 0, but label column {name} has no "
            "value of 0 or more; pass task='regression' or renumber the classes from 0"
        )
    classes = int(top) + 1
    column = Column(name=name, dtype="int", min=0 if low is None else low, max=classes - 1)
    return column, "classification", classes


def _inferred_task(profile: _Profile) -> Literal["classification", "regression"]:
    numbers = profile.numbers
    assert numbers is not None
    if (
        profile.dtype == "int"
        and numbers.min() >= 0
        and np.unique(numbers).size <= _MAX_INFERRED_CLASSES
    ):
        return "classification"
    return "regression"


# --------------------------------------------------------------------------- reading sources


def _load_source(url: str) -> _Source:
    listing = _list_source(url)
    files = tuple((n, read_bytes(listing.file_url(n))) for n in listing.names)
    return _Source(url=url, kind=listing.kind, files=files)


def _list_source(url: str) -> _Listing:
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
    return _Listing(url=url, kind=kind, names=("",))


def _parquet_directory(url: str, fs: Any, path: str) -> _Listing:
    prefix = path.rstrip("/") + "/"
    names = sorted(p[len(prefix) :] for p in fs.find(path) if p.endswith(".parquet"))
    # Names starting with _ or . are metadata or in-progress files of other writers.
    names = [n for n in names if not any(part[:1] in "_." for part in n.split("/"))]
    if not names:
        raise DataError(f"source directory {url} holds no .parquet files; expected {_ACCEPTED}")
    return _Listing(url=url, kind="parquet", names=tuple(names))


def _read_rows(source: _Source, names: list[str]) -> _Rows:
    """The columns ``names`` of every row of ``source``, as strings."""
    if source.kind == "csv":
        return _read_csv(source.url, source.files[0][1], names)
    tables = [
        _read_parquet(join(source.url, n) if n else source.url, d, names) for n, d in source.files
    ]
    table = pa.concat_tables(tables)
    return _Rows(table=table, source_row=np.arange(1, table.num_rows + 1), unsplit=[])


def _file_rows(url: str, kind: str, data: bytes, names: list[str]) -> _Rows:
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
    _require_columns(url, table.column_names, names)
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
        data = _gunzip(url, data)
    header = _csv_header(url, data)
    _require_columns(url, header, names)
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


def _require_columns(url: str, found: list[str], names: list[str]) -> None:
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


# --------------------------------------------------------------------------- validation


def _validate(table: pa.Table, schema: TableSchema) -> tuple[dict[str, np.ndarray], dict[int, str]]:
    """Parse every column; return the values and a reason for each row index that failed.

    Values are float64, with a category's code as its value and NaN where a check failed.
    """
    values: dict[str, np.ndarray] = {}
    reasons: dict[int, list[str]] = {}
    for column in schema.columns:
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


def _number(value: float | None) -> str:
    return str(int(value)) if value is not None and value.is_integer() else str(value)


def _rejects_table(rows: _Rows, problems: dict[int, str], schema: TableSchema) -> pa.Table:
    """The rejected rows, with the raw strings of their schema columns (for
    :func:`_sorted_rejects`)."""
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
    return pa.concat_tables([unsplit, failed])


def _sorted_rejects(parts: Sequence[pa.Table]) -> pa.Table:
    """Rejected rows of every part in ``source_row`` order, as one chunk: what is written."""
    return pa.concat_tables(parts).sort_by("source_row").combine_chunks()


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


def _shuffle_split(rows: int, fractions: tuple[float, ...], seed: int) -> dict[str, np.ndarray]:
    """Positions ``0 .. rows - 1`` for each split: one seeded shuffle, cut by the fractions."""
    shuffled = np.random.default_rng(seed).permutation(rows)
    bounds = np.rint(rows * np.cumsum(fractions)[:2]).astype(int)
    return dict(zip(SPLITS, np.split(shuffled, bounds), strict=True))


def _typed_table(values: dict[str, np.ndarray], schema: TableSchema, index: np.ndarray) -> pa.Table:
    return pa.table(
        {c.name: values[c.name][index].astype(_storage_type(schema, c)) for c in schema.columns}
    )


def _storage_type(schema: TableSchema, column: Column) -> type[np.generic]:
    """float32 for floats and a regression's label, int64 for ints and category codes."""
    if column.name == schema.label.name and schema.task == "regression":
        return np.float32
    return np.float32 if column.dtype == "float" else np.int64


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


def _remove_leftovers(dataset_url: str, files: list[dict]) -> None:
    """Delete shards of an interrupted earlier attempt that this attempt did not rewrite."""
    fs, path = resolve(dataset_url)
    keep = {join(path, f["path"]) for f in files}
    patterns = [join(path, s, "part-*.parquet") for s in SPLITS] + [join(path, _REJECTED)]
    for pattern in patterns:
        for stale in set(fs.glob(pattern)) - keep:
            fs.rm(stale)


# --------------------------------------------------------------------------- reading datasets


def read_split(
    dataset_url: str, split: str, schema: TableSchema | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Read one split of a committed dataset, verifying every shard against the manifest.

    Args:
        dataset_url: a :attr:`PreprocessResult.dataset_url`.
        split: ``"train"``, ``"validation"`` or ``"test"``.
        schema: the columns to read; ``None`` for the dataset's own (:func:`dataset_schema`).
            A schema that is given must agree with the stored one on the dtype and categories
            of every column it names, and on the task.

    Returns:
        ``(features, labels)``: float32 of shape ``(n, schema.input_dim)`` in schema order
        (a category as its code), and labels of shape ``(n,)``: int64 class ids for a
        classification, float32 for a regression.

    Raises:
        ValueError: ``split`` is not one of ``train``, ``validation``, ``test``.
        DataError: no valid manifest (the dataset was never committed) or a shard is missing
            or does not match its size and checksum.
        SchemaError: the dataset lacks a schema column or stores it with another dtype.
    """
    schema, shards = split_shards(dataset_url, split, schema)
    names = [c.name for c in schema.columns]
    table = pa.concat_tables([_read_shard(dataset_url, f, names) for f in shards])
    return table_arrays(table, schema)


def split_shards(
    dataset_url: str, split: str, schema: TableSchema | None = None
) -> tuple[TableSchema, list[dict[str, Any]]]:
    """The schema to read ``split`` with and its shards' manifest entries (``path``, ``rows``,
    ``size``, ``sha256``), in the split's row order; checked as :func:`read_split` checks."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    manifest = _load_manifest(dataset_url)
    stored = _stored_schema(dataset_url, manifest)
    if schema is None:
        schema = stored
    else:
        _check_stored_schema(dataset_url, stored, schema)
    return schema, [f for f in manifest["files"] if f["split"] == split]


def table_arrays(table: pa.Table, schema: TableSchema) -> tuple[np.ndarray, np.ndarray]:
    """``(features, labels)`` of a table of the schema's columns, as :func:`read_split` returns
    them."""
    features = np.empty((table.num_rows, schema.input_dim), dtype=np.float32)
    for i, column in enumerate(schema.features):
        features[:, i] = table[column.name].to_numpy()
    label_type = np.int64 if schema.task == "classification" else np.float32
    return features, table[schema.label.name].to_numpy().astype(label_type)


def commit_manifest(
    dataset_url: str,
    *,
    schema: TableSchema,
    files: list[dict[str, Any]],
    fingerprint: str,
    source_url: str,
    fractions: tuple[float, float, float],
    seed: int,
) -> PreprocessResult:
    """Commit shards written by other code than :func:`preprocess` (a generator, a job) as a
    dataset: the manifest is written last, as :func:`preprocess` writes it.

    Args:
        files: one entry per shard: ``split``, ``path`` (relative to ``dataset_url``),
            ``rows``, ``size`` and ``sha256`` of its bytes, and ``row_groups``
            (:func:`row_group_entries`) for a streaming reader to check what it reads.
    """
    manifest = {
        "format": _FORMAT,
        "fingerprint": fingerprint,
        "source_url": source_url,
        "schema": _schema_json(schema),
        "fractions": list(fractions),
        "seed": seed,
        "rows": {s: sum(f["rows"] for f in files if f["split"] == s) for s in SPLITS},
        "source_rows": sum(f["rows"] for f in files),
        "rejected_rows": 0,
        "files": files,
    }
    atomic_write(join(dataset_url, _MANIFEST), json.dumps(manifest, indent=2).encode())
    return _result(dataset_url, manifest)


def dataset_schema(dataset_url: str) -> TableSchema:
    """The schema a committed dataset was preprocessed with, as its manifest records it.

    Raises:
        DataError: no valid manifest, or its schema cannot be read.
    """
    return _stored_schema(dataset_url, _load_manifest(dataset_url))


def _stored_schema(dataset_url: str, manifest: dict[str, Any]) -> TableSchema:
    try:
        return TableSchema.from_json(manifest["schema"])
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(
            f"{join(dataset_url, _MANIFEST)} holds no valid schema ({err}); run preprocess again"
        ) from err


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


def _check_stored_schema(dataset_url: str, stored: TableSchema, schema: TableSchema) -> None:
    columns = {c.name: c for c in stored.columns}
    wrong = [
        c.name
        for c in schema.columns
        if c.name not in columns
        or (columns[c.name].dtype, columns[c.name].categories) != (c.dtype, c.categories)
    ]
    if wrong:
        dtypes = {c.name: c.dtype for c in stored.columns}
        raise SchemaError(
            f"dataset {dataset_url} has no column of the requested dtype (and categories) for "
            f"{wrong}; "
            f"it stores {dtypes} (read it with schema=None to use the stored schema)"
        )
    if schema.task != stored.task:
        raise SchemaError(
            f"dataset {dataset_url} was preprocessed for task {stored.task!r}, not "
            f"{schema.task!r}; read it with schema=None or preprocess it again"
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
