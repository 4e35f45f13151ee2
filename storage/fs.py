"""Resolve fsspec URLs once and write files so that readers never see half of one.

Paths stay strings throughout: ``pathlib.Path`` would collapse the ``//`` of ``s3://``.
"""

from __future__ import annotations

import hashlib
import os
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "absolute",
    "atomic_write",
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
