"""Where a run's time goes outside its steps: timestamped phases of the driver and its workers.

Off unless ``RINGFLOW_PHASES`` names a file: then the driver (``engine.trainer``,
``engine.group``) and every worker host (``engine.pool``, ``engine.worker``) on the node append
one JSON line per phase to it, ``{"t": <time.time()>, "pid": ..., "role": "driver"|"worker",
"phase": ...}``, so that a run's start-up and end can be laid out on one clock
(:func:`read`, :func:`table`). Workers read the variable from the environment they inherit
(a local cluster started by the driver's process passes its own on). A mark costs one test
when off.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

__all__ = ["ENV", "mark", "read", "table"]

ENV = "RINGFLOW_PHASES"


def mark(phase: str, *, role: str = "driver", at: float | None = None, **fields: Any) -> None:
    """Record that ``phase`` ended now (or at ``at``, a ``time.time()``), where phases are on."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = {"t": time.time() if at is None else at, "pid": os.getpid(), "role": role}
    line.update(phase=phase, **fields)
    try:
        with open(path, "a") as out:  # one short append: whole lines from every process
            out.write(json.dumps(line, default=str) + "\n")
    except OSError:
        pass  # a diagnostic: never a reason for a run to fail


def read(path: str, *, since: float | None = None) -> list[dict[str, Any]]:
    """The marks in ``path`` (from ``since`` on), in time order."""
    try:
        with open(path) as lines:
            marks = [json.loads(line) for line in lines if line.strip()]
    except OSError:
        return []
    marks = [m for m in marks if since is None or m["t"] >= since]
    return sorted(marks, key=lambda m: m["t"])


def table(marks: list[dict[str, Any]], *, start: float) -> list[str]:
    """One line per mark: seconds from ``start``, seconds since the same process's last
    mark, the process, the phase."""
    lines, last = [], {}
    for m in marks:
        before = last.get(m["pid"], start)
        extra = {k: v for k, v in m.items() if k not in ("t", "pid", "role", "phase")}
        note = f" {extra}" if extra else ""
        lines.append(
            f"{m['t'] - start:8.3f} s  +{m['t'] - before:7.3f}  {m['role']:<6} {m['pid']:>7}  "
            f"{m['phase']}{note}"
        )
        last[m["pid"]] = m["t"]
    return lines
