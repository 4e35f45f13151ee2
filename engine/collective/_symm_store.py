"""The rendezvous store as torch's symmetric memory needs it in a ring whose members change.

torch's symmetric memory exchanges its handles through the group's store, under keys
``CUDASymmetricMemory/<n>/<rank>``, where ``n`` counts every exchange the *process* has made
(one counter for all groups, ``StoreExchange::seq_id_`` in torch). Members of the first ring
count alike. A worker that joins later starts at 0 while the others are past it: it writes
``.../0/<rank>`` and waits for ``.../0/<peer>``, they write and wait under their own count,
and the new ring's rendezvous waits for ever (seen on 2 and 4 H100s: the survivors and the
new worker all in ``rendezvous``).

:class:`GroupSequenceStore` numbers the exchanges per group instead: the k-th exchange a
group makes is ``k`` on every member, whatever each process made before, because every member
of a group makes the same exchanges in the same order. Other keys pass through unchanged.
"""

from __future__ import annotations

import datetime as dt
import re
import threading

import torch.distributed as dist

__all__ = ["GroupSequenceStore"]

_EXCHANGE = re.compile(r"^(.*CUDASymmetricMemory/)(\d+)(/\d+)$")
"""A symmetric-memory exchange key, as (everything up to the count, the count, the rank)."""


class GroupSequenceStore(dist.Store):
    """``inner``, with symmetric memory's exchange counts renumbered per group (the part of
    the key before the count, which holds the group's prefix)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self._inner = inner
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}
        """Per group prefix: the process-wide count -> the group's own, in order of use."""
        self._clones: list[GroupSequenceStore] = []

    def _key(self, key: str) -> str:
        match = _EXCHANGE.match(key)
        if match is None:
            return key
        head, count, rank = match.groups()
        with self._lock:
            counts = self._counts.setdefault(head, {})
            own = counts.setdefault(count, len(counts))
        return f"{head}{own}{rank}"

    def clone(self) -> GroupSequenceStore:
        """A connection of its own that numbers the exchanges with this one's counts."""
        twin = GroupSequenceStore(self._inner.clone())
        twin._lock, twin._counts = self._lock, self._counts
        # torch holds the clone on the C++ side only, which does not keep its Python half
        # (the methods) alive: this store does.
        self._clones.append(twin)
        return twin

    def set(self, key: str, value) -> None:
        self._inner.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self._inner.get(self._key(key))

    def add(self, key: str, value: int) -> int:
        return self._inner.add(self._key(key), value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._inner.compare_set(self._key(key), expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check([self._key(k) for k in keys])

    def wait(self, keys: list[str], timeout: dt.timedelta | None = None) -> None:
        keys = [self._key(k) for k in keys]
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: dt.timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> dt.timedelta:
        return self._inner.timeout
