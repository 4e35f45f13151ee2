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

What a table is (its schema, splits, errors) lives in :mod:`ringflow.storage.schema`, and the
steps both engines take with its rows in :mod:`ringflow.storage.rows`; this module is the
front: preprocessing (in this process, or as a Ray Data job by
:mod:`ringflow.storage.ray_preprocess`), schema inference and reading a dataset back.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ringflow.storage.fs import join, read_bytes, resolve, sha256
from ringflow.storage.rows import (
    assign_splits,
    check_arguments,
    check_some_valid,
    commit_dataset,
    committed_result,
    csv_header,
    dataset_manifest,
    fingerprint_of,
    gunzip,
    list_source,
    load_manifest,
    load_source,
    number_text,
    read_rows,
    rejects_table,
    remove_leftovers,
    require_columns,
    row_group_entries,
    row_group_range,
    sorted_rejects,
    typed_table,
    validate_rows,
    write_rejects,
    write_split,
)
from ringflow.storage.schema import (
    ENGINES,
    LIMITS,
    MANIFEST,
    NUMBER_PATTERN,
    SPLITS,
    TASKS,
    Column,
    DataError,
    PreprocessResult,
    SchemaError,
    TableSchema,
    check_engine,
)

if TYPE_CHECKING:
    from ringflow.storage.rows import SourceFiles

__all__ = [
    "Column",
    "DataError",
    "ENGINES",
    "RAY_CLUSTER_PREPROCESS_BYTES",
    "RAY_PREPROCESS_BYTES",
    "PreprocessResult",
    "SPLITS",
    "TASKS",
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


# How :func:`infer_schema` decides: an int label with more distinct values than this (or a
# negative one) is a number to predict, not a class id.
_MAX_INFERRED_CLASSES = 1000


# A pandas index written into a Parquet file as a column; not a feature by default.
_PANDAS_INDEX = r"^__index_level_\d+__$"


RAY_PREPROCESS_BYTES = 1 << 30
"""``engine="auto"`` runs a source of at least this many bytes (1 GiB, all files together)
on Ray Data: below it, one process is done before a Ray Data job has started its tasks."""


RAY_CLUSTER_PREPROCESS_BYTES = 64 << 20
"""The same threshold when ``RAY_ADDRESS`` names a cluster (64 MiB): a cluster's CPUs read a
directory of files in parallel and spare the flow's process the source's memory, but a small
source is still read in one process in well under a second, where a job costs seconds
(its tasks scheduled and started on the cluster's workers, e.g. 4 to 7 s on a 2-CPU head)."""


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
    check_arguments(fractions, seed, rows_per_shard, engine)
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
    source = load_source(source_url)
    digests = [(name, sha256(data)) for name, data in source.files]
    fingerprint = fingerprint_of(source.kind, digests, schema, fractions, seed, rows_per_shard)
    dataset_url = join(output_url, "datasets", fingerprint)
    existing = committed_result(dataset_url, fingerprint)
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
    return commit_dataset(dataset_url, manifest)


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
    check_engine(engine)
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
        listing = list_source(source_url)
    except DataError:
        return "local"  # which reports the missing or unsupported source
    fs, _ = resolve(source_url)
    size = sum(fs.size(resolve(listing.file_url(n))[1]) for n in listing.names)
    return "ray" if size >= threshold else "local"


def _build(
    source: SourceFiles,
    schema: TableSchema,
    *,
    dataset_url: str,
    fingerprint: str,
    fractions: tuple[float, float, float],
    seed: int,
    rows_per_shard: int,
) -> dict[str, Any]:
    """Write the rejects and every shard; return the manifest that commits them."""
    rows = read_rows(source, [c.name for c in schema.columns])
    values, problems = validate_rows(rows.table, schema)
    rejected = sorted_rejects([rejects_table(rows, problems, schema)])
    files = write_rejects(dataset_url, rejected)
    valid = np.setdiff1d(np.arange(rows.table.num_rows), np.fromiter(problems, np.int64))
    check_some_valid(source.url, dataset_url, len(valid), rejected.num_rows)
    splits = assign_splits(schema, values[schema.label.name][valid], fractions, seed)
    for split, order in splits.items():
        table = typed_table(values, schema, valid[order])
        files += write_split(dataset_url, split, table, rows_per_shard)
    remove_leftovers(dataset_url, files)
    return dataset_manifest(
        source_url=source.url,
        fingerprint=fingerprint,
        schema=schema,
        fractions=fractions,
        seed=seed,
        files=files,
        source_rows=rows.table.num_rows + len(rows.unsplit),
        rejected_rows=rejected.num_rows,
    )


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
    source = load_source(source_url)
    names = _schema_names(source, label, features)
    categorical = list(dict.fromkeys(categorical or ()))
    _check_named("bounds", bounds, names)
    _check_named("categorical", categorical, names)
    rows = read_rows(source, names)
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


def _source_columns(source: SourceFiles) -> list[str]:
    """The column names of ``source`` (of its first file, for a directory), in file order."""
    name, data = source.files[0]
    if source.kind == "csv":
        if source.url.lower().endswith(".gz"):
            data = gunzip(source.url, data)
        return csv_header(source.url, data)
    url = join(source.url, name) if name else source.url
    try:
        return list(pq.read_schema(pa.BufferReader(data)).names)
    except pa.ArrowException as err:
        raise DataError(f"{url} is not a readable Parquet file: {err}") from err


def _schema_names(source: SourceFiles, label: str, features: Sequence[str] | None) -> list[str]:
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
    require_columns(source.url, found, names)  # the same name twice in the file
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
    numeric = pc.filter(
        present, pc.match_substring_regex(present, NUMBER_PATTERN, ignore_case=True)
    )
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
    return (numbers != np.round(numbers)) | (np.abs(numbers) > LIMITS["int"])


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
        example = number_text(float(bad[0])) if bad.size else "nan"
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
    manifest = load_manifest(dataset_url)
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
    manifest = dataset_manifest(
        source_url=source_url,
        fingerprint=fingerprint,
        schema=schema,
        fractions=fractions,
        seed=seed,
        files=files,
        source_rows=sum(f["rows"] for f in files),
        rejected_rows=0,
    )
    return commit_dataset(dataset_url, manifest)


def dataset_schema(dataset_url: str) -> TableSchema:
    """The schema a committed dataset was preprocessed with, as its manifest records it.

    Raises:
        DataError: no valid manifest, or its schema cannot be read.
    """
    return _stored_schema(dataset_url, load_manifest(dataset_url))


def _stored_schema(dataset_url: str, manifest: dict[str, Any]) -> TableSchema:
    try:
        return TableSchema.from_json(manifest["schema"])
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(
            f"{join(dataset_url, MANIFEST)} holds no valid schema ({err}); run preprocess again"
        ) from err


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
