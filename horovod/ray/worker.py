"""The executors' ranks and the way their output reaches the caller.

Each rank's ``sys.stdout`` and ``sys.stderr`` write whole lines, tagged with the rank (or
the elastic worker's number), to a :class:`_Mailbox` actor of the executor's call; what
``ray_logger.log`` sends goes there too. A rank hands its lines over before its function
returns, so none is lost when the executor ends its actor; the executor writes them on its
own standard output and gives the logged values to its callbacks (:class:`_Output`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ringflow.horovod.ray import ray_logger
from ringflow.horovod.runner import _Rank


class _Mailbox:
    """What the ranks of one executor send its caller, in the order it came: ``("line",
    tag, text)`` and ``("log", value)``."""

    def __init__(self) -> None:
        self._items: list[tuple] = []

    def put(self, items: list[tuple]) -> None:
        self._items.extend(items)

    def take(self) -> list[tuple]:
        items, self._items = self._items, []
        return items


def _start_mailbox() -> Any:
    """A :class:`_Mailbox` actor on the caller's node (where its output is written)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return ray.remote(_Mailbox).options(num_cpus=0, scheduling_strategy=here).remote()


class _Lines:
    """A text stream that sends each whole line to the mailbox, tagged, as it is written."""

    def __init__(self, mailbox: Any) -> None:
        self._mailbox, self.tag = mailbox, "?"
        self._lock = threading.Lock()
        self._partial = ""

    def write(self, text: str) -> int:
        import ray

        with self._lock:
            *whole, self._partial = (self._partial + text).split("\n")
            if whole:
                ray.get(self._mailbox.put.remote([("line", self.tag, line) for line in whole]))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _capture(mailbox: Any) -> _Lines:
    """Send this process's printed output, and ``ray_logger.log``'s values, to ``mailbox``."""
    output = _Lines(mailbox)
    sys.stdout = sys.stderr = output
    ray_logger._configure(mailbox)
    return output


class _Worker(_Rank):
    """A rank of a :class:`~ringflow.horovod.ray.RayExecutor`: told its place once, it runs
    function after function."""

    def __init__(self, mailbox: Any) -> None:
        self._output = _capture(mailbox)
        self.executable: Any = None

    def setup(
        self,
        told: dict[str, str],
        executable_cls: type | None,
        args: list | None,
        kwargs: dict | None,
    ) -> None:
        from ringflow.horovod.basics import VARIABLES

        os.environ.update(told)
        self._output.tag = told[VARIABLES["rank"]]
        self.executable = (
            executable_cls(*(args or []), **(kwargs or {})) if executable_cls else None
        )

    def call(self, fn: Callable[..., Any], call: tuple[tuple, dict] | None) -> Any:
        """``fn(*args, **kwargs)`` for ``call=(args, kwargs)``; ``fn(executable)`` for
        ``None``."""
        return fn(self.executable) if call is None else fn(*call[0], **call[1])


class _ElasticWorker(_Rank):
    """A worker of an :class:`~ringflow.horovod.ray.ElasticRayExecutor`'s run: a rank of
    ``ringflow.horovod.run``'s elastic runs, its output tagged with its worker number."""

    def __init__(self, mailbox: Any) -> None:
        self._output = _capture(mailbox)

    def elastic(self, membership: Any, worker: str) -> None:
        super().elastic(membership, worker)
        self._output.tag = worker


class _Output:
    """The caller's side of a mailbox: each line written on this process's standard output,
    prefixed by ``[tag]``; each logged value given to every callback, in order."""

    def __init__(self, mailbox: Any, callbacks: list[Callable[[Any], Any]] | None = None):
        self.mailbox, self._callbacks = mailbox, list(callbacks or [])

    def write(self) -> None:
        import ray

        for item in ray.get(self.mailbox.take.remote()):
            if item[0] == "line":
                sys.stdout.write(f"[{item[1]}] {item[2]}\n")
            else:
                for callback in self._callbacks:
                    callback(item[1])
        sys.stdout.flush()
