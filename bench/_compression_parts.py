"""``bench.compression``'s parts that its Ray workers import by name: the throttled link
(a collective registered as ``throttled_ring``) and the wide MLP."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import torch
from torch import nn

from ringflow.engine.collective import CollectiveWork, register_collective
from ringflow.engine.collective.base import wire_dtype
from ringflow.engine.collective.ring import RingCollective
from ringflow.models.digits import DigitsClassifier

LINK_GBPS = "RINGFLOW_BENCH_LINK_GBPS"
WIRE_LOG = "RINGFLOW_BENCH_WIRE_LOG"
"""Environment of the workers: the link's speed, and the folder each writes its bytes to."""


@register_collective("throttled_ring")
class ThrottledRing(RingCollective):
    """Our ring, whose all-reduces complete no sooner than a link of ``RINGFLOW_BENCH_LINK_GBPS``
    would carry them (a ring all-reduce puts 2 (n-1)/n of the bytes on each rank's link),
    one after another, as on a real link; counts the bytes."""

    def __init__(self, *, compression: str = "none", **kwargs) -> None:
        super().__init__(compression=compression, **kwargs)
        self._bytes_per_s = float(os.environ[LINK_GBPS]) * 1e9 / 8
        wire = wire_dtype(compression)  # float32 travels as this (bf16, fp16)
        self._wire_size = None if wire is None else torch.empty(0, dtype=wire).element_size()
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.sent = 0
        self._log_name = f"rank{self.rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        """A file of this ring's: a worker process may serve several runs (``engine.pool``)."""

    def allreduce_async_(self, tensor: torch.Tensor, *, op: str = "sum") -> CollectiveWork:
        n = self.world_size
        float32 = tensor.dtype == torch.float32
        size = self._wire_size if self._wire_size and float32 else tensor.element_size()
        nbytes = round(tensor.numel() * size * 2 * (n - 1) / n)
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self._bytes_per_s
            self.sent += nbytes
            self._record()
        return _Until(super().allreduce_async_(tensor, op=op), self._free_at)

    def _record(self) -> None:
        """The bytes so far, in a file of this ring's (Ray kills workers without a word)."""
        folder = os.environ.get(WIRE_LOG)
        if folder:
            path = Path(folder, self._log_name)
            path.with_suffix(".tmp").write_text(json.dumps(self.sent))
            path.with_suffix(".tmp").replace(path)


class _Until(CollectiveWork):
    def __init__(self, work: CollectiveWork, done_at: float) -> None:
        self._work, self._done_at = work, done_at

    def wait(self) -> torch.Tensor:
        result = self._work.wait()
        delay = self._done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed() and time.monotonic() >= self._done_at


class WideDigits(DigitsClassifier):
    """The digits classifier with ``layers`` hidden layers of ``hidden`` units: most of its
    weights in square matrices, as in a transformer's blocks."""

    def __init__(self, *, hidden: int = 1024, layers: int = 3, lr: float = 1e-3) -> None:
        super().__init__(hidden=hidden, lr=lr)
        blocks: list[nn.Module] = [nn.Linear(64, hidden), nn.ReLU()]
        for _ in range(layers - 1):
            blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(hidden, 10))
