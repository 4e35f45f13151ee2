"""A timeline of every data-parallel worker's training steps, as a Chrome trace.

Horovod's Timeline showed its users where a step's time went; this is ours. With
``TrainConfig(timeline=True)`` each worker records, for ``timeline_steps`` batches after
``timeline_warmup`` warm-up batches, spans of:

- ``data``: reading its part of the batch and moving it to the device (host clock);
- ``forward``, ``backward``, ``gradient wait`` (after backward, until the last bucket's
  all-reduce is done and its sums are in ``.grad``) and the whole ``step``;
- ``allreduce``: each gradient bucket's all-reduce, from the moment it owns the
  communication stream (its launch, or the previous bucket's end if later: collectives run
  one at a time, in order) to its completion; how long it queued is in its ``args``;
- ``optimizer``: the optimizer step (with clipping and schedulers).

Clocks: on CPU the host's ``time.perf_counter_ns``; a bucket's completion is stamped by a
thread that waits for the collectives in order. On CUDA, events recorded on the stream that
runs the work, read once when the trace is collected (never a synchronisation per span):
a bucket's completion is an event recorded on a probe stream made to wait for the collective
as soon as it is launched, which the compute stream joins before the sums are used.

The driver merges the workers' spans into one trace (``{"traceEvents": [...]}``, complete
events ``ph: "X"`` in microseconds; pid = rank, tid = lane: compute, communication,
optimizer, data), viewable in Perfetto, and :func:`summarize` reads the share of
communication hidden behind backward from it.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "LANES",
    "WallClock",
    "SPAN_KINDS",
    "UNTIMED",
    "TimelineSummary",
    "WorkerTimeline",
    "chrome_trace",
    "summarize",
    "trace_bytes",
]

LANES = ("compute", "communication", "optimizer", "data")
"""The trace's lanes (``tid``), in order."""

_LANE = {
    "step": 0,
    "forward": 0,
    "backward": 0,
    "gradient_wait": 0,
    "allreduce": 1,
    "optimizer": 2,
    "data": 3,
}
_NAME = {"gradient_wait": "gradient wait", "optimizer": "optimizer step"}
_HOST_KINDS = frozenset({"data"})
"""Kinds timed on the host even on CUDA: reading a batch is host work."""

SPAN_KINDS = tuple(_LANE)
"""Every kind of span (a trace event's ``cat``)."""
_SPLIT = ("step", "data", "forward", "backward", "gradient_wait", "optimizer")


class _Done:
    """A bucket's completion time on the host clock, stamped by the waiting thread."""

    __slots__ = ("ns",)

    def __init__(self) -> None:
        self.ns: int | None = None


class WallClock:
    """Host time for CPU workers; collectives' completions stamped by a waiting thread.

    The thread waits for each launched collective in launch order (``CollectiveWork.wait``
    may be called from any thread and more than once) and stamps the time it returns: the
    ring runs collectives one at a time, in order, so that is when each one finished.
    """

    name = "wall clock"

    def __init__(self) -> None:
        self._works: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def now(self) -> int:
        return time.perf_counter_ns()

    def watch(self, work: Any) -> _Done:
        if self._thread is None:
            self._thread = threading.Thread(target=self._wait, name="timeline", daemon=True)
            self._thread.start()
        done = _Done()
        self._works.put((work, done))
        return done

    def join(self) -> None:
        return None

    def settle(self, timeout_s: float = 30.0) -> None:
        """Wait until every collective handed to :meth:`watch` so far is stamped."""
        if self._thread is not None:
            settled = threading.Event()
            self._works.put((settled, None))
            settled.wait(timeout_s)

    def resolve(self, stamp: int | _Done) -> int | None:
        return stamp.ns if isinstance(stamp, _Done) else stamp

    def close(self) -> None:
        if self._thread is not None:
            self._works.put((None, None))
            self._thread.join(timeout=5.0)
            self._thread = None

    def _wait(self) -> None:
        while True:
            work, done = self._works.get()
            if work is None:
                return
            if done is None:  # a barrier of settle()
                work.set()
                continue
            try:
                work.wait()
            except BaseException:  # noqa: BLE001 - the training thread raises it, not us
                continue
            done.ns = time.perf_counter_ns()


class _CudaClock:
    """CUDA events on the streams that run the work, converted to host time when read.

    One reference event, recorded between two synchronisations when the clock is made (at
    the first recorded step, after warm-up), ties the GPU's clock to the host's; every other
    event is read relative to it, after one synchronisation when the trace is collected.
    """

    name = "cuda events"

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._probe = torch.cuda.Stream(device=device)
        self._probed = False
        torch.cuda.synchronize(device)
        before = time.perf_counter_ns()
        self._ref = self._event(torch.cuda.current_stream(device))
        torch.cuda.synchronize(device)
        self._ref_ns = (before + time.perf_counter_ns()) // 2

    def now(self) -> torch.cuda.Event:
        return self._event(torch.cuda.current_stream(self._device))

    def watch(self, work: Any) -> torch.cuda.Event:
        """An event that completes when ``work`` does: the probe stream waits for the
        collective (``wait`` on a device collective only orders the current stream after it)
        and records the event, right at launch, so it is stamped when the collective ends."""
        with torch.cuda.stream(self._probe):
            work.wait()
            self._probed = True
            return self._event(self._probe)

    def join(self) -> None:
        """Order the compute stream after the probe's waits: the collectives' results were
        waited for on the probe stream, which the compute stream must now wait for."""
        if self._probed:
            torch.cuda.current_stream(self._device).wait_stream(self._probe)
            self._probed = False

    def settle(self) -> None:
        """Wait until every event recorded so far has happened (once, when collected)."""
        torch.cuda.synchronize(self._device)

    def resolve(self, stamp: int | torch.cuda.Event) -> int | None:
        if isinstance(stamp, int):
            return stamp
        return self._ref_ns + round(self._ref.elapsed_time(stamp) * 1e6)

    def close(self) -> None:
        return None

    @staticmethod
    def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event


@dataclass
class _Step:
    """The stamps of one recorded batch."""

    step: int
    spans: list[tuple[str, Any, Any]] = field(default_factory=list)
    allreduces: list[tuple[int, int, Any, Any]] = field(default_factory=list)
    """(bucket, bytes, launch stamp, completion stamp), in launch order."""


class _Untimed:
    """What a batch that is not recorded marks its spans on: nothing (no allocation)."""

    __slots__ = ()

    def start(self, kind: str) -> None:
        return None

    def stop(self, kind: str) -> None:
        return None

    def end(self) -> None:
        return None


UNTIMED = _Untimed()
"""The timeline of a batch that is not recorded (a worker without a timeline uses it too)."""


class WorkerTimeline:
    """Records one worker's spans for a bounded window of batches.

    The worker calls :meth:`begin` at every batch and marks its spans on what it returns:
    this timeline for batches ``warmup`` to ``warmup + steps - 1`` of this worker, else
    :data:`UNTIMED`, whose calls do nothing; so outside the window a batch costs one
    comparison and a few empty calls, and with the timeline off (the worker holds ``None``)
    only the empty calls.

    Args:
        device: where the worker trains; CUDA devices are timed with events.
        warmup: batches not recorded first (compilation, allocator warm-up).
        steps: batches recorded after them.
        steps_per_epoch: batches in an epoch, to number batches across epochs.
    """

    def __init__(
        self, *, device: torch.device, warmup: int, steps: int, steps_per_epoch: int
    ) -> None:
        self._device = device
        self._per_epoch = steps_per_epoch
        self._first, self._end = warmup, warmup + steps
        self._seen = 0
        self._clock: WallClock | _CudaClock | None = None
        self._steps: list[_Step] = []
        self._open: dict[str, Any] = {}
        self._current: _Step | None = None
        # Host time to wall-clock time, so that workers on several hosts share one axis.
        self._origin = (time.perf_counter_ns(), time.time_ns())

    @property
    def clock(self) -> str:
        """How spans are timed: ``wall clock`` or ``cuda events``."""
        return "cuda events" if self._device.type == "cuda" else "wall clock"

    def begin(self, epoch: int, step: int) -> WorkerTimeline | _Untimed:
        """Start batch ``step`` of ``epoch``; what to mark its spans on."""
        seen = self._seen
        self._seen += 1
        if not self._first <= seen < self._end:
            self._current = None
            return UNTIMED
        if self._clock is None:
            self._clock = _CudaClock(self._device) if self._device.type == "cuda" else WallClock()
        self._current = _Step(epoch * self._per_epoch + step)
        self._steps.append(self._current)
        self._open = {"step": self._clock.now()}
        return self

    def start(self, kind: str) -> None:
        """A span of ``kind`` starts now (on the current stream, on CUDA)."""
        self._open[kind] = time.perf_counter_ns() if kind in _HOST_KINDS else self._clock.now()

    def stop(self, kind: str) -> None:
        """The span of ``kind`` started last ends now."""
        now = time.perf_counter_ns() if kind in _HOST_KINDS else self._clock.now()
        self._current.spans.append((kind, self._open.pop(kind), now))

    def end(self) -> None:
        """The batch ends (after its optimizer step, if it has one)."""
        if self._current is not None:
            self.stop("step")
            self._current = None

    def mark(self) -> Any:
        """A stamp for a bucket's launch, or ``None`` when this batch is not recorded."""
        return None if self._current is None else self._clock.now()

    def launched(self, bucket: int, nbytes: int, mark: Any, work: Any) -> None:
        """Bucket ``bucket`` (``nbytes``) was launched at ``mark`` as ``work``."""
        if mark is not None and self._current is not None:
            done = self._clock.watch(work)
            self._current.allreduces.append((bucket, nbytes, mark, done))

    def join(self) -> None:
        """Called once the buckets' works were waited for, before their sums are read."""
        if self._clock is not None:
            self._clock.join()

    def spans(self, rank: int) -> list[dict[str, Any]]:
        """The recorded spans as trace events of ``rank`` in wall-clock nanoseconds
        (``ts_ns``, ``dur_ns``), for :func:`chrome_trace`; the records are released."""
        if self._clock is None:
            return []
        self._clock.settle()
        events = []
        for record in self._steps:
            events += self._step_events(record, rank)
        self._steps = []
        return events

    def close(self) -> None:
        if self._clock is not None:
            self._clock.close()

    def _wall(self, stamp: Any) -> int | None:
        ns = self._clock.resolve(stamp)
        return None if ns is None else self._origin[1] + ns - self._origin[0]

    def _step_events(self, record: _Step, rank: int) -> list[dict[str, Any]]:
        events, waited = [], None
        for kind, start, end in record.spans:
            begun, ended = self._wall(start), self._wall(end)
            name = f"step {record.step}" if kind == "step" else _NAME.get(kind, kind)
            events.append(_event(name, kind, rank, begun, ended, step=record.step))
            if kind == "gradient_wait":
                waited = ended
        free = None  # when the communication stream finished the previous bucket
        for bucket, nbytes, mark, done in record.allreduces:
            launched, ended = self._wall(mark), self._wall(done)
            if ended is None:  # never completed: the step failed
                continue
            if waited is not None:  # the stamping thread may wake after the wait returned
                ended = min(ended, waited)
            begun = launched if free is None else max(launched, free)
            free = ended
            span = _event(f"allreduce bucket {bucket}", "allreduce", rank, begun, ended)
            span["args"].update(
                step=record.step, bucket=bucket, bytes=nbytes, queued_us=(begun - launched) / 1e3
            )
            events.append(span)
        return events


def _event(name: str, kind: str, rank: int, begun: int, ended: int, **args: Any) -> dict[str, Any]:
    return {
        "name": name,
        "cat": kind,
        "pid": rank,
        "tid": _LANE[kind],
        "ts_ns": begun,
        "dur_ns": max(0, ended - begun),
        "args": dict(args),
    }


def chrome_trace(workers: list[list[dict[str, Any]]], *, clock: str = "") -> dict[str, Any]:
    """One Chrome trace (Trace Event Format) of every worker's spans.

    Times are microseconds from the earliest span; each worker is a process named after its
    rank, each lane a thread named after it.

    Args:
        workers: each worker's :meth:`WorkerTimeline.spans`.
        clock: how the spans were timed, recorded in ``otherData``.
    """
    spans = [span for part in workers for span in part]
    origin = min((span["ts_ns"] for span in spans), default=0)
    events: list[dict[str, Any]] = []
    for rank in sorted({span["pid"] for span in spans}):
        events.append(_meta("process_name", rank, 0, f"worker {rank}"))
        events.append(_meta("process_sort_index", rank, 0, rank, key="sort_index"))
        events += [_meta("thread_name", rank, tid, lane) for tid, lane in enumerate(LANES)]
    for span in sorted(spans, key=lambda s: (s["pid"], s["ts_ns"], s["tid"])):
        events.append(
            {
                "name": span["name"],
                "cat": span["cat"],
                "ph": "X",
                "ts": (span["ts_ns"] - origin) / 1e3,
                "dur": span["dur_ns"] / 1e3,
                "pid": span["pid"],
                "tid": span["tid"],
                "args": span["args"],
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "ringflow timeline", "clock": clock},
    }


def _meta(name: str, pid: int, tid: int, value: Any, *, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def trace_bytes(trace: dict[str, Any]) -> bytes:
    """The trace as compact JSON, as written to storage."""
    return json.dumps(trace, separators=(",", ":")).encode()


@dataclass(frozen=True, kw_only=True)
class TimelineSummary:
    """What a trace says about overlap and where a step's time goes.

    Every figure is a mean over the recorded (worker, step) pairs unless it says otherwise.
    """

    trace_url: str | None = None
    """Where the trace was written."""
    workers: int
    steps: int
    """Recorded (worker, step) pairs."""
    communication_ms: float
    """All-reduce time per step."""
    overlap: float | None
    """The share of all-reduce time that lies within backward (``None``: no all-reduce)."""
    exposed_communication_ms: float
    """All-reduce time per step outside backward."""
    step_ms: dict[str, float]
    """Time per step by kind: ``step`` (the whole), ``data``, ``forward``, ``backward``,
    ``gradient_wait``, ``optimizer``."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(trace: dict[str, Any], *, trace_url: str | None = None) -> TimelineSummary:
    """Overlap, exposed communication and the step split of a trace from :func:`chrome_trace`.

    overlap = (all-reduce time inside the same worker's backward spans) / (all-reduce time).

    Raises:
        ValueError: the trace has no ``traceEvents`` list.
    """
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("a trace is a dict with a 'traceEvents' list (Trace Event Format)")
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in _LANE]
    steps = {(e["pid"], e["args"].get("step")) for e in spans if e["cat"] == "step"}
    count = max(1, len(steps))
    totals = dict.fromkeys(_SPLIT, 0.0)
    for span in spans:
        if span["cat"] in totals:
            totals[span["cat"]] += span["dur"]
    backward: dict[int, list[tuple[float, float]]] = {}
    for span in spans:
        if span["cat"] == "backward":
            backward.setdefault(span["pid"], []).append((span["ts"], span["ts"] + span["dur"]))
    communication = hidden = 0.0
    for span in spans:
        if span["cat"] == "allreduce":
            begun, ended = span["ts"], span["ts"] + span["dur"]
            communication += span["dur"]
            hidden += sum(
                max(0.0, min(ended, b) - max(begun, a)) for a, b in backward.get(span["pid"], ())
            )
    return TimelineSummary(
        trace_url=trace_url,
        workers=len({e["pid"] for e in spans}),
        steps=len(steps),
        communication_ms=communication / count / 1e3,
        overlap=hidden / communication if communication > 0 else None,
        exposed_communication_ms=(communication - hidden) / count / 1e3,
        step_ms={kind: total / count / 1e3 for kind, total in totals.items()},
    )
