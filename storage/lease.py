"""One writer per run key: a lease in storage, with an expiry and a fencing token.

Layout, beside the run's checkpoints (``storage.store``)::

    {url}/{run_key}/lease-{token:012d}.json

Taking a run key creates the file of the next token *exclusively* (a hard link of a complete
temporary file on a local disk, a conditional PUT, ``If-None-Match: *``, on S3), so of two
processes racing for a run key exactly one gets each token. The holder is the writer of the
highest token. It renews its own file's expiry every third of ``ttl_s`` and marks it released
when done. A lease is free once it is released, once it has expired, or, sooner, once its
holder is a process of this machine that no longer exists; on this machine a living holder
keeps its lease even when a renewal came late, so load never hands a run to a second process.

The token fences writers off: :class:`~storage.store.CheckpointStore` checks, before it
publishes a manifest and before every deletion of its retention, that the run key's lease
(if it has one) is held by this writer and has the token it had when the save began. A
writer belongs to the holder when it is the holder's process or a Ray worker of the
holder's Ray job (Ray ends those when the job's driver dies, but not at the same instant).
A run key without any lease is not fenced, so ``engine.fit`` keeps working on its own.

Leases are JSON, never unpickled, and published whole (rename or single PUT), so a reader
never sees half of one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import fsspec

from ringflow.storage.checkpoint import CheckpointError
from ringflow.storage.fs import absolute, create_once, join, publish

__all__ = [
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
    "LeaseRecord",
    "RunLease",
    "check_writer",
    "current_lease",
    "read_lease",
    "this_process",
]

_log = logging.getLogger(__name__)

_FORMAT = "ringflow.lease/1"
_FILE = re.compile(r"^lease-(\d{12})\.json$")


class LeaseError(CheckpointError):
    """A run key's lease cannot be read, taken or kept."""


class LeaseHeldError(LeaseError, ValueError):
    """Another live process holds the run key: this one must not train it.

    A ``ValueError`` too: for the run that is refused, its run key is a value in use.

    Args:
        message: one line naming the holder.
        lease: the holder's lease.
    """

    def __init__(self, message: str, lease: LeaseRecord | None = None) -> None:
        super().__init__(message)
        self.lease = lease


class LeaseLostError(LeaseError):
    """This writer does not hold the run key's lease (any more): it is fenced off."""


@dataclass(frozen=True, kw_only=True)
class LeaseRecord:
    """What a lease file says."""

    run_key: str
    token: int
    """The fencing token: one more than the token of the lease it replaced."""
    holder: dict[str, Any]
    """Who holds it: ``machine``, ``host``, ``pid``, ``pid_start``, ``ray_job``, and what the
    caller added (the flow run and its start)."""
    acquired: float
    """Unix time of the acquisition."""
    renewed: float
    """Unix time of the latest renewal."""
    expires: float
    """Unix time after which the lease is free unless renewed."""
    released: bool = False
    """The holder is done with the run key."""
    note: dict[str, Any] = field(default_factory=dict)
    """Free JSON the holder keeps with its lease (what it took over, how far that got)."""

    def describe(self, now: float | None = None) -> str:
        """One line naming the holder, for messages."""
        now = time.time() if now is None else now
        who = self.holder
        run = f"flow run {who['flow_run']} " if who.get("flow_run") else ""
        start = f"start {who['start']} " if who.get("start") else ""
        state = (
            "released"
            if self.released
            else f"renewed {now - self.renewed:.0f} s ago, expires in {self.expires - now:.0f} s"
        )
        return (
            f"{run}{start}(pid {who.get('pid')} on {who.get('host')}, token {self.token}, {state})"
        ).strip()

    def to_json(self) -> bytes:
        body = {
            "format": _FORMAT,
            "run_key": self.run_key,
            "token": self.token,
            "holder": self.holder,
            "acquired": self.acquired,
            "renewed": self.renewed,
            "expires": self.expires,
            "released": self.released,
            "note": self.note,
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, url: str) -> LeaseRecord:
        try:
            body = json.loads(data)
            if body.get("format") != _FORMAT:
                raise ValueError(f"unknown format {body.get('format')!r}")
            return cls(
                run_key=str(body["run_key"]),
                token=int(body["token"]),
                holder=dict(body["holder"]),
                acquired=float(body["acquired"]),
                renewed=float(body["renewed"]),
                expires=float(body["expires"]),
                released=bool(body["released"]),
                note=dict(body.get("note") or {}),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise LeaseError(f"{url} is not a lease: {err}") from err


# ---------------------------------------------------------------------------- identity


def this_process() -> dict[str, Any]:
    """Who this process is, as a lease records its holder and a writer is checked against it.

    ``machine`` tells whether a pid can be checked from here: the host name, the kernel's
    boot id and the pid namespace. ``ray_job`` is the Ray job this process belongs to
    (the driver's or, in a Ray worker, the one that created it, or the one a warm worker
    serves now: :data:`SERVED_JOB`), when Ray is initialised.
    """
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "machine": _machine(),
        "pid": pid,
        "pid_start": _pid_start(pid),
        "ray_job": _ray_job(),
        "delegate_of": os.environ.get(DELEGATE) or None,
    }


def _machine() -> str:
    parts = [socket.gethostname()]
    with suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    with suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return "/".join(parts)


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), telling a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


SERVED_JOB = "RINGFLOW_RAY_JOB"
"""Set in a worker process that outlives runs (``engine.pool``) to the Ray job of the run it
serves now: it writes as that job, not as the one that started the process."""


def _ray_job() -> str | None:
    if os.environ.get(SERVED_JOB):
        return os.environ[SERVED_JOB]
    ray = sys.modules.get("ray")  # never imported here: a process without Ray has no job
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_job_id()}"


def _gone(holder: Mapping[str, Any]) -> bool:
    """Whether the holder is a process of this machine that has ended (or is a zombie)."""
    pid = holder.get("pid")
    if holder.get("machine") != _machine() or not isinstance(pid, int):
        return False
    start = _pid_start(pid)
    if start is not None:
        return holder.get("pid_start") not in (None, start)  # another process has the pid
    if os.path.exists("/proc/self/stat"):
        return True  # Linux: no such process, or a zombie
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _free(lease: LeaseRecord | None, now: float) -> bool:
    """Whether a lease may be taken: none, released, or its holder gone. On this machine
    the holder's process decides, elsewhere the expiry."""
    if lease is None or lease.released:
        return True
    if lease.holder.get("machine") == _machine():
        return _gone(lease.holder)
    return lease.expires < now


DELEGATE = "RINGFLOW_LEASE_DELEGATE"
"""A process started by a lease's holder to write for it (a Horovod script's ranks) finds
the lease's ``nonce`` here: it may write while that lease holds, never after it changed
hands. Fencing, not a secret: whoever may write the storage may write the run anyway."""


def _same_writer(holder: Mapping[str, Any], me: Mapping[str, Any]) -> bool:
    if holder.get("ray_job") and holder.get("ray_job") == me.get("ray_job"):
        return True
    if me.get("delegate_of") and me.get("delegate_of") == holder.get("nonce"):
        return True
    return holder.get("machine") == me.get("machine") and holder.get("pid") == me.get("pid")


# ---------------------------------------------------------------------------- storage


def current_lease(
    fs: fsspec.AbstractFileSystem, directory: str, *, url: str = ""
) -> LeaseRecord | None:
    """The lease with the highest token in ``directory`` (a run key's), or ``None``.

    Raises:
        LeaseError: that lease file is unreadable or malformed (never taken as free).
    """
    tokens = _tokens(fs, directory)
    if not tokens:
        return None
    path = join(directory, _name(tokens[-1]))
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:  # replaced by a newer token while listing: look again
        return current_lease(fs, directory, url=url)
    return LeaseRecord.from_json(data, url=join(url, _name(tokens[-1])) if url else path)


def read_lease(url: str, **storage_options: Any) -> LeaseRecord | None:
    """The current lease of the run whose checkpoints are under ``url`` (``{store}/{run key}``).

    Raises:
        LeaseError: the lease file is malformed.
    """
    fs, path = fsspec.core.url_to_fs(absolute(url), **storage_options)
    return current_lease(fs, path.rstrip("/"), url=url)


def check_writer(
    fs: fsspec.AbstractFileSystem,
    directory: str,
    *,
    run_key: str,
    token: int | None,
    what: str,
) -> int | None:
    """Refuse ``what`` unless this process may write the run key.

    Args:
        token: the lease token the write began under (``None``: no lease then).

    Returns:
        The current token, ``None`` when the run key has no lease.

    Raises:
        LeaseLostError: the run key is held by another process, or its token changed.
    """
    lease = current_lease(fs, directory)
    if lease is None:
        if token is not None:
            raise LeaseLostError(f"not {what}: the lease of run {run_key} is gone")
        return None
    me = this_process()
    if lease.released or not _same_writer(lease.holder, me):
        raise LeaseLostError(
            f"not {what}: run {run_key} is held by {lease.describe()}, not by this process "
            f"(pid {me['pid']} on {me['host']})"
        )
    if token is not None and token != lease.token:
        raise LeaseLostError(
            f"not {what}: the lease of run {run_key} changed hands during the write "
            f"(token {token}, now {lease.token})"
        )
    return lease.token


def _tokens(fs: fsspec.AbstractFileSystem, directory: str) -> list[int]:
    fs.invalidate_cache(directory)
    try:
        entries = fs.ls(directory, detail=False)
    except FileNotFoundError:
        return []
    found = (_FILE.match(entry.rstrip("/").rsplit("/", 1)[-1]) for entry in entries)
    return sorted(int(match.group(1)) for match in found if match)


def _name(token: int) -> str:
    return f"lease-{token:012d}.json"


# ---------------------------------------------------------------------------- the lease


class RunLease:
    """The lease this process holds on a run key; renewed in a background thread.

    Take one with :meth:`acquire`; use it as a context manager (renewing while inside,
    released on the way out) or call :meth:`start`, :meth:`check` and :meth:`release`.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        directory: str,
        record: LeaseRecord,
        *,
        ttl_s: float,
        previous: LeaseRecord | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._fs, self._dir, self._clock = fs, directory, clock
        self.record = record
        self.ttl_s = ttl_s
        self.previous = previous
        """The lease this one replaced (its holder died, or released it), if any."""
        self.lost: LeaseLostError | None = None
        """Set by the renewal thread when the lease went to another process."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def token(self) -> int:
        return self.record.token

    @classmethod
    def acquire(
        cls,
        url: str,
        run_key: str,
        *,
        ttl_s: float = 60.0,
        wait_s: float | None = None,
        info: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> RunLease:
        """Take the lease of ``run_key`` under the checkpoint store at ``url``.

        Args:
            ttl_s: how long the lease lasts without a renewal (renewed every third of it).
            wait_s: how long to wait for a held lease to become free. ``None``: not at all
                when the holder is a live process of this machine, else ``ttl_s``, long
                enough for the lease of a holder that died on another machine to expire.
            info: JSON recorded with the holder, such as the flow run and its start.

        Raises:
            LeaseHeldError: another live process kept the lease for ``wait_s``.
            ValueError: ``ttl_s`` is not positive.
        """
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        fs, root = fsspec.core.url_to_fs(absolute(url), **dict(storage_options or {}))
        directory = join(root.rstrip("/"), run_key)
        deadline = clock() + (ttl_s if wait_s is None else wait_s)
        # The nonce tells our own lease from another's when the reply to a conditional PUT
        # that succeeded was lost and its retry was refused.
        holder = {**this_process(), **dict(info or {}), "nonce": uuid.uuid4().hex}
        waited = False
        while True:
            current = current_lease(fs, directory)
            now = clock()
            if current is not None and current.holder.get("nonce") == holder["nonce"]:
                return cls(fs, directory, current, ttl_s=ttl_s, previous=None, clock=clock)
            if _free(current, now):
                token = 1 if current is None else current.token + 1
                record = LeaseRecord(
                    run_key=run_key,
                    token=token,
                    holder=holder,
                    acquired=now,
                    renewed=now,
                    expires=now + ttl_s,
                )
                if create_once(fs, join(directory, _name(token)), record.to_json()):
                    lease = cls(fs, directory, record, ttl_s=ttl_s, previous=current, clock=clock)
                    lease._forget_old()
                    return lease
                continue  # another process took this token first: look again
            here = current.holder.get("machine") == _machine()
            if now >= deadline or (wait_s is None and here):  # alive here: waiting only queues
                raise LeaseHeldError(
                    f"run key {run_key!r} is being trained by {current.describe(now)}: "
                    "not starting a second writer; wait for it to finish or use another "
                    "run key",
                    current,
                )
            if not waited:
                _log.warning("run key %s is held by %s; waiting", run_key, current.describe(now))
                waited = True
            time.sleep(min(poll_s, max(deadline - now, 0.01)))

    # ------------------------------------------------------------------------ holding

    def check(self) -> None:
        """Raise unless this process still holds the lease.

        Raises:
            LeaseLostError: another process took it (or it was released).
        """
        if self.lost is not None:
            raise self.lost
        check_writer(
            self._fs, self._dir, run_key=self.record.run_key, token=self.token, what="going on"
        )

    def renew(self, **note: Any) -> None:
        """Push the expiry ``ttl_s`` ahead (and add ``note`` to the record).

        Raises:
            LeaseLostError: another process took the lease.
        """
        with self._lock:
            self.check()
            now = self._clock()
            self.record = replace(
                self.record,
                renewed=now,
                expires=now + self.ttl_s,
                note={**self.record.note, **note},
            )
            self._write()

    def release(self) -> None:
        """Mark the lease released (if it is still ours) and stop renewing it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            try:
                check_writer(
                    self._fs,
                    self._dir,
                    run_key=self.record.run_key,
                    token=self.token,
                    what="releasing",
                )
            except LeaseError as err:
                _log.warning("%s", err)
                return
            self.record = replace(self.record, released=True, renewed=self._clock())
            self._write()

    def start(self) -> RunLease:
        """Renew in a daemon thread every third of ``ttl_s`` until :meth:`release`."""
        self._thread = threading.Thread(target=self._renewing, name="ringflow-lease", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> RunLease:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _renewing(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except LeaseLostError as err:
                self.lost = err
                _log.error("%s", err)
                return
            except Exception as err:  # storage hiccup: the next renewal may get through
                _log.warning("renewing the lease of run %s failed: %s", self.record.run_key, err)

    def _write(self) -> None:
        publish(self._fs, join(self._dir, _name(self.token)), self.record.to_json())

    def _forget_old(self) -> None:
        """Delete lease files two or more tokens back (the previous one stays readable)."""
        for token in _tokens(self._fs, self._dir):
            if token < self.token - 1:
                with suppress(FileNotFoundError, OSError):
                    self._fs.rm_file(join(self._dir, _name(token)))
