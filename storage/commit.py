"""How storage commits: the files first, then one JSON record that names them, written last.

Until its record exists a directory is not a dataset, a checkpoint or a registry version,
whatever else it holds, so nothing half-written is ever read as valid. A record that must
also survive damage and hand edits is *sealed*: it carries the SHA-256 of its own canonical
JSON under ``checksum``, checked when it is read back (:func:`unseal`).
"""

from __future__ import annotations

import json
from typing import Any

from ringflow.storage.fs import atomic_write, sha256

__all__ = ["SealBroken", "commit_record", "seal", "unseal"]


class SealBroken(ValueError):
    """A sealed record that does not parse, or whose checksum does not match its content."""

    def __init__(self, reason: str, *, damaged: bool) -> None:
        super().__init__(reason)
        self.damaged = damaged
        """``True``: it parsed, but its content is not what was sealed (damage, an edit)."""


def commit_record(url: str, record: dict[str, Any], *, sort_keys: bool = False) -> None:
    """Write ``record`` at ``url`` as indented JSON, whole (readers see the old file or the new
    one, never a part), after every file it names: the commit itself."""
    atomic_write(url, json.dumps(record, indent=2, sort_keys=sort_keys).encode())


def seal(body: dict[str, Any], *, indent: int | None = None, allow_nan: bool = True) -> bytes:
    """``body`` as JSON with a ``checksum`` of its own canonical form (sorted keys)."""
    sealed = {**body, "checksum": _checksum(body, allow_nan=allow_nan)}
    return json.dumps(sealed, indent=indent, sort_keys=True, allow_nan=allow_nan).encode()


def unseal(data: bytes) -> dict[str, Any]:
    """The body :func:`seal` sealed, checked against its checksum.

    Raises:
        SealBroken: ``data`` is not a sealed JSON object, or its checksum does not match.
    """
    try:
        body = json.loads(data)
        checksum = body.pop("checksum")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError) as err:
        raise SealBroken(str(err), damaged=False) from err
    if checksum != _checksum(body):
        raise SealBroken("fails its checksum", damaged=True)
    return body


def _checksum(body: dict[str, Any], *, allow_nan: bool = True) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=allow_nan)
    return "sha256:" + sha256(canonical.encode())
