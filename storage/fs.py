"""Resolve fsspec URLs once and write files so that readers never see half of one.

Paths stay strings throughout: ``pathlib.Path`` would collapse the ``//`` of ``s3://``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

__all__ = [
    "absolute",
    "atomic_write",
    "create_once",
    "exists",
    "join",
    "publish",
    "read_bytes",
    "resolve",
    "sha256",
]


def resolve(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return the filesystem serving ``url`` and the path inside it.

    Raises:
        ValueError: the URL names a protocol for which no fsspec implementation is installed.
    """
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        raise ValueError(
            f"cannot open {url!r}: {err}. Install the fsspec package for its protocol "
            "(s3fs for s3://, gcsfs for gs://, adlfs for az://) or use a local path."
        ) from err


def absolute(url: str) -> str:
    """Make a plain local path absolute, so processes with another working directory agree."""
    return url if "://" in url else os.path.abspath(os.path.expanduser(url))


def join(url: str, *parts: str) -> str:
    """Join path parts onto a URL without touching its ``scheme://``."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def exists(url: str) -> bool:
    fs, path = resolve(url)
    return fs.exists(path)


def read_bytes(url: str) -> bytes:
    fs, path = resolve(url)
    return fs.cat_file(path)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(url: str, data: bytes) -> None:
    """Write ``data`` so that ``url`` holds either its old content or all of ``data``.

    On a local disk the bytes go to a temporary sibling, are fsynced and renamed over the
    target; on object stores a single PUT is already atomic.
    """
    fs, path = resolve(url)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    publish(fs, path, data)


def publish(fs: fsspec.AbstractFileSystem, path: str, data: bytes, *, fsync: bool = True) -> None:
    """Make ``path`` on ``fs`` hold ``data`` in one step: a single PUT on object stores; on a
    local disk a temporary sibling (flushed to the device with ``fsync``) renamed over it."""
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


_MEMORY_CREATE = threading.Lock()  # memory:// lives in one process: a lock there is atomic


def create_once(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists, in one atomic step; ``True`` if this
    call created it. Of several callers racing on one path exactly one gets ``True``, and
    readers see the whole file or none (leases, the registry's pointer moves).

    Local disk: a complete, fsynced temporary file hard-linked to ``path`` (``link`` fails
    if it exists). S3 (s3fs): a conditional PUT (``If-None-Match: *``); a create whose reply
    was lost and was retried finds its own bytes there. memory://: a process lock. Other
    backends: whatever their ``mode="create"`` does.
    """
    if isinstance(fs, LocalFileSystem):
        os.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True
    if isinstance(fs, MemoryFileSystem):
        with _MEMORY_CREATE:
            if fs.exists(path):
                return False
            fs.pipe_file(path, data)
            return True
    try:
        fs.pipe_file(path, data, mode="create")
        return True
    except FileExistsError:
        pass
    except OSError as err:  # 412 Precondition Failed, as some clients raise it
        if "PreconditionFailed" not in str(err) and "412" not in str(err):
            raise
    fs.invalidate_cache(path)
    return fs.cat_file(path) == data
