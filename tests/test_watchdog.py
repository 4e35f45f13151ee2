"""The deadline watchdog the ring's NCCL transports and the pipeline's NCCL links share
(``engine.collective._watchdog``), run here on events the test sets itself in place of CUDA
events: what it does with work that ends in time, with work that is late, and at shutdown.
The GPU paths that use it are tested on GPUs (tests/test_ring_gpu.py,
tests/test_pipeline_gpu_deadlines.py)."""

from __future__ import annotations

import threading
import time

import pytest

from ringflow.engine.collective._watchdog import Watchdog
from ringflow.engine.errors import CollectiveTimeoutError


class Event:
    """Stands in for ``torch.cuda.Event``: done once the test says so."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()


class Owner:
    """What a transport does with the watchdog: a deadline per item, a verdict when late."""

    def __init__(self) -> None:
        self.expired: list[str] = []
        self.watchdog = Watchdog("test-deadlines", late=self.late, expire=self.expire)

    @staticmethod
    def late(item: tuple[float, str]) -> bool:
        return time.monotonic() > item[0]

    def expire(self, item: tuple[float, str]) -> None:
        self.expired.append(item[1])
        if item[1] == "unanswerable":
            raise ConnectionError("the rendezvous store is gone")
        self.watchdog.failure = CollectiveTimeoutError(
            f"{item[1]} passed its deadline", peer=1, op=item[1], rank=0
        )


def _watch(owner: Owner, name: str, *, deadline_s: float) -> Event:
    event = Event()
    owner.watchdog.watch(event, (time.monotonic() + deadline_s, name))
    return event


def test_work_that_ends_in_time_is_let_go_and_nothing_is_blamed():
    owner = Owner()
    events = [_watch(owner, f"send {i}", deadline_s=60) for i in range(3)]
    threading.Timer(0.05, lambda: [e.set() for e in events]).start()
    owner.watchdog.drain()  # returns once all three are done
    owner.watchdog.raise_failure()
    assert owner.expired == []
    owner.watchdog.stop()


def test_late_work_is_answered_once_and_every_later_wait_raises_the_verdict():
    owner = Owner()
    on_time = _watch(owner, "send 0", deadline_s=60)
    _watch(owner, "receive 1", deadline_s=0.05)  # its peer never answers
    _watch(owner, "receive 2", deadline_s=0.05)
    on_time.set()
    with pytest.raises(CollectiveTimeoutError, match="receive 1 passed its deadline"):
        owner.watchdog.drain()
    time.sleep(0.1)  # the watchdog's thread has ended: the second late item is the owner's
    assert owner.expired == ["receive 1"]
    with pytest.raises(CollectiveTimeoutError, match="receive 1"):
        owner.watchdog.raise_failure()
    owner.watchdog.stop()


def test_an_owner_that_cannot_reach_a_verdict_makes_waits_raise_not_hang():
    owner = Owner()
    _watch(owner, "unanswerable", deadline_s=0.05)
    with pytest.raises(ConnectionError, match="the rendezvous store is gone"):
        owner.watchdog.drain()
    owner.watchdog.stop()


def test_stopping_ends_the_thread_without_blaming_what_is_still_watched():
    owner = Owner()
    _watch(owner, "receive 0", deadline_s=0.2)
    owner.watchdog.stop()
    time.sleep(0.3)
    assert owner.expired == []
    assert not owner.watchdog._thread.is_alive()
