"""One deadline watchdog for GPU work the host does not wait for.

On NCCL (and the ``symm`` transport over it) a wait only orders a stream, so the host runs
ahead of the GPU, and nothing would notice a kernel stuck on a dead or silent peer. The ring's
transports and the pipeline's links hand each piece of GPU work to a :class:`Watchdog` as a
CUDA event recorded after it; a thread of the watchdog's own polls the oldest, and when one
is late it hands it to its owner, once, to decide who was lost, to record the typed error the
next wait raises, and to abort what hangs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Watchdog"]


class Event(Protocol):
    """What is watched: ``torch.cuda.Event``, recorded after the work."""

    def query(self) -> bool: ...


class Watchdog:
    """Holds watched work to its deadline from a thread of its own.

    Args:
        name: the thread's name.
        late: whether an item's deadline has passed (asked while its event is not done).
        expire: the owner's answer to the first late item, called once from the watchdog's
            thread, which then ends; it sets :attr:`failure` (and aborts whatever hangs, in a
            thread of its own if that can block). Should it raise, :attr:`failure` is what
            it raised.
    """

    _POLL_S = 1e-3

    def __init__(
        self, name: str, *, late: Callable[[Any], bool], expire: Callable[[Any], None]
    ) -> None:
        self._late, self._expire = late, expire
        self._pending: deque[tuple[Event, Any]] = deque()
        self._changed = threading.Condition()
        self._stopped = False
        self.failure: Exception | None = None
        """The verdict on the late work: raised by every later wait on this owner."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def watch(self, done: Event, item: Any) -> None:
        """Hold ``item`` to its deadline until ``done`` happened (``item`` stays alive until
        then: what the work's kernels use)."""
        with self._changed:
            self._pending.append((done, item))
            self._changed.notify_all()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def drain(self) -> None:
        """Wait until every watched item is done, or one was late (its failure raised)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._pending or self.failure or self._stopped)
        self.raise_failure()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        self._thread.join(1.0)

    def _loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending or self._stopped)
                if self._stopped:
                    return
                done, item = self._pending[0]
            if done.query():
                with self._changed:
                    self._pending.popleft()
                    self._changed.notify_all()
            elif self._late(item):
                try:
                    self._expire(item)
                except Exception as err:  # no verdict: waits raise what went wrong, not hang
                    self.failure = self.failure or err
                with self._changed:
                    self._changed.notify_all()
                return
            else:
                time.sleep(self._POLL_S)
