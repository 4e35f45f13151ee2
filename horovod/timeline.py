"""Horovod's timeline (``horovodrun --timeline-filename``): every collective a rank ran, as
a Chrome trace viewable in Perfetto or ``chrome://tracing``.

With ``RINGFLOW_HOROVOD_TIMELINE`` set (``ringflow-run --timeline-filename PATH`` sets it),
each rank records a span per operation on the ring (``allreduce``, ``broadcast``,
``allgather``; the small all-gathers the ranks agree through are ``negotiate``), from its
launch to its completion (stamped by a thread that waits for them in order: the ring runs
them one at a time), named after the operation's ``name=`` or the gradient's parameter. At
``hvd.shutdown`` it writes ``PATH.rank-<rank>.json``; the launcher merges the ranks' files
into ``PATH`` (pid = rank). Host clocks: spans of ranks on one machine line up.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from ringflow.engine.timeline import WallClock

__all__ = ["TIMELINE", "TimedRing", "merge", "naming"]

TIMELINE = "RINGFLOW_HOROVOD_TIMELINE"
"""The variable naming the trace file (set by ``ringflow-run --timeline-filename``)."""

_names = threading.local()


@contextlib.contextmanager
def naming(name: str | None) -> Iterator[None]:
    """The operations the block starts are named ``name`` in the timeline."""
    before = getattr(_names, "name", None)
    _names.name = name
    try:
        yield
    finally:
        _names.name = before


class TimedRing:
    """The ring, each operation on it recorded as a span."""

    def __init__(self, ring: Any, rank: int, path: str, generation: int = 0) -> None:
        self._ring, self._rank, self._path = ring, rank, path
        self._file = (
            f"{path}.rank-{rank}.json"
            if not generation
            else (
                f"{path}.rank-{rank}.generation-{generation}.json"  # an elastic run's ranks
            )
        )
        self._clock = WallClock()
        self._offset = time.time_ns() - time.perf_counter_ns()  # a host clock for all ranks
        self._spans: list[tuple[str, str, int, Any, int]] | None = []
        self.rank, self.world_size = ring.rank, ring.world_size

    def _span(self, kind: str, tensor: torch.Tensor, start: int, end: Any) -> None:
        name = getattr(_names, "name", None) or kind
        if self._spans is not None:  # None once written
            self._spans.append((kind, name, start, end, tensor.numel() * tensor.element_size()))

    def allreduce_async_(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        start = self._clock.now()
        work = self._ring.allreduce_async_(tensor, **kwargs)
        self._span("allreduce", tensor, start, self._clock.watch(work))
        return work

    def broadcast_(self, tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        start = self._clock.now()
        out = self._ring.broadcast_(tensor, **kwargs)
        self._span("broadcast", tensor, start, self._clock.now())
        return out

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        start = self._clock.now()
        out = self._ring.all_gather(tensor)
        kind = "negotiate" if getattr(_names, "name", None) == "negotiate" else "allgather"
        self._span(kind, tensor, start, self._clock.now())
        return out

    def all_gather_async(self, tensor: torch.Tensor) -> Any:
        start = self._clock.now()
        work = self._ring.all_gather_async(tensor)
        self._span("allgather", tensor, start, self._clock.watch(work))
        return work

    def close(self) -> None:
        self.write()
        self._ring.close()

    def write(self) -> None:
        """Write this rank's spans so far (once; later calls write nothing)."""
        if self._spans is None:
            return
        self._clock.settle()
        self._clock.close()
        events = []
        for kind, name, start, end, size in self._spans:
            finished = self._clock.resolve(end)
            if finished is None:  # never completed (a peer was lost)
                continue
            events.append(
                {
                    "name": name,
                    "cat": kind,
                    "ph": "X",
                    "ts": (start + self._offset) / 1000,
                    "dur": (finished - start) / 1000,
                    "pid": self._rank,
                    "tid": 0,
                    "args": {"bytes": size},
                }
            )
        with open(self._file, "w") as f:
            json.dump({"traceEvents": events}, f)
        self._spans = None

    def __getattr__(self, name: str) -> Any:  # everything else is the ring's
        return getattr(self._ring, name)


def merge(path: str) -> int:
    """Merge the ranks' files into ``path`` (a Chrome trace), removing them; how many."""
    events, files = [], sorted(glob.glob(glob.escape(path) + ".rank-*.json"))
    for file in files:
        with open(file) as f:
            events += json.load(f)["traceEvents"]
        os.remove(file)
    ranks = sorted({e["pid"] for e in events})
    meta = [
        {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in ranks
    ]
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + sorted(events, key=lambda e: e["ts"])}, f)
    return len(files)
