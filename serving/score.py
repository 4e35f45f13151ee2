"""Batch scoring: a registered model version (or a run's checkpoint) over a table on any fsspec
URL, its predictions written as Parquet shards and committed block by block, the output as a
whole committed last.

:func:`score` checks everything before it writes anything (the model's class against the
caller's allow-list, the version, the input's columns against the model's input schema), then
cuts the input into blocks with stable ids and scores each block not committed yet: in this
process for a small input, or on Ray Data actors that hold the model
(:mod:`ringflow.serving.score_ray`) for a large one or on a named cluster. Both run
:func:`score_block`, so both write the same bytes.

An output under ``output_url``::

    _plan.json                         what is scored: the input's files, the model, the blocks
    predictions/part-{block}.parquet   key columns, the prediction, the model's name, version
                                       and fingerprint
    rejected/part-{block}.parquet      rows that fail the model's input schema, with the reason
    blocks/{block}.json                a block's commit: its shards, sizes and checksums
    _manifest.json                     the output's commit, written last

A block is committed by its record, written after its shards; the output by its manifest,
written after every block's record. Until the manifest exists the output is not valid, and a
reader of ``predictions/`` alone may see a block's shard that an interrupted run left without
its record (the next run writes it again, whole, under the same name). A run started again
into the same output (the same run key, for the flow) scores only the blocks without a record,
so each input row is written once.

The prediction is what the served ``/predict`` answers (:class:`serving.schema.OutputSpec`):
the class (or its category string) under the model's output name and the softmax
``probabilities`` for a classification, ``value`` for a regression, ``prediction`` for a
module's own ``predict_step``. The model class comes from the caller's ``allowed`` list, never
from storage (:func:`storage.checkpoint.load_model`).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from ringflow.serving.replica import _load_served, _Served
from ringflow.serving.schema import InputSpec, ServingError, TableInput, _data_schema
from ringflow.storage.checkpoint import Allowed, CheckpointError, read_checkpoint
from ringflow.storage.commit import commit_record
from ringflow.storage.fs import absolute, atomic_write, join, read_bytes, resolve, sha256
from ringflow.storage.registry import ModelRegistry, RegistryError
from ringflow.storage.rows import (
    Listing,
    csv_header,
    file_rows,
    gunzip,
    list_source,
    rejects_table,
    require_columns,
    sorted_rejects,
    validate_rows,
)
from ringflow.storage.schema import DataError, TableSchema

__all__ = [
    "RAY_SCORE_BYTES",
    "BlockDone",
    "ROW_ID",
    "ModelSource",
    "ScoreResult",
    "ScoringError",
    "ScoringOptions",
    "check",
    "choose_engine",
    "score",
]

_log = logging.getLogger(__name__)

FORMAT = "ringflow.scores/1"
PLAN = "_plan.json"
MANIFEST = "_manifest.json"

ROW_ID = "source_row"
"""The key written when no ``key_columns`` are given: the row's 1-based number in the input
(files in sorted path order, rows in file order), as preprocessing numbers its rejects."""

RAY_SCORE_BYTES = 1 << 30
"""``engine="auto"`` scores an input of at least this many bytes on Ray Data."""

ENGINES = ("auto", "local", "ray")

_MODEL_COLUMNS = ("model_name", "model_version", "model_fingerprint")


class ScoringError(ValueError):
    """The input, the model or the output cannot be scored; the message says what to fix.
    Raised before any block is scored."""


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Which model scores: a registry's version (its production version by default), or a
    committed checkpoint (a run's ``runs/{run key}/model``)."""

    registry_url: str | None = None
    """The registry's root (``{storage_url}/registry``); with ``name``."""
    name: str | None = None
    """The model's name in the registry (``digits``); with a checkpoint, the name written."""
    version: str | None = None
    """A registry version (``v0003``); ``None`` for the production version."""
    checkpoint: str | None = None
    """A checkpoint URL instead of a registry version."""

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.registry_url is None):
            raise ValueError(
                "ModelSource: give either registry_url and name (a registered version) or "
                "checkpoint (a run's model), not both or neither"
            )
        if self.registry_url is not None and not self.name:
            raise ValueError("ModelSource: name is the registered model's name; give it")
        if self.checkpoint is not None and self.version is not None:
            raise ValueError("ModelSource: version names a registry version; drop it or checkpoint")


@dataclass(frozen=True, kw_only=True)
class ScoringOptions:
    """How :func:`score` runs; the output does not depend on ``engine`` or the Ray fields."""

    engine: Literal["auto", "local", "ray"] = "auto"
    """``local`` (this process), ``ray`` (Ray Data actors) or ``auto``: Ray when the input
    holds ``ray_threshold_bytes`` or ``RAY_ADDRESS`` names a cluster, else this process."""
    block_rows: int = 65_536
    """Rows per block: the unit committed on its own, and skipped by a run started again."""
    batch_size: int = 4096
    """Rows per forward pass."""
    ray_threshold_bytes: int = RAY_SCORE_BYTES
    """``engine="auto"``: the input size from which Ray Data scores it."""
    concurrency: int | None = None
    """Ray: actors holding the model; ``None``: as many as the cluster's CPUs (or GPUs) hold,
    at most one per block."""
    cpus_per_actor: float = 1.0
    """Ray: CPUs each actor reserves (fractions allowed)."""
    gpus_per_actor: float = 0.0
    """Ray: the share of a GPU each actor reserves and scores on (0.25: four to a GPU)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        for name in ("block_rows", "batch_size", "ray_threshold_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        if self.concurrency is not None and (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or self.concurrency < 1
        ):
            raise ValueError(f"concurrency must be None or at least 1, got {self.concurrency!r}")
        if not (_number(self.cpus_per_actor) and self.cpus_per_actor > 0):
            raise ValueError(
                f"cpus_per_actor must be a positive number, got {self.cpus_per_actor!r}"
            )
        if not (_number(self.gpus_per_actor) and self.gpus_per_actor >= 0):
            raise ValueError(f"gpus_per_actor must be 0 or more, got {self.gpus_per_actor!r}")
        if self.gpus_per_actor > 1 and not float(self.gpus_per_actor).is_integer():
            raise ValueError(
                f"gpus_per_actor above 1 must be whole GPUs, got {self.gpus_per_actor!r}"
            )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class BlockDone:
    """One block's outcome, as :func:`score` reports it to ``on_block``."""

    block: str
    rows: int
    rejected: int
    skipped: bool
    """Committed by an earlier run: not read or scored again."""
    done: int
    """Blocks done so far (skipped ones included), of ``total``."""
    total: int


@dataclass(frozen=True, kw_only=True)
class ScoreResult:
    """What :func:`score` wrote (or found committed)."""

    output_url: str
    manifest_url: str
    rows_scored: int
    """Rows with a prediction."""
    rows_rejected: int
    """Rows that failed the model's input schema, kept under ``rejected/`` with the reason."""
    blocks: int
    blocks_scored: int
    """Blocks this call read and scored; the others were committed already."""
    rows_read: int
    """Rows of the blocks this call scored (predicted or rejected)."""
    engine: str
    """``local`` or ``ray``, where this call scored its blocks; ``committed`` when the
    output was committed already and nothing was scored."""
    seconds: float
    model: dict[str, Any] = field(default_factory=dict)
    """``name``, ``version``, ``uri``, ``module``, ``fingerprint``."""

    @property
    def blocks_skipped(self) -> int:
        return self.blocks - self.blocks_scored

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blocks_skipped": self.blocks_skipped}


@dataclass(frozen=True, kw_only=True)
class Block:
    """A run of rows of one input file, scored and committed as one."""

    id: str
    file: int
    """Index into the input's files, in sorted path order."""
    start: int
    """First row within the file, 0-based (a CSV's data rows, as numbered from 1 - 1)."""
    stop: int
    first_row: int
    """The input-wide :data:`ROW_ID` of its first row."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything a process needs to score blocks: where, what and with which model. Plain
    data, sent to Ray's actors as it is; each loads the model itself."""

    input_url: str
    kind: Literal["csv", "parquet"]
    files: tuple[str, ...]
    output_url: str
    uri: str
    allowed: tuple[str, ...]
    record: Any
    """The registry's :class:`ModelVersion`, or ``None`` for a checkpoint."""
    name: str | None
    features: TableSchema
    key_columns: tuple[str, ...]
    batch_size: int

    def file_url(self, index: int) -> str:
        name = self.files[index]
        return join(self.input_url, name) if name else self.input_url


def score(
    input_url: str,
    output_url: str,
    *,
    model: ModelSource,
    allowed: Allowed,
    key_columns: Sequence[str] = (),
    options: ScoringOptions | None = None,
    on_block: Callable[[BlockDone], None] | None = None,
) -> ScoreResult:
    """Score every row of ``input_url`` with ``model``; write the predictions under
    ``output_url``, committed block by block and then as a whole (manifest last).

    Args:
        input_url: a ``.csv``, ``.csv.gz`` or ``.parquet`` file, or a directory of
            ``.parquet`` files (any fsspec URL). Columns besides the model's features and
            ``key_columns`` are ignored; a label column need not be there.
        output_url: where the output goes. A run started again into it skips the blocks
            committed already; a committed output is returned as it is.
        model: the registry version (production by default) or checkpoint to score with.
        allowed: the model classes this process trusts (classes or import paths), from its
            own configuration; a checkpoint naming another class is refused unimported.
        key_columns: input columns written with each prediction to join it back; none: the
            row's number, :data:`ROW_ID`.
        options: engine, block and batch sizes, Ray actors.
        on_block: called after each block, committed or found committed.

    Returns:
        The counts, the output's URL, and the model that scored.

    Raises:
        ScoringError: before anything is written: the input is missing, unreadable or lacks
            a feature or key column; the version does not exist (or nothing is in
            production); the model's class is not allowed; the output holds a run of
            another plan (another model version, input or block size).
    """
    options = options or ScoringOptions()
    started = time.perf_counter()
    output_url = absolute(output_url)
    input_url = absolute(input_url)
    job, served = _prepare(input_url, output_url, model, allowed, tuple(key_columns), options)
    blocks = _blocks(job, options.block_rows)
    plan = _plan(job, served, blocks, options.block_rows)
    engine = choose_engine(input_url, output_url, options)
    committed = _committed_manifest(output_url, plan)
    if committed is not None:
        return _result(committed, output_url, scored=[], engine="committed", started=started)
    _claim_plan(output_url, plan)
    records: dict[str, dict] = {}
    pending = []
    for block in blocks:
        record = _block_record(output_url, block.id)
        if record is None:
            pending.append(block)
        else:
            records[block.id] = record
            _report(on_block, block.id, record, skipped=True, done=len(records), total=len(blocks))

    def finished(block_id: str, record: dict) -> None:
        records[block_id] = record
        _report(on_block, block_id, record, skipped=False, done=len(records), total=len(blocks))

    if pending and engine == "ray":
        from ringflow.serving.score_ray import score_on_ray

        score_on_ray(job, pending, options, finished, score_block=score_block)
    else:
        for block in pending:
            finished(block.id, score_block(job, served, block))
    manifest = _commit(output_url, plan, [records[b.id] for b in blocks])
    scored = [records[b.id] for b in pending]
    return _result(manifest, output_url, scored=scored, engine=engine, started=started)


def check(
    input_url: str,
    output_url: str,
    *,
    model: ModelSource,
    allowed: Allowed,
    key_columns: Sequence[str] = (),
    options: ScoringOptions | None = None,
) -> None:
    """Every check :func:`score` makes before it writes anything, with nothing written:
    the input's files and columns, the model's version and class, the engine.

    Raises:
        ScoringError: as :func:`score` raises it.
    """
    options = options or ScoringOptions()
    output_url, input_url = absolute(output_url), absolute(input_url)
    _prepare(input_url, output_url, model, allowed, tuple(key_columns), options)
    choose_engine(input_url, output_url, options)


def choose_engine(input_url: str, output_url: str, options: ScoringOptions) -> str:
    """Where :func:`score` scores: ``ray`` for ``engine="ray"``, or for ``"auto"`` when
    ``RAY_ADDRESS`` names a cluster or the input holds ``ray_threshold_bytes``; else
    ``local``. ``memory://`` URLs, which only this process sees, score here.

    Raises:
        ScoringError: ``engine="ray"`` with a ``memory://`` URL; for ``"auto"``, an input
            that is missing or unreadable.
    """
    in_memory = [u for u in (input_url, output_url) if u.startswith("memory://")]
    if options.engine == "ray" and in_memory:
        raise ScoringError(
            f"engine='ray' cannot reach {in_memory[0]}: memory:// lives in this process only; "
            "use engine='local' or a shared URL"
        )
    if options.engine != "auto" or in_memory:
        return "ray" if options.engine == "ray" else "local"
    if os.environ.get("RAY_ADDRESS", "").strip() not in ("", "local"):
        return "ray"
    try:
        listing = list_source(input_url)
    except DataError as err:
        raise ScoringError(f"input {err}") from err
    fs, _ = resolve(input_url)
    size = sum(fs.size(resolve(listing.file_url(n))[1]) for n in listing.names)
    return "ray" if size >= options.ray_threshold_bytes else "local"


# ---------------------------------------------------------------------------- checks


def _prepare(
    input_url: str,
    output_url: str,
    source: ModelSource,
    allowed: Allowed,
    key_columns: tuple[str, ...],
    options: ScoringOptions,
) -> tuple[Job, _Served]:
    """The model loaded and checked, the input's columns checked against it: every check
    that needs no block read."""
    try:
        listing = list_source(input_url)
    except DataError as err:
        raise ScoringError(f"input {err}") from err
    record, uri = _resolve(source, output_url)
    try:
        allowed_paths = _allowed_paths(allowed)
        served = _load_served(uri, allowed_paths, record)
    except (CheckpointError, ServingError) as err:
        raise ScoringError(str(err)) from err
    features = _input_schema(uri, served)
    _check_columns(listing, features, key_columns, served)
    job = Job(
        input_url=input_url,
        kind=listing.kind,
        files=listing.names,
        output_url=output_url,
        uri=uri,
        allowed=allowed_paths,
        record=record,
        name=source.name if record is None else record.model,
        features=features,
        key_columns=key_columns,
        batch_size=options.batch_size,
    )
    return job, served


def _resolve(source: ModelSource, output_url: str) -> tuple[Any, str]:
    """The registry record (``None`` for a checkpoint) and the checkpoint's URL. A run
    started again for production scores with the version its plan recorded, even if
    production moved meanwhile: one output, one model."""
    if source.checkpoint is not None:
        return None, absolute(source.checkpoint)
    assert source.registry_url is not None
    assert source.name is not None
    registry = ModelRegistry(source.registry_url, source.name)
    version = source.version or _planned_version(output_url, registry.url)
    try:
        record = registry.get(version) if version else registry.production_version()
    except RegistryError as err:
        raise ScoringError(f"{err}; pick a committed version") from err
    if record is None:
        raise ScoringError(
            f"{registry.url} has no production version to score with: promote one, or name a "
            "version"
        )
    return record, record.uri


def _planned_version(output_url: str, registry_url: str) -> str | None:
    plan = _read_json(join(output_url, PLAN))
    model = (plan or {}).get("model", {})
    return model.get("version") if model.get("registry") == registry_url else None


def _allowed_paths(allowed: Allowed) -> tuple[str, ...]:
    from ringflow.serving.deployment import _allowed

    return _allowed(allowed)


def _input_schema(uri: str, served: _Served) -> TableSchema:
    """The columns the model reads: its training data's features, recorded in the
    checkpoint; for a module with an ``input_schema`` they fill its array in order."""
    schema = _data_schema_of(uri)
    if schema is None:
        raise ScoringError(
            f"{uri} records no data schema (meta['data_schema']), so which input columns it "
            "reads is unknown; train it through ringflow, which records it"
        )
    spec = served.spec
    if isinstance(spec, InputSpec) and math.prod(spec.shape) != schema.input_dim:
        raise ScoringError(
            f"{uri}: the module takes {spec.summary()} but was trained on {schema.input_dim} "
            "feature columns; a table cannot fill its input"
        )
    return schema


def _data_schema_of(uri: str) -> TableSchema | None:
    try:
        return _data_schema(read_checkpoint(uri))
    except (CheckpointError, ServingError) as err:
        raise ScoringError(str(err)) from err


def _check_columns(
    listing: Listing, schema: TableSchema, key_columns: tuple[str, ...], served: _Served
) -> None:
    """Every file holds every feature and key column, as preprocessing requires them;
    the keys do not clash with what the output adds."""
    taken = {*_prediction_keys(served), *_MODEL_COLUMNS, "reason", "text"}
    clashes = sorted(taken & set(key_columns))
    if clashes:
        raise ScoringError(
            f"key_columns {clashes} clash with columns the output adds "
            f"({sorted(taken)}); rename them in the input"
        )
    if len(set(key_columns)) != len(key_columns) or ROW_ID in key_columns:
        raise ScoringError(f"key_columns must name each column once, not {ROW_ID}: {key_columns}")
    names = [c.name for c in schema.features] + list(key_columns)
    for name in listing.names:
        url = listing.file_url(name)
        try:
            require_columns(url, _columns(url, listing.kind), names)
        except DataError as err:
            raise ScoringError(f"input {err}") from err


def _columns(url: str, kind: str) -> list[str]:
    """A file's column names, from its header (CSV) or footer (Parquet) alone."""
    fs, path = resolve(url)
    try:
        if kind == "parquet":
            with fs.open(path, "rb") as f:
                return list(pq.read_schema(f).names)
        with fs.open(path, "rb") as f:
            head = f.read(1 << 20)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{url} is not readable: {err}") from err
    if url.lower().endswith(".gz"):
        head = gunzip(url, read_bytes(url))
    return csv_header(url, head)


def _prediction_keys(served: _Served) -> list[str]:
    output = served.output
    return [output.key, "probabilities"] if output.kind == "classification" else [output.key]


# ---------------------------------------------------------------------------- blocks


def _blocks(job: Job, block_rows: int) -> list[Block]:
    """The input's blocks: ``block_rows`` rows of one file each, numbered by file and first
    row, so the same input cut the same way always gives the same ids."""
    blocks, first_row = [], 1
    for index in range(len(job.files)):
        rows = _file_row_count(job, index)
        for start in range(0, rows, block_rows):
            stop = min(start + block_rows, rows)
            blocks.append(
                Block(
                    id=f"{index:05d}-{start:012d}",
                    file=index,
                    start=start,
                    stop=stop,
                    first_row=first_row + start,
                )
            )
        first_row += rows
    return blocks


def _file_row_count(job: Job, index: int) -> int:
    url = job.file_url(index)
    if job.kind == "parquet":
        fs, path = resolve(url)
        with fs.open(path, "rb") as f:
            return pq.read_metadata(f).num_rows
    rows = _csv_rows(job, index)
    return rows.table.num_rows + len(rows.unsplit)


_CSV_CACHE: dict[tuple[str, tuple[str, ...]], Any] = {}


def _csv_rows(job: Job, index: int) -> Any:
    """A CSV file's rows as text (the features and keys), read once per process: a CSV
    cannot be read from the middle."""
    names = [c.name for c in job.features.features] + list(job.key_columns)
    url = job.file_url(index)
    cache_key = (url, tuple(names))
    if cache_key not in _CSV_CACHE:
        _CSV_CACHE.clear()
        _CSV_CACHE[cache_key] = file_rows(url, "csv", read_bytes(url), names)
    return _CSV_CACHE[cache_key]


def _read_block(job: Job, block: Block) -> tuple[Any, pa.Table]:
    """A block's rows (features as text, :func:`storage.rows.file_rows`'s form, numbered by
    :data:`ROW_ID`) and its key columns as the input holds them (text in a CSV)."""
    from ringflow.storage.rows import _Rows

    names = [c.name for c in job.features.features]
    if job.kind == "csv":
        rows = _csv_rows(job, 0)
        lo, hi = block.start + 1, block.stop  # CSV data rows are numbered from 1
        keep = np.flatnonzero((rows.source_row >= lo) & (rows.source_row <= hi))
        table = rows.table.take(pa.array(keep, pa.int64()))
        part = _Rows(
            table=table.select(names),
            source_row=rows.source_row[keep],
            unsplit=[u for u in rows.unsplit if lo <= u[0] <= hi],
        )
        keys = table.select(list(job.key_columns))
    else:
        table = _parquet_rows(job.file_url(block.file), block.start, block.stop)
        part = _text_rows(job.file_url(block.file), table, names, block.start)
        keys = table.select(list(job.key_columns))
    offset = block.first_row - block.start - 1  # file row number -> input-wide row number
    part = _Rows(
        table=part.table,
        source_row=part.source_row + offset,
        unsplit=[(n + offset, why, text) for n, why, text in part.unsplit],
    )
    return part, keys


def _parquet_rows(url: str, start: int, stop: int) -> pa.Table:
    """Rows ``start``..``stop`` of a Parquet file, reading only the row groups they lie in."""
    fs, path = resolve(url)
    with fs.open(path, "rb") as f:
        reader = pq.ParquetFile(f)
        groups, first, at = [], None, 0
        for g in range(reader.metadata.num_row_groups):
            rows = reader.metadata.row_group(g).num_rows
            if at < stop and at + rows > start:
                groups.append(g)
                first = at if first is None else first
            at += rows
        table = reader.read_row_groups(groups)
    return table.slice(start - (first or 0), stop - start)


def _text_rows(url: str, table: pa.Table, names: list[str], start: int) -> Any:
    """The feature columns as text, as preprocessing reads a Parquet file's values."""
    from ringflow.storage.rows import _Rows

    columns = {}
    for name in names:
        try:
            columns[name] = pc.cast(table[name], pa.string())
        except pa.ArrowException as err:
            raise DataError(
                f"{url}: column {name} has type {table.schema.field(name).type}, expected "
                "numbers or text"
            ) from err
    numbers = np.arange(start + 1, start + table.num_rows + 1)
    return _Rows(table=pa.table(columns), source_row=numbers, unsplit=[])


def score_block(job: Job, served: _Served, block: Block) -> dict[str, Any]:
    """Read, check and score one block; write its shards, then commit it by its record.

    Returns:
        The block's record (:func:`_commit` lists them in the manifest).
    """
    rows, keys = _read_block(job, block)
    values, problems = validate_rows(rows.table, job.features, features_only=True)
    problems = _outside_input_range(served, job.features, values, problems)
    valid = np.setdiff1d(np.arange(rows.table.num_rows), np.fromiter(problems, np.int64))
    files = []
    if len(valid):
        predictions = _predictions(job, served, rows, keys, values, valid)
        files.append(_write(job.output_url, f"predictions/part-{block.id}.parquet", predictions))
    rejected = _rejects(job, rows, keys, problems)
    if rejected.num_rows:
        files.append(_write(job.output_url, f"rejected/part-{block.id}.parquet", rejected))
    record = {
        "format": FORMAT,
        "block": block.id,
        "rows": int(len(valid)),
        "rejected": int(rejected.num_rows),
        "files": files,
    }
    commit_record(_block_url(job.output_url, block.id), record)
    return record


def _outside_input_range(
    served: _Served, schema: TableSchema, values: dict[str, np.ndarray], problems: dict[int, str]
) -> dict[int, str]:
    """Rows ``/predict`` would refuse beyond the data schema's checks: a value outside the
    module's declared ``input_schema`` range."""
    spec = served.spec
    if not isinstance(spec, InputSpec) or (spec.low is None and spec.high is None):
        return problems
    problems = dict(problems)
    low = -np.inf if spec.low is None else spec.low
    high = np.inf if spec.high is None else spec.high
    for column in schema.features:
        column_values = values[column.name]
        outside = np.flatnonzero((column_values < low) | (column_values > high))
        for index in outside.tolist():
            if index not in problems:
                problems[index] = (
                    f"column {column.name}: {column_values[index]:g} is outside the model's "
                    f"input range [{spec.low}, {spec.high}]"
                )
    return dict(sorted(problems.items()))


def _predictions(
    job: Job,
    served: _Served,
    rows: Any,
    keys: pa.Table,
    values: dict[str, np.ndarray],
    valid: np.ndarray,
) -> pa.Table:
    features = np.stack([values[c.name][valid] for c in job.features.features], axis=1)
    features = features.astype(np.float32)
    parts: dict[str, list] = {}
    device = next(served.module.parameters(), torch.empty(0)).device
    for start in range(0, len(features), job.batch_size):
        batch = torch.from_numpy(features[start : start + job.batch_size])
        x = _model_input(served.spec, batch).to(device)
        for key, column in served.output.columns(served.module, x).items():
            parts.setdefault(key, []).append(column)
    columns: dict[str, Any] = {}
    if job.key_columns:
        taken = keys.take(pa.array(valid, pa.int64()))
        columns |= {name: taken[name] for name in job.key_columns}
    else:
        columns[ROW_ID] = pa.array(rows.source_row[valid], pa.int64())
    for key, chunks in parts.items():
        columns[key] = _arrow_column(chunks)
    n = len(valid)
    tag = served.tag
    columns |= {
        "model_name": pa.array([job.name] * n, pa.string()),
        "model_version": pa.array([tag["version"]] * n, pa.string()),
        "model_fingerprint": pa.array([tag["fingerprint"]] * n, pa.string()),
    }
    return pa.table(columns)


def _model_input(spec: InputSpec | TableInput, batch: torch.Tensor) -> torch.Tensor:
    if isinstance(spec, InputSpec):
        return batch.reshape(len(batch), *spec.shape)
    return batch


def _arrow_column(chunks: list) -> pa.Array:
    if isinstance(chunks[0], torch.Tensor):
        tensor = torch.cat(chunks).numpy()
        if tensor.ndim == 2:  # probabilities: one list of floats per row
            flat = pa.array(tensor.reshape(-1))
            return pa.FixedSizeListArray.from_arrays(flat, tensor.shape[1])
        return pa.array(tensor)
    return pa.array([v for chunk in chunks for v in chunk])


def _rejects(job: Job, rows: Any, keys: pa.Table, problems: dict[int, str]) -> pa.Table:
    """The rejected rows with their reason and raw values (preprocessing's form), keyed."""
    table = sorted_rejects([rejects_table(rows, problems, job.features, features_only=True)])
    if not job.key_columns:
        return table
    # A CSV row that did not split into fields has no keys: null.
    numbers, wanted = rows.source_row, table["source_row"].to_numpy()
    at = np.searchsorted(numbers, wanted)
    found = np.zeros(len(wanted), dtype=bool)
    inside = at < len(numbers)
    found[inside] = numbers[at[inside]] == wanted[inside]
    index = pa.array(np.where(found, at, 0), pa.int64(), mask=~found)
    taken = keys.take(index)
    key_columns = {name: taken[name] for name in job.key_columns}
    return pa.table({**key_columns, **{n: table[n] for n in table.column_names}})


def _write(output_url: str, name: str, table: pa.Table) -> dict[str, Any]:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    data = sink.getvalue()
    atomic_write(join(output_url, name), data)
    return {"path": name, "rows": table.num_rows, "size": len(data), "sha256": sha256(data)}


# ---------------------------------------------------------------------------- commits


def _plan(job: Job, served: _Served, blocks: list[Block], block_rows: int) -> dict[str, Any]:
    """What this output is of: started again, a run must find the same plan."""
    return {
        "format": FORMAT,
        "input": {"url": job.input_url, "kind": job.kind, "files": list(job.files)},
        "model": {
            "registry": None if job.record is None else job.uri.rsplit("/versions/", 1)[0],
            "name": job.name,
            "version": served.tag["version"],
            "uri": served.tag["uri"],
            "module": served.tag["module"],
            "fingerprint": served.tag["fingerprint"],
        },
        "key_columns": list(job.key_columns) or [ROW_ID],
        "block_rows": block_rows,
        "blocks": [b.id for b in blocks],
    }


def _claim_plan(output_url: str, plan: dict[str, Any]) -> None:
    """Write the plan, or check that the one there is this run's."""
    existing = _read_json(join(output_url, PLAN))
    if existing is None:
        commit_record(join(output_url, PLAN), plan)
        return
    _check_same_plan(output_url, existing, plan)


def _check_same_plan(output_url: str, existing: dict[str, Any], plan: dict[str, Any]) -> None:
    parts = ("input", "model", "key_columns", "block_rows", "blocks")
    differs = [k for k in parts if existing.get(k) != plan[k]]
    if differs:
        raise ScoringError(
            f"output {output_url} holds a run of another plan (its {', '.join(differs)} "
            "differ); score into a new output URL (or run key), or remove it"
        )


def _committed_manifest(output_url: str, plan: dict[str, Any]) -> dict[str, Any] | None:
    manifest = _read_json(join(output_url, MANIFEST))
    if manifest is None:
        return None
    _check_same_plan(output_url, manifest.get("plan", {}), plan)
    return manifest


def _block_url(output_url: str, block_id: str) -> str:
    return join(output_url, "blocks", f"{block_id}.json")


def _block_record(output_url: str, block_id: str) -> dict[str, Any] | None:
    """The block's record if it committed, and its shards are there at their size."""
    record = _read_json(_block_url(output_url, block_id))
    if record is None or record.get("format") != FORMAT:
        return None
    fs, path = resolve(output_url)
    for entry in record.get("files", []):
        try:
            if fs.size(join(path, entry["path"])) != entry["size"]:
                return None
        except (FileNotFoundError, KeyError):
            return None
    return record


def _commit(output_url: str, plan: dict[str, Any], records: list[dict]) -> dict[str, Any]:
    files = [f for r in records for f in r["files"]]
    manifest = {
        "format": FORMAT,
        "plan": plan,
        "rows_scored": sum(r["rows"] for r in records),
        "rows_rejected": sum(r["rejected"] for r in records),
        "files": files,
    }
    commit_record(join(output_url, MANIFEST), manifest)
    return manifest


def _read_json(url: str) -> dict[str, Any] | None:
    try:
        value = json.loads(read_bytes(url))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # a damaged record commits nothing
    return value if isinstance(value, dict) else None


def _report(
    on_block: Callable[[BlockDone], None] | None,
    block_id: str,
    record: dict,
    *,
    skipped: bool,
    done: int,
    total: int,
) -> None:
    if on_block is None:
        return
    on_block(
        BlockDone(
            block=block_id,
            rows=record["rows"],
            rejected=record["rejected"],
            skipped=skipped,
            done=done,
            total=total,
        )
    )


def _result(
    manifest: dict[str, Any], output_url: str, *, scored: list[dict], engine: str, started: float
) -> ScoreResult:
    plan = manifest["plan"]
    return ScoreResult(
        output_url=output_url,
        manifest_url=join(output_url, MANIFEST),
        rows_scored=manifest["rows_scored"],
        rows_rejected=manifest["rows_rejected"],
        blocks=len(plan["blocks"]),
        blocks_scored=len(scored),
        rows_read=sum(r["rows"] + r["rejected"] for r in scored),
        engine=engine,
        seconds=time.perf_counter() - started,
        model=dict(plan["model"]),
    )
