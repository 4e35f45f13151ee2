"""Horovod's timeline (``horovodrun --timeline-filename``, ``hvd.start_timeline``): every
collective a rank ran, as a Chrome trace viewable in Perfetto or ``chrome://tracing``.

Each rank records a span per operation on the ring (``allreduce``, ``broadcast``,
``allgather``; the small all-gathers the ranks agree through are ``negotiate``), from its
launch to its completion (stamped by a thread that waits for them in order: the ring runs
them one at a time), named as Horovod names its tensors (``allreduce.<name>``, the name
being the operation's ``name=`` or the gradients' parameters; a negotiation
``NEGOTIATE_ALLREDUCE``, ...). With ``mark_cycles``, each negotiation (a round in which the
ranks agree on the next operation: ringflow's cycle) is also marked ``CYCLE_START``.

Two ways to record: with ``RINGFLOW_HOROVOD_TIMELINE`` set (``ringflow-run
--timeline-filename PATH`` sets it) from ``hvd.init``, each rank writing
``PATH.rank-<rank>.json`` at ``hvd.shutdown`` and the launcher merging the ranks' files into
``PATH``; or between :func:`start_timeline` and :func:`stop_timeline`, which every rank
calls, rank 0 writing every rank's spans to its ``file_path``. pid = rank; host clocks:
spans of ranks on one machine line up.
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

__all__ = ["TIMELINE", "TimedRing", "merge", "naming", "write_trace"]

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
    """The ring, each operation on it recorded as a span.

    Args:
        ring: the ring to time.
        rank: this rank.
        path: where the trace goes.
        generation: an elastic run's generation of ranks (its files are named after it).
        gathered: ``start_timeline``'s: :func:`stop_timeline` gathers every rank's spans and
            rank 0 writes them to ``path`` (at ``hvd.shutdown`` still recording, rank 0
            writes its own); otherwise each rank writes ``path.rank-<rank>.json``.
        mark_cycles: mark each negotiation ``CYCLE_START``.
    """

    def __init__(
        self,
        ring: Any,
        rank: int,
        path: str,
        generation: int = 0,
        *,
        gathered: bool = False,
        mark_cycles: bool = False,
    ) -> None:
        self._ring, self._rank, self._path = ring, rank, path
        self._gathered, self._mark_cycles = gathered, mark_cycles
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
        self._cycles: list[int] = []
        self.rank, self.world_size = ring.rank, ring.world_size

    @property
    def untimed(self) -> Any:
        """The ring this one times."""
        return self._ring

    def _span(self, kind: str, tensor: torch.Tensor, start: int, end: Any) -> None:
        given = getattr(_names, "name", None)  # Horovod's tensor names: allreduce.<name>
        name = (given if kind == "negotiate" else f"{kind}.{given}") if given else kind
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
        negotiating = str(getattr(_names, "name", None)).startswith(NEGOTIATE)
        if negotiating and self._mark_cycles and self._spans is not None:
            self._cycles.append(start)
        out = self._ring.all_gather(tensor)
        self._span("negotiate" if negotiating else "allgather", tensor, start, self._clock.now())
        return out

    def all_gather_async(self, tensor: torch.Tensor) -> Any:
        start = self._clock.now()
        work = self._ring.all_gather_async(tensor)
        self._span("allgather", tensor, start, self._clock.watch(work))
        return work

    def close(self) -> None:
        self.write()
        self._ring.close()

    def events(self) -> list[dict[str, Any]]:
        """This rank's spans (and cycle marks) so far, as Chrome trace events; once (later
        calls give none): recording ends."""
        if self._spans is None:
            return []
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
        for start in self._cycles:
            ts = (start + self._offset) / 1000
            events.append({"name": "CYCLE_START", "ph": "i", "s": "p", "ts": ts, "pid": self._rank})
        self._spans = None
        return events

    def write(self) -> None:
        """Write this rank's spans so far (once; later calls write nothing): to its own file,
        or, recording for :func:`stop_timeline` (which gathers them) and cut short, rank 0's
        own to the trace."""
        if self._spans is None:
            return
        events = self.events()
        if not self._gathered:
            with open(self._file, "w") as f:
                json.dump({"traceEvents": events}, f)
        elif self._rank == 0:
            write_trace(self._path, events)

    def __getattr__(self, name: str) -> Any:  # everything else is the ring's
        return getattr(self._ring, name)


NEGOTIATE = "NEGOTIATE_"
"""How a negotiation's all-gather is named (``NEGOTIATE_ALLREDUCE``, ..., as Horovod's)."""


def write_trace(path: str, events: list[dict[str, Any]]) -> None:
    """Write ``events`` (of any ranks) to ``path`` as one Chrome trace: each rank named, the
    events in time order, the first's time as Horovod's ``start_time_since_epoch_in_micros``."""
    ranks = sorted({e["pid"] for e in events})
    start = min((e["ts"] for e in events), default=time.time() * 1e6)
    meta = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": r,
            "args": {"name": f"rank {r}", "start_time_since_epoch_in_micros": int(start)},
        }
        for r in ranks
    ]
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + sorted(events, key=lambda e: e["ts"])}, f)


def merge(path: str) -> int:
    """Merge the ranks' files into ``path`` (a Chrome trace), removing them; how many."""
    events, files = [], sorted(glob.glob(glob.escape(path) + ".rank-*.json"))
    for file in files:
        with open(file) as f:
            events += json.load(f)["traceEvents"]
        os.remove(file)
    write_trace(path, events)
    return len(files)
