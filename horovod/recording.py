"""``hvd.start_timeline`` and ``hvd.stop_timeline``: Horovod's timeline (horovod/timeline.py)
recorded between two calls of every rank, rather than for the whole run."""

from __future__ import annotations

import os

from ringflow.horovod import basics
from ringflow.horovod.collectives import allgather_object
from ringflow.horovod.timeline import TimedRing, write_trace

__all__ = ["start_timeline", "stop_timeline"]


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every collective of this rank from now on, until :func:`stop_timeline`, as
    Horovod's ``hvd.start_timeline``: every rank calls it, and rank 0 writes every rank's
    spans to its ``file_path`` (a Chrome trace). A recording under way (this function's, or
    ``ringflow-run --timeline-filename``'s) ends first and is written where it was to go.
    ``mark_cycles`` marks each negotiation ``CYCLE_START``.

    Raises:
        ValueError: ``hvd.init()`` was not called (Horovod's error).
    """
    _initialized()
    stop_timeline()
    ring = basics.run_ring()
    timed = TimedRing(
        ring, basics.rank(), os.path.abspath(file_path), gathered=True, mark_cycles=mark_cycles
    )
    basics.replace_ring(timed)


def stop_timeline() -> None:
    """End the recording :func:`start_timeline` began and write it (every rank calls it:
    their spans are gathered to rank 0, which writes them, before it returns); one that
    ``ringflow-run --timeline-filename`` began is written to this rank's file. Nothing
    without a recording.

    Raises:
        ValueError: ``hvd.init()`` was not called (Horovod's error).
    """
    _initialized()
    timed = basics.run_ring()
    if not isinstance(timed, TimedRing):
        return
    basics.replace_ring(timed.untimed)
    if not timed._gathered:
        timed.write()
        return
    every = allgather_object(timed.events())
    if basics.rank() == 0:
        write_trace(timed._path, [event for events in every for event in events])


def _initialized() -> None:
    if not basics.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
