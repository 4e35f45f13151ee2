"""Asynchronous checkpoint saves: the training step waits only while state is copied to host.

:class:`AsyncCheckpointer` copies the tensors into host buffers, then a background thread
writes and commits them through a :class:`~storage.store.CheckpointStore`. The copy happens
in :meth:`~AsyncCheckpointer.save` itself, or, with ``overlap=True``, in a second background
thread while the next forward and backward pass run, fenced before ``optimizer.step()``
(CheckFreq's snapshot pipelining). A save that fails is retried with backoff until a
deadline, then recorded in :attr:`AsyncCheckpointer.errors` and logged; it never commits
anything, so the latest checkpoint stays the previous one, and training goes on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ringflow.storage.retry import (
    CheckpointStorageError,
    RetryPolicy,
    call_with_retries,
    is_transient,
)
from ringflow.storage.store import (
    CheckpointStore,
    CommittedCheckpoint,
    _check_name,
    _check_step,
    _metrics,
)

__all__ = ["AsyncCheckpointer", "SaveFailure", "copy_to_host", "host_buffer"]

_log = logging.getLogger(__name__)

_Shards = dict[str, dict[str, torch.Tensor]]
_Signature = tuple[tuple[str, str, torch.dtype, tuple[int, ...], str], ...]
_Collect = Callable[[], tuple[Mapping[str, Mapping[str, torch.Tensor]], Mapping[str, Any]]]
"""What ``AsyncCheckpointer.save(collect=...)`` calls: returns ``(shards, metadata)``."""


@dataclass(frozen=True, kw_only=True)
class SaveFailure:
    """A background save that was given up after its retries."""

    run_key: str
    """Run of the failed save."""
    step: int
    """Step of the failed save; it was never committed."""
    error: str
    """The last error, as ``Type: message``."""
    attempts: int
    """How many times the whole save was attempted."""
    failed_at: float
    """When it was given up, as a Unix timestamp."""


@dataclass(frozen=True, kw_only=True)
class _Request:
    """A save as asked for: references to the caller's tensors, not yet copied."""

    run_key: str
    step: int
    shards: _Shards | None
    """``None`` when ``collect`` gathers them in the background."""
    metadata_json: str
    metrics: dict[str, float]
    collect: _Collect | None

    def gathered(self) -> tuple[_Shards, str]:
        """The shards and the metadata as JSON, gathered now if ``collect`` was given."""
        if self.collect is None:
            assert self.shards is not None
            return self.shards, self.metadata_json
        return _prepared(*self.collect())


@dataclass(kw_only=True)
class _Snapshot:
    run_key: str
    step: int
    shards: _Shards
    signature: _Signature
    buffers: list[torch.Tensor]
    metadata_json: str
    """Parsed in the background: serialising checks it and freezes it, and is half the cost."""
    metrics: dict[str, float]


class AsyncCheckpointer:
    """Saves checkpoints in a background thread with bounded host memory.

    At most one save is being written and at most one waits behind it. A newer save
    *replaces* the waiting one, whose snapshot is dropped and counted in :attr:`replaced`:
    resuming wants the newest state, and waiting instead would stall training whenever
    storage is slow. Host memory therefore holds at most two copies of the state, and their
    buffers are reused from save to save, since allocating fresh pages costs more than the copy.

    The caller must not change the tensors while :meth:`save` runs; once it returns they are
    free to change, unless it was called with ``overlap=True``: then they are copied in the
    background and must stay unchanged until :meth:`fence` returns. :meth:`guard` makes
    ``optimizer.step()`` call :meth:`fence` first, which covers parameters and optimizer
    state; tensors changed elsewhere (BatchNorm running statistics change in the forward
    pass) need a :meth:`fence` before that change. Call :meth:`save` from one thread.

    Args:
        store: where checkpoints go.
        retry: backoff and deadline for a whole save; a save still failing at the deadline is
            recorded in :attr:`errors`. Each storage call inside is also retried by
            ``store.retry``.
        on_commit: called in the background thread with each committed checkpoint.
        check_writable: write a marker file now, so a wrong URL or credentials fail here
            rather than in the background.
        max_errors: how many failures :attr:`errors` keeps (the newest).

    Raises:
        CheckpointStorageError: ``check_writable`` and the store is not writable.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        retry: RetryPolicy | None = None,
        on_commit: Callable[[CommittedCheckpoint], None] | None = None,
        check_writable: bool = True,
        max_errors: int = 100,
    ) -> None:
        if check_writable:
            store.check_writable()
        self.store = store
        self.retry = retry or RetryPolicy(deadline_s=300.0, max_backoff_s=30.0)
        self.on_commit = on_commit
        self.replaced = 0
        """Saves dropped because a newer one replaced them while they waited."""
        self.stalled_s = 0.0
        """Total seconds :meth:`save` has blocked its caller."""
        self.last_committed: CommittedCheckpoint | None = None
        """The newest checkpoint this checkpointer committed."""
        self._errors: collections.deque[SaveFailure] = collections.deque(maxlen=max_errors)
        self._copier = concurrent.futures.ThreadPoolExecutor(1, "ringflow-snapshot")
        self._copying: concurrent.futures.Future[None] | None = None
        self._staging = _StagingBuffers()
        self._cond = threading.Condition()
        self._save_lock = threading.Lock()
        self._pending: _Snapshot | None = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ringflow-checkpointer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------ caller side

    def save(
        self,
        run_key: str,
        *,
        step: int,
        shards: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        overlap: bool = False,
        collect: _Collect | None = None,
    ) -> None:
        """Copy the state to host memory and queue it for writing; return without waiting.

        Arguments are those of :meth:`CheckpointStore.save`; they are checked here, so a bad
        name or non-JSON metadata raises in the caller rather than failing in the background.

        Args:
            run_key: the run.
            step: the training step.
            shards: ``{shard name: {tensor name: tensor}}``.
            metadata: JSON metadata, serialised now.
            metrics: numbers for the manifest and for retention.
            overlap: copy the tensors in the background instead of now; they must not
                change until :meth:`fence` returns (see :meth:`guard`).
            collect: instead of ``shards`` and ``metadata``, a function returning
                ``(shards, metadata)``. With ``overlap`` it runs in the background too, so
                the caller waits for nothing but the hand-off; a bad name or non-JSON
                metadata it returns then raises from the next :meth:`fence`.

        Raises:
            ValueError: a bad name, step or metadata, or both or neither of ``shards``
                and ``collect``.
            RuntimeError: the checkpointer is closed.
        """
        if (shards is None) == (collect is None):
            raise ValueError("pass the state as exactly one of shards= and collect=")
        if collect is not None and metadata is not None:
            raise ValueError("collect= returns the metadata; do not pass metadata= with it")
        self.fence()  # the previous copy must be done: it may be writing into our buffers
        started = time.perf_counter()
        with self._save_lock:
            _check_name("run_key", run_key)
            _check_step(step)
            metrics_copy = _metrics(metrics or {})
            if collect is not None and not overlap:
                shards, metadata = collect()
                collect = None
            metadata_json = ""
            if shards is not None:
                shards, metadata_json = _prepared(shards, metadata)
            dropped = self._take_pending()
            if dropped is not None:
                self.replaced += 1
                _log.info(
                    "step %d replaces step %d, still waiting to be written", step, dropped.step
                )
            request = _Request(
                run_key=run_key,
                step=step,
                shards=shards,
                metadata_json=metadata_json,
                metrics=metrics_copy,
                collect=collect,
            )
            if overlap:
                self._copying = self._copier.submit(self._snapshot, request, dropped)
            else:
                self._snapshot(request, dropped)
        self.stalled_s += time.perf_counter() - started

    def fence(self) -> None:
        """Wait until the tensors of a ``save(overlap=True)`` are copied; then they may change.

        Raises:
            Exception: whatever the background copy raised.
        """
        copying, self._copying = self._copying, None
        if copying is not None:
            started = time.perf_counter()
            try:
                copying.result()
            finally:
                self.stalled_s += time.perf_counter() - started

    def guard(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module | None = None) -> Any:
        """Make every ``optimizer.step()`` first wait for a background copy (:meth:`fence`).

        Given the ``module``, and if it holds buffers (a forward pass may change them, as
        BatchNorm's running statistics), its forward pass waits for the copy too.

        Returns:
            A handle; ``handle.remove()`` undoes it.
        """
        handles = [optimizer.register_step_pre_hook(lambda *_: self.fence())]
        if module is not None and any(True for _ in module.buffers()):
            handles.append(module.register_forward_pre_hook(lambda *_: self.fence()))
        return _Handles(handles)

    def _snapshot(self, request: _Request, dropped: _Snapshot | None) -> None:
        shards, metadata_json = request.gathered()
        copied, signature, buffers = self._staging.copy(shards, reuse=dropped)
        self._post(
            _Snapshot(
                run_key=request.run_key,
                step=request.step,
                shards=copied,
                signature=signature,
                buffers=buffers,
                metadata_json=metadata_json,
                metrics=request.metrics,
            )
        )

    def _take_pending(self) -> _Snapshot | None:
        with self._cond:
            if self._closed:
                raise RuntimeError("AsyncCheckpointer is closed; create a new one to save")
            dropped, self._pending = self._pending, None
            return dropped

    def _post(self, snapshot: _Snapshot) -> None:
        with self._cond:
            self._pending = snapshot
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued save is committed or given up.

        Returns:
            ``False`` if ``timeout`` seconds passed first.
        """
        self.fence()
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued saves (up to ``timeout`` seconds) and stop the background thread."""
        self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._copier.shutdown(wait=False)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def errors(self) -> tuple[SaveFailure, ...]:
        """Saves given up after their retries, oldest first."""
        return tuple(self._errors)

    @property
    def last_error(self) -> SaveFailure | None:
        """The most recent save given up, if any."""
        return self._errors[-1] if self._errors else None

    # ------------------------------------------------------------------------ background

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return  # closed, nothing left to write
                snapshot, self._pending = self._pending, None
                self._busy = True
            try:
                self._write(snapshot)
            finally:
                self._staging.release(snapshot)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, snapshot: _Snapshot) -> None:
        attempts = 0

        def attempt() -> CommittedCheckpoint:
            nonlocal attempts
            attempts += 1
            return self.store.save(
                snapshot.run_key,
                step=snapshot.step,
                shards=snapshot.shards,
                metadata=json.loads(snapshot.metadata_json),
                metrics=snapshot.metrics,
            )

        what = f"saving step {snapshot.step} of run {snapshot.run_key} to {self.store.url}"
        try:
            checkpoint = call_with_retries(self.retry, what, attempt, transient=_retryable)
        except Exception as err:  # a failed save must not stop training: record and go on
            self._record_failure(snapshot, err, attempts)
            return
        self.last_committed = checkpoint
        if self.on_commit is not None:
            try:
                self.on_commit(checkpoint)
            except Exception:  # the user's callback must not kill the writer thread
                _log.exception("on_commit callback failed for %s", checkpoint.url)

    def _record_failure(self, snapshot: _Snapshot, error: Exception, attempts: int) -> None:
        failure = SaveFailure(
            run_key=snapshot.run_key,
            step=snapshot.step,
            error=f"{type(error).__name__}: {error}",
            attempts=attempts,
            failed_at=time.time(),
        )
        self._errors.append(failure)
        _log.error(
            "checkpoint of step %d of run %s was not saved after %d attempts: %s",
            snapshot.step,
            snapshot.run_key,
            attempts,
            failure.error,
        )


class _Handles:
    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _prepared(
    shards: Mapping[str, Mapping[str, torch.Tensor]], metadata: Mapping[str, Any] | None
) -> tuple[_Shards, str]:
    """Check a save's shards and metadata as the store would; return the shards as plain
    dicts and the metadata as JSON text."""
    if not shards:
        raise ValueError("shards must name at least one shard")
    for name in shards:
        _check_name("shard name", name)
    try:
        metadata_json = json.dumps(dict(metadata or {}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"metadata must be JSON-serialisable: {err}") from err
    return {name: dict(tensors) for name, tensors in shards.items()}, metadata_json


def _retryable(error: BaseException) -> bool:
    # The store gives up on a single call at its own deadline; the whole save may still be
    # retried until this checkpointer's longer one.
    return isinstance(error, CheckpointStorageError) or is_transient(error)


class _StagingBuffers:
    """Host buffers for snapshots, reused while the state keeps its layout.

    One free set is kept; with one snapshot being written and one waiting, at most two sets
    are alive at any time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: tuple[_Signature, list[torch.Tensor]] | None = None

    def copy(
        self, shards: Mapping[str, Mapping[str, torch.Tensor]], *, reuse: _Snapshot | None
    ) -> tuple[_Shards, _Signature, list[torch.Tensor]]:
        """Copy ``shards`` into host buffers (reused when the layout matches).

        Returns:
            The copied shards, their layout, and the flat list of buffers behind them.
        """
        named = [(s, n, t) for s, tensors in shards.items() for n, t in tensors.items()]
        signature = tuple((s, n, t.dtype, tuple(t.shape), t.device.type) for s, n, t in named)
        targets = self._take(signature, reuse) or [host_buffer(t) for _, _, t in named]
        copy_to_host(targets, [t for _, _, t in named])
        copied: _Shards = {shard: {} for shard in shards}
        for (shard, name, _), target in zip(named, targets, strict=True):
            copied[shard][name] = target
        return copied, signature, targets

    def release(self, snapshot: _Snapshot) -> None:
        with self._lock:
            self._free = (snapshot.signature, snapshot.buffers)

    def _take(self, signature: _Signature, reuse: _Snapshot | None) -> list[torch.Tensor] | None:
        if reuse is not None and reuse.signature == signature:
            return reuse.buffers
        with self._lock:
            free, self._free = self._free, None
        return free[1] if free is not None and free[0] == signature else None


def copy_to_host(
    targets: list[torch.Tensor],
    sources: list[torch.Tensor],
    *,
    stream: torch.cuda.Stream | None = None,
    after: torch.cuda.Event | None = None,
) -> torch.cuda.Event | None:
    """Copy each of ``sources`` into its host tensor in ``targets``.

    A GPU's tensors go as asynchronous copies into pinned memory (:func:`host_buffer`), all
    queued before one wait, at the bus's rate; host tensors in one call. Without ``stream``
    it returns once all landed. With one, the GPU's copies are queued on it after what the
    current stream queued so far (or, given ``after``, after that event: the sources' values
    as of when it was recorded), and nothing waits: the returned event marks their landing
    (``None`` where no source is on a GPU). Until then the caller must neither change the
    sources (make its stream wait for the event) nor read the targets (synchronize it).
    """
    with torch.no_grad():
        if all(source.device.type == "cpu" for source in sources):
            # One call for all tensors: a Python loop of copy_ costs more than the copies
            # themselves for a small model, and this is time the training step waits.
            torch._foreach_copy_(targets, sources)
            return None
        side = contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
        if stream is not None and after is not None:
            stream.wait_event(after)
        elif stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with side:
            for target, source in zip(targets, sources, strict=True):
                on_gpu = source.device.type == "cuda"
                target.copy_(source, non_blocking=on_gpu)
                if on_gpu and stream is not None:
                    source.record_stream(stream)  # not freed for reuse before it is read
        if stream is None:
            torch.cuda.synchronize()  # the non-blocking copies must land before we return
            return None
        landed = torch.cuda.Event()
        landed.record(stream)
        return landed


def host_buffer(source: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for a copy of ``source``, pinned if ``source`` is on a GPU (the
    copy is then asynchronous, and several times faster than into pageable memory)."""
    pinned = source.device.type == "cuda"
    return torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
