"""Sharded checkpoints on any fsspec URL, committed by a manifest that is written last.

Layout under the store's URL, one directory per run key and per step::

    {url}/{run_key}/step-{step:012d}/{shard}.{attempt}.safetensors   one file per shard
    {url}/{run_key}/step-{step:012d}/manifest.json                   the commit, written last

A shard is a set of named tensors (one per data-parallel rank or pipeline stage, or one for
state that every rank shares). Every shard is written and checksummed first; the manifest,
listing each shard file with its size, checksum and tensors plus the JSON metadata and
metrics, and carrying a SHA-256 of itself, is then published atomically (rename on a file
system, a single PUT on an object store). A
step without a valid manifest does not exist. There is no "latest" pointer to go stale: the
latest checkpoint is the highest step whose manifest and shards verify, and a bad one is
skipped with a warning that names the bad file. Shard files carry a random attempt id, so
saving a step again never touches the files the committed manifest points at.

Old checkpoints are deleted by a :class:`RetentionPolicy` only after a newer one is
committed, manifest first, so a half-deleted checkpoint never looks committed. Leftovers of
interrupted writes (steps below the newest commit without a manifest, files no manifest
names) are removed after a later commit or by :meth:`CheckpointStore.cleanup`, never read.

One writer per run key at a time: where a run key has a lease (``storage.lease``, taken by
the ``train`` task), a manifest is published and a checkpoint deleted only by the lease's
holder, and a save whose lease changed hands while it was written is refused
(:class:`~storage.lease.LeaseLostError`), so a stale process never commits over, or deletes
what, the holder needs. A run key without a lease is not fenced.

Every storage call is retried on transient errors until ``RetryPolicy.deadline_s``; a call in
flight is bounded by the fsspec client's own timeouts (``read_timeout`` and the like in
``storage_options``), not interrupted by the store.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from ringflow.storage.checkpoint import CheckpointError
from ringflow.storage.commit import SealBroken, seal, unseal
from ringflow.storage.fs import absolute, join, publish
from ringflow.storage.lease import check_writer
from ringflow.storage.retry import CheckpointStorageError, RetryPolicy, call_with_retries
from ringflow.storage.tensorfile import (
    CHECKSUMS,
    TensorFileError,
    decode,
    encode,
    read_verified,
    write,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointStorageError",
    "CheckpointStore",
    "CommittedCheckpoint",
    "LoadedCheckpoint",
    "RetentionPolicy",
    "ShardRecord",
]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

_FORMAT = "ringflow.checkpoint/1"
_MANIFEST = "manifest.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")
_SHARD_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]*\.safetensors$")
_STEP_DIR = re.compile(r"^step-(\d{12})$")


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint fails verification: a file is missing, truncated or altered.

    Args:
        url: the bad file.
        reason: what is wrong with it.
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url = url
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.url} {self.reason}"


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which committed checkpoints of a run survive the commit of a newer one."""

    keep_last: int | None = 3
    """Keep the newest this many checkpoints; ``None`` keeps every checkpoint."""
    keep_best: int = 0
    """Also keep this many checkpoints with the best value of ``metric``."""
    metric: str | None = None
    """Name of the metric ranking checkpoints for ``keep_best``, a key of ``metrics``."""
    mode: Literal["min", "max"] = "min"
    """Whether the best value of ``metric`` is the smallest or the largest."""

    def __post_init__(self) -> None:
        if self.keep_last is not None and not (_is_int(self.keep_last) and self.keep_last >= 1):
            raise ValueError(
                f"RetentionPolicy.keep_last must be None or at least 1, got {self.keep_last!r}"
            )
        if not (_is_int(self.keep_best) and self.keep_best >= 0):
            raise ValueError(
                f"RetentionPolicy.keep_best must be at least 0, got {self.keep_best!r}"
            )
        if self.keep_best and not self.metric:
            raise ValueError(
                "RetentionPolicy.keep_best needs RetentionPolicy.metric, the metric name"
            )
        if self.mode not in ("min", "max"):
            raise ValueError(f"RetentionPolicy.mode must be 'min' or 'max', got {self.mode!r}")

    def steps_to_keep(self, checkpoints: Sequence[CommittedCheckpoint]) -> set[int]:
        """The steps of ``checkpoints`` to keep; one without a finite metric is never best."""
        ordered = sorted(checkpoints, key=lambda c: c.step)
        kept = ordered if self.keep_last is None else ordered[-self.keep_last :]
        keep = {c.step for c in kept}
        if self.keep_best and self.metric:
            sign = 1.0 if self.mode == "min" else -1.0
            scored = [c for c in ordered if _finite(c.metrics.get(self.metric))]
            scored.sort(key=lambda c: (sign * c.metrics[self.metric], -c.step))  # ties: newest
            keep |= {c.step for c in scored[: self.keep_best]}
        return keep


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """A written shard file, as the manifest records it. Small and picklable, so ranks can
    write their own shards and send the records to the one process that commits."""

    name: str
    """Shard name, such as ``"replicated"``, ``"rank-00001"`` or ``"stage-00000"``."""
    file: str
    """File name inside the step directory."""
    size: int
    """Bytes in the file."""
    checksum: str
    """Checksum of the file, ``"{algorithm}:{hex digest}"``, e.g. ``"crc32:1c291ca3"``."""
    tensors: dict[str, list[Any]]
    """``{tensor name: [safetensors dtype, shape]}`` of every tensor in the file."""


@dataclass(frozen=True, kw_only=True)
class CommittedCheckpoint:
    """A checkpoint whose manifest was published; what its manifest says."""

    url: str
    """URL of the step directory."""
    run_key: str
    """The run this checkpoint belongs to."""
    step: int
    """Training step the checkpoint was taken at."""
    shards: dict[str, ShardRecord]
    """Every shard by name."""
    metadata: dict[str, Any]
    """JSON metadata: epoch, sampler position, RNG seeds, world layout, configuration."""
    metrics: dict[str, float]
    """Metrics at this step; :class:`RetentionPolicy` may rank checkpoints by one."""
    created: str
    """UTC time of the commit, ISO 8601."""


@dataclass(frozen=True, kw_only=True)
class LoadedCheckpoint:
    """A verified checkpoint with the tensors of the shards that were asked for."""

    checkpoint: CommittedCheckpoint
    """What the manifest says."""
    shards: dict[str, dict[str, torch.Tensor]]
    """``{shard name: {tensor name: tensor}}``; CPU tensors, writable, each shard's tensors
    viewing one buffer read from storage."""

    @property
    def step(self) -> int:
        return self.checkpoint.step

    @property
    def metadata(self) -> dict[str, Any]:
        return self.checkpoint.metadata


class CheckpointStore:
    """Sharded, verified checkpoints of many runs under one fsspec URL.

    Args:
        url: root URL or local path: ``file://``, a plain path, ``memory://``, ``s3://``,
            ``gs://`` or ``az://`` when s3fs, gcsfs or adlfs is installed.
        retention: which checkpoints survive a newer commit.
        retry: how long each storage call is retried when it fails transiently.
        storage_options: keyword arguments for the fsspec filesystem, such as
            ``{"client_kwargs": {"endpoint_url": ...}}`` for an S3-compatible service.
        fsync: on a local disk, flush every file to the device before committing, so a power
            loss cannot leave a commit whose data never reached the disk. Object stores are
            durable once a PUT returns.
        checksum: algorithm of the shard checksums, ``"crc32"`` (fast; catches damage) or
            ``"sha256"``. Loading verifies whichever a shard was written with.

    Raises:
        ValueError: no fsspec implementation is installed for the URL's protocol.
    """

    def __init__(
        self,
        url: str,
        *,
        retention: RetentionPolicy | None = None,
        retry: RetryPolicy | None = None,
        storage_options: Mapping[str, Any] | None = None,
        fsync: bool = True,
        checksum: Literal["crc32", "sha256"] = "crc32",
    ) -> None:
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {CHECKSUMS}, got {checksum!r}")
        self.checksum = checksum
        self.url = absolute(url).rstrip("/")
        self.retention = retention or RetentionPolicy()
        self.retry = retry or RetryPolicy()
        self.fsync = fsync
        self._fs, self._root = _filesystem(self.url, dict(storage_options or {}))
        self._local = isinstance(self._fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    # ------------------------------------------------------------------------ writing

    def save(
        self,
        run_key: str,
        *,
        step: int,
        shards: Mapping[str, Mapping[str, torch.Tensor]],
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> CommittedCheckpoint:
        """Write every shard, then commit them with a manifest, then apply retention.

        Args:
            run_key: the run, e.g. the flow-run id; letters, digits and ``._=-``.
            step: training step, a non-negative integer; saving a step again replaces it.
            shards: ``{shard name: {tensor name: tensor}}``; tensors may live on any device.
            metadata: JSON-serialisable metadata stored in the manifest.
            metrics: numbers stored in the manifest, used by :class:`RetentionPolicy`.

        Returns:
            The committed checkpoint.

        Raises:
            ValueError: a bad name, step, tensor dtype, or metadata that is not JSON.
            CheckpointStorageError: storage kept failing until the retry deadline; nothing
                was committed and the previous checkpoint stays the latest.
        """
        if not shards:
            raise ValueError("shards must name at least one shard")
        # Checked before any byte is written, so a typo costs no orphaned shards.
        metadata, metrics = _json_copy(metadata or {}), _metrics(metrics or {})
        fence = self._check_writer(run_key, None, f"writing step {step} of run {run_key}")
        records = [
            self.write_shard(run_key, step=step, name=name, tensors=tensors)
            for name, tensors in shards.items()
        ]
        return self.commit(
            run_key, step=step, shards=records, metadata=metadata, metrics=metrics, fence=fence
        )

    def write_shard(
        self, run_key: str, *, step: int, name: str, tensors: Mapping[str, torch.Tensor]
    ) -> ShardRecord:
        """Write one shard of a checkpoint not yet committed; any process may call this.

        Returns:
            The record to pass to :meth:`commit` once every shard is written.
        """
        directory = self._path(_check_name("run_key", run_key), _step_dir(_check_step(step)))
        file = f"{_check_name('shard name', name)}.{uuid.uuid4().hex[:12]}.safetensors"
        encoded = encode(tensors)

        def write_file() -> str:
            if self._local:
                self._fs.makedirs(directory, exist_ok=True)
            path = join(directory, file)
            return write(self._fs, path, encoded, fsync=self.fsync, checksum=self.checksum)

        checksum = self._call(f"writing {self._url(run_key, _step_dir(step), file)}", write_file)
        return ShardRecord(
            name=name, file=file, size=encoded.size, checksum=checksum, tensors=encoded.index
        )

    def commit(
        self,
        run_key: str,
        *,
        step: int,
        shards: Sequence[ShardRecord],
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        fence: int | None = None,
    ) -> CommittedCheckpoint:
        """Publish the manifest of written shards, making the checkpoint exist; then apply
        retention and remove leftovers (failures there are logged, never raised).

        Args:
            fence: the lease token the shards were written under, if the run key had a
                lease then (:meth:`save` passes it); the commit is refused if it changed.

        Raises:
            ValueError: no shards, a shard name twice, or metadata that is not JSON.
            CheckpointStorageError: the manifest could not be written before the deadline.
            LeaseLostError: the run key's lease is held by another process, or changed hands.
        """
        names = [record.name for record in shards]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"commit needs shards with distinct names, got {names}")
        checkpoint = CommittedCheckpoint(
            url=self._url(_check_name("run_key", run_key), _step_dir(_check_step(step))),
            run_key=run_key,
            step=step,
            shards={record.name: record for record in shards},
            metadata=_json_copy(metadata or {}),
            metrics=_metrics(metrics or {}),
            created=datetime.now(UTC).isoformat(),
        )
        data = _manifest_bytes(checkpoint)
        path = self._path(run_key, _step_dir(step), _MANIFEST)
        self._check_writer(run_key, fence, f"committing {checkpoint.url}")
        self._call(f"committing {checkpoint.url}", lambda: self._publish(path, data))
        self._tidy(checkpoint)
        return checkpoint

    def check_writable(self) -> None:
        """Write and delete a marker file under the store's URL.

        Raises:
            CheckpointStorageError: the store is not writable (wrong URL or credentials).
        """
        path = join(self._root, f".ringflow-write-check-{uuid.uuid4().hex}")

        def probe() -> None:
            if self._local:
                self._fs.makedirs(self._root, exist_ok=True)
            self._fs.pipe_file(path, b"ok")
            self._fs.rm_file(path)

        try:
            self._call(f"checking that {self.url} is writable", probe)
        except (OSError, CheckpointStorageError) as err:
            raise CheckpointStorageError(
                f"cannot write checkpoints under {self.url}: {err}. Check the URL, the "
                "credentials and storage_options."
            ) from err

    # ------------------------------------------------------------------------ reading

    def checkpoints(self, run_key: str) -> list[CommittedCheckpoint]:
        """Every committed checkpoint of ``run_key`` with a valid manifest, oldest first.

        Shards are not verified; use :meth:`latest` or :meth:`load` for that.
        """
        return sorted(self._committed(run_key, quiet=True), key=lambda c: c.step)

    def steps_begun(self, run_key: str) -> list[int]:
        """Every step of ``run_key`` with a directory, committed or not (a save in progress,
        or one its writer died in), oldest first."""
        return self._steps(run_key)

    def latest(
        self, run_key: str, *, verify: Literal["checksum", "size", "manifest"] = "checksum"
    ) -> CommittedCheckpoint | None:
        """The newest checkpoint of ``run_key`` that verifies, or ``None`` if there is none.

        Checkpoints that fail verification are skipped with a warning naming the bad file.
        To resume, prefer :meth:`load_latest`, which reads each shard once.

        Args:
            run_key: the run.
            verify: ``"checksum"`` reads every shard and checks its checksum, ``"size"`` only
                checks that each shard exists with the recorded size, ``"manifest"`` trusts
                the shards.

        Raises:
            CheckpointStorageError: storage kept failing; no checkpoint was skipped for it.
        """
        for checkpoint in self._committed(run_key):
            try:
                self._verify(checkpoint, verify)
            except CheckpointCorruptError as err:
                _warn_skipped(checkpoint, err)
                continue
            return checkpoint
        return None

    def load(
        self, checkpoint: CommittedCheckpoint, *, shards: Sequence[str] | None = None
    ) -> LoadedCheckpoint:
        """Read and verify the shards named in ``shards`` (all by default).

        Raises:
            CheckpointError: ``shards`` names a shard the checkpoint lacks.
            CheckpointCorruptError: a shard is missing, fails its checksum or is not
                safetensors; the error names the file.
            CheckpointStorageError: storage kept failing.
        """
        names = list(checkpoint.shards) if shards is None else list(shards)
        missing = sorted(set(names) - set(checkpoint.shards))
        if missing:
            raise CheckpointError(
                f"{checkpoint.url} has no shard {missing}; it has {sorted(checkpoint.shards)}"
            )
        tensors = {name: self._read_shard(checkpoint, checkpoint.shards[name]) for name in names}
        return LoadedCheckpoint(checkpoint=checkpoint, shards=tensors)

    def load_latest(
        self, run_key: str, *, shards: Sequence[str] | None = None
    ) -> LoadedCheckpoint | None:
        """Load the newest checkpoint of ``run_key`` whose manifest and shards verify.

        A checkpoint with a missing or corrupt file is skipped with a warning that names the
        file, and the previous one is tried. Storage errors that outlast the retry deadline
        are raised rather than skipped, so a flaky store never silently resumes from an older
        step. Calling it again returns the same checkpoint until a newer one is committed.

        Returns:
            The loaded checkpoint, or ``None`` if ``run_key`` has none.
        """
        for checkpoint in self._committed(run_key):
            try:
                return self.load(checkpoint, shards=shards)
            except CheckpointCorruptError as err:
                _warn_skipped(checkpoint, err)
        return None

    # ------------------------------------------------------------------------ housekeeping

    def cleanup(self, run_key: str) -> list[str]:
        """Apply retention and remove leftovers of interrupted writes below the newest commit.

        Steps above the newest commit are left alone: they may be writes in progress.

        Returns:
            URLs of the removed step directories and files.
        """
        newest = next(self._committed(run_key, quiet=True), None)
        return [] if newest is None else self._sweep(newest)

    def _tidy(self, checkpoint: CommittedCheckpoint) -> None:
        try:
            removed = self._sweep(checkpoint)
        except Exception as err:  # housekeeping must never turn a commit into a failure
            _log.warning(
                "cleaning up after %s failed (%s); retrying after the next commit",
                checkpoint.url,
                err,
            )
            return
        if removed:
            _log.debug("removed after committing %s: %s", checkpoint.url, removed)

    def _sweep(self, newest: CommittedCheckpoint) -> list[str]:
        committed, garbage = [], []
        for step in self._steps(newest.run_key):
            if step >= newest.step:
                continue  # the new commit itself, or a write in progress
            try:
                found = self._read_manifest(newest.run_key, step)
            except CheckpointCorruptError:
                found = None  # damaged beyond use: as much a leftover as a missing manifest
            if found is None:
                garbage.append(step)
            else:
                committed.append(found)
        keep = self.retention.steps_to_keep([*committed, newest])
        removed = [
            self._remove_step(newest.run_key, c.step) for c in committed if c.step not in keep
        ]
        removed += [self._remove_step(newest.run_key, step) for step in garbage]
        return removed + self._remove_unreferenced(newest)

    def _remove_step(self, run_key: str, step: int) -> str:
        directory = self._path(run_key, _step_dir(step))
        url = self._url(run_key, _step_dir(step))
        self._check_writer(run_key, None, f"deleting {url}")
        # The manifest goes first, so a directory half deleted is never taken as committed.
        with suppress(FileNotFoundError):
            self._call(f"deleting {url}", lambda: self._fs.rm_file(join(directory, _MANIFEST)))
        with suppress(FileNotFoundError):
            self._call(f"deleting {url}", lambda: self._fs.rm(directory, recursive=True))
        return url

    def _remove_unreferenced(self, checkpoint: CommittedCheckpoint) -> list[str]:
        directory = self._path(checkpoint.run_key, _step_dir(checkpoint.step))
        wanted = {_MANIFEST, *(record.file for record in checkpoint.shards.values())}
        removed = []
        for path in self._list(directory, f"listing {checkpoint.url}"):
            name = path.rsplit("/", 1)[-1]
            if name not in wanted:
                self._check_writer(checkpoint.run_key, None, f"deleting {path}")
                with suppress(FileNotFoundError):
                    self._call(f"deleting {path}", lambda p=path: self._fs.rm(p, recursive=True))
                removed.append(join(checkpoint.url, name))
        return removed

    # ------------------------------------------------------------------------ internals

    def _committed(self, run_key: str, *, quiet: bool = False) -> Iterator[CommittedCheckpoint]:
        """Checkpoints with a valid manifest, newest first; others are skipped with a warning."""
        for step in reversed(self._steps(run_key)):
            manifest_url = self._url(run_key, _step_dir(step), _MANIFEST)
            try:
                checkpoint = self._read_manifest(run_key, step)
            except CheckpointCorruptError as err:
                if not quiet:
                    _log.warning("skipping step %d of run %s: %s", step, run_key, err)
                continue
            if checkpoint is None:
                if not quiet:
                    _log.warning(
                        "skipping step %d of run %s: %s is missing (an interrupted or "
                        "uncommitted write)",
                        step,
                        run_key,
                        manifest_url,
                    )
                continue
            yield checkpoint

    def _steps(self, run_key: str) -> list[int]:
        entries = self._list(self._path(_check_name("run_key", run_key)), f"listing {run_key}")
        found = (_STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1]) for entry in entries)
        return sorted({int(match.group(1)) for match in found if match})

    def _list(self, path: str, what: str) -> list[str]:
        def listing() -> list[str]:
            self._fs.invalidate_cache(path)  # object-store clients cache listings
            return self._fs.ls(path, detail=False)

        try:
            return self._call(what, listing)
        except FileNotFoundError:
            return []

    def _read_manifest(self, run_key: str, step: int) -> CommittedCheckpoint | None:
        """The checkpoint a manifest commits; ``None`` if there is no manifest."""
        path = self._path(run_key, _step_dir(step), _MANIFEST)
        url = self._url(run_key, _step_dir(step), _MANIFEST)
        try:
            data = self._call(f"reading {url}", lambda: self._fs.cat_file(path))
        except FileNotFoundError:
            return None
        return _parse_manifest(data, url=url, run_key=run_key, step=step)

    def _verify(self, checkpoint: CommittedCheckpoint, level: str) -> None:
        if level not in ("checksum", "size", "manifest"):
            raise ValueError(f"verify must be 'checksum', 'size' or 'manifest', got {level!r}")
        for record in checkpoint.shards.values():
            if level == "checksum":
                self._read_bytes(checkpoint, record)
            elif level == "size":
                path = self._path(checkpoint.run_key, _step_dir(checkpoint.step), record.file)
                url = join(checkpoint.url, record.file)
                try:
                    size = self._call(f"checking {url}", lambda p=path: self._size(p))
                except FileNotFoundError as err:
                    raise CheckpointCorruptError(url, "is missing") from err
                if size != record.size:
                    raise CheckpointCorruptError(
                        url, f"has {size} bytes, the manifest says {record.size}"
                    )

    def _read_bytes(self, checkpoint: CommittedCheckpoint, record: ShardRecord) -> torch.Tensor:
        path = self._path(checkpoint.run_key, _step_dir(checkpoint.step), record.file)
        url = join(checkpoint.url, record.file)
        try:
            return self._call(
                f"reading {url}",
                lambda: read_verified(self._fs, path, size=record.size, checksum=record.checksum),
            )
        except FileNotFoundError as err:
            raise CheckpointCorruptError(url, "is missing") from err
        except TensorFileError as err:
            raise CheckpointCorruptError(url, str(err)) from err

    def _read_shard(
        self, checkpoint: CommittedCheckpoint, record: ShardRecord
    ) -> dict[str, torch.Tensor]:
        url = join(checkpoint.url, record.file)
        try:
            tensors, index = decode(self._read_bytes(checkpoint, record))
        except TensorFileError as err:
            raise CheckpointCorruptError(url, f"is not a valid safetensors file: {err}") from err
        if index != record.tensors:
            raise CheckpointCorruptError(url, "holds other tensors than its manifest lists")
        return tensors

    def _publish(self, path: str, data: bytes) -> None:
        """Make ``path`` hold ``data`` in one step: a rename on disk, a single PUT elsewhere."""
        publish(self._fs, path, data, fsync=self.fsync)
        if self._local and self.fsync:
            directory = path.rsplit("/", 1)[0]
            # The rename and the step directory's own entry must reach the disk as well.
            _fsync_directory(directory)
            _fsync_directory(directory.rsplit("/", 1)[0])

    def _check_writer(self, run_key: str, fence: int | None, what: str) -> int | None:
        """The run key's lease token after checking this process may write it (``None``:
        the run key has no lease)."""
        directory = self._path(_check_name("run_key", run_key))
        return self._call(
            f"checking the lease of run {run_key}",
            lambda: check_writer(self._fs, directory, run_key=run_key, token=fence, what=what),
        )

    def _size(self, path: str) -> int:
        self._fs.invalidate_cache(path)
        return self._fs.size(path)

    def _call(self, what: str, call: Callable[[], _T]) -> _T:
        return call_with_retries(self.retry, what, call)

    def _path(self, *parts: str) -> str:
        return join(self._root, *parts)

    def _url(self, *parts: str) -> str:
        return join(self.url, *parts)


# ---------------------------------------------------------------------------- manifest


def _manifest_bytes(checkpoint: CommittedCheckpoint) -> bytes:
    body = {
        "format": _FORMAT,
        "run_key": checkpoint.run_key,
        "step": checkpoint.step,
        "created": checkpoint.created,
        "metadata": checkpoint.metadata,
        "metrics": checkpoint.metrics,
        "shards": {
            name: {"file": r.file, "size": r.size, "checksum": r.checksum, "tensors": r.tensors}
            for name, r in checkpoint.shards.items()
        },
    }
    # No indent: json's C encoder serves only unindented output, and the manifest carries the
    # optimizer's metadata (a few entries per parameter), which the pure-Python one takes
    # milliseconds to write while holding the GIL the training thread needs.
    return seal(body)


def _parse_manifest(data: bytes, *, url: str, run_key: str, step: int) -> CommittedCheckpoint:
    """Check a manifest's checksum and structure.

    Raises:
        CheckpointCorruptError: anything is off; the checksum guards against damage, the
            structure checks against a manifest forged or written by another program.
    """
    try:
        body = unseal(data)
    except SealBroken as err:
        if err.damaged:
            raise CheckpointCorruptError(url, "fails its checksum (damaged or edited)") from err
        raise CheckpointCorruptError(url, f"is not a manifest: {err}") from err
    if body.get("format") != _FORMAT:
        raise CheckpointCorruptError(url, f"has unknown format {body.get('format')!r}")
    if body.get("run_key") != run_key or body.get("step") != step:
        raise CheckpointCorruptError(url, "belongs to another run or step (copied?)")
    try:
        shards = {name: _shard_record(name, entry) for name, entry in body["shards"].items()}
        return CommittedCheckpoint(
            url=url.rsplit("/", 1)[0],
            run_key=run_key,
            step=step,
            shards=shards,
            metadata=dict(body["metadata"]),
            metrics={str(k): float(v) for k, v in body["metrics"].items()},
            created=str(body["created"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointCorruptError(url, f"is malformed: {err}") from err


def _shard_record(name: str, entry: dict[str, Any]) -> ShardRecord:
    # A file name with a slash could point outside the checkpoint; refuse it.
    if not (
        _NAME.match(name) and isinstance(entry["file"], str) and _SHARD_FILE.match(entry["file"])
    ):
        raise ValueError(f"shard {name!r} has an unsafe name or file {entry.get('file')!r}")
    checksum = entry["checksum"]
    if not (_is_int(entry["size"]) and isinstance(checksum, str)):
        raise ValueError(f"shard {name!r} has a malformed size or checksum")
    return ShardRecord(
        name=name,
        file=entry["file"],
        size=entry["size"],
        checksum=checksum,
        tensors=dict(entry["tensors"]),
    )


# ---------------------------------------------------------------------------- helpers


def _filesystem(url: str, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as err:
        raise ValueError(
            f"cannot open {url!r}: {err}. Install the fsspec package for its protocol "
            "(s3fs for s3://, gcsfs for gs://, adlfs for az://) or use a local path."
        ) from err
    return fs, path.rstrip("/") or path


def _step_dir(step: int) -> str:
    return f"step-{step:012d}"


def _check_name(what: str, name: Any) -> str:
    if not (isinstance(name, str) and _NAME.match(name)):
        raise ValueError(
            f"{what} must be 1-200 letters, digits or '._=-' starting with a letter or digit, "
            f"got {name!r}"
        )
    return name


def _check_step(step: Any) -> int:
    if not (_is_int(step) and 0 <= step < 10**12):
        raise ValueError(f"step must be an integer from 0 to 10**12 - 1, got {step!r}")
    return step


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _json_copy(metadata: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as err:
        raise ValueError(f"metadata must be JSON-serialisable: {err}") from err


def _metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    try:
        return {str(name): float(value) for name, value in metrics.items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"metrics must map names to numbers: {err}") from err


def _warn_skipped(checkpoint: CommittedCheckpoint, err: CheckpointCorruptError) -> None:
    _log.warning(
        "skipping step %d of run %s, falling back to an earlier checkpoint: %s",
        checkpoint.step,
        checkpoint.run_key,
        err,
    )


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
