"""``ringflow.horovod.ray``: Horovod's ``horovod.ray.RayExecutor`` on ringflow's ranks.

A script written for ``from horovod.ray import RayExecutor`` runs with that import changed:
the executor starts its workers as the ranks of ``ringflow.horovod.run`` (Ray actors, each
told its place; ``hvd.init()`` inside a function joins their ring), runs functions on them,
and writes each rank's output on the caller's standard output, each line prefixed by
``[rank]``, as ``ringflow-run`` does.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringflow.horovod.basics import HorovodError
from ringflow.horovod.runner import RankFailedError, _Rank, _start

__all__ = ["RayExecutor", "Settings"]


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What ``RayExecutor.create_settings`` makes (Horovod's ``MiniSettings``)."""

    timeout_s: float = 30.0
    """Every collective's deadline: a rank that died or stopped answering makes the others
    fail within it (Horovod's: the Gloo rendezvous timeout)."""
    placement_group_timeout_s: float = 100.0
    """Accepted; Ray places the ranks, and the executor waits for them as long as it takes."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be more than 0, got {self.timeout_s}")


class RayExecutor:
    """A group of ranks on Ray that runs functions (Horovod's ``RayExecutor``).

    Args:
        settings: from :meth:`create_settings`.
        num_workers: how many ranks.
        num_hosts: with ``num_workers_per_host``, instead of ``num_workers``: that many
            ranks in all (placed where Ray places them, not host by host).
        num_workers_per_host: see ``num_hosts``.
        cpus_per_worker: CPUs each rank's actor takes.
        use_gpu: each rank takes ``gpus_per_worker`` GPUs (1 by default).
        gpus_per_worker: GPUs each rank's actor takes.

    Raises:
        HorovodError: an elastic executor was asked for (``min_workers``, ...): an elastic
            run is ``ringflow.horovod.run(fn, np=, min_np=, max_np=, reset_limit=)``.
        ValueError: neither or both of ``num_workers`` and ``num_hosts``, or fewer than 1.
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: Any = None,
    ) -> Settings:
        """The executor's settings; ``ssh_identity_file``, ``ssh_str`` and ``nics`` are
        accepted and mean nothing here (Ray starts the ranks; the ring picks its
        transports)."""
        return Settings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s)

    def __init__(
        self,
        settings: Settings,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        **elastic: Any,
    ) -> None:
        asked = sorted(k for k, v in elastic.items() if v is not None)
        if asked:
            raise HorovodError(
                f"ringflow.horovod.ray.RayExecutor is not elastic ({', '.join(asked)}): run "
                "an elastic function with ringflow.horovod.run(fn, np=, min_np=, max_np=, "
                "reset_limit=)"
            )
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("give num_workers, or num_hosts with num_workers_per_host")
        self.num_workers = num_workers or num_hosts * num_workers_per_host
        if self.num_workers < 1:
            raise ValueError(f"need 1 or more workers, got {self.num_workers}")
        self.settings = settings
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.workers: list[Any] = []

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: list | None = None,
        executable_kwargs: dict | None = None,
        extra_env_vars: dict[str, str] | None = None,
    ) -> None:
        """Start the ranks; on each, ``executable_cls(*executable_args,
        **executable_kwargs)`` (what :meth:`execute` passes its function), with
        ``extra_env_vars`` in its environment."""
        import ray

        self.workers, variables = _start(
            self.num_workers,
            self.cpus_per_worker,
            self.gpus_per_worker,
            self.settings.timeout_s,
            extra_env_vars,
            rank_cls=_Worker,
            max_concurrency=2,  # its output is read while a function runs
        )
        setup = [
            worker.setup.remote(told, executable_cls, executable_args, executable_kwargs)
            for worker, told in zip(self.workers, variables, strict=True)
        ]
        self._gather(setup)
        ray.get(setup)

    def run(
        self,
        fn: Callable[..., Any],
        args: list | tuple | None = None,
        kwargs: dict[str, Any] | None = None,
        callbacks: list[Callable] | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; their results, in rank order.
        ``callbacks`` are accepted and not called, as Horovod's static executor's.

        Raises:
            RankFailedError: a rank's ``fn`` raised (the first, by rank and exception).
        """
        return self._gather(self.run_remote(fn, args, kwargs))

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: list | tuple | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank; Ray's references to the results
        (their output is written once :meth:`run`, :meth:`execute` or :meth:`shutdown`
        next reads it)."""
        self._started()
        call = (tuple(args or ()), dict(kwargs or {}))
        return [w.call.remote(fn, call) for w in self.workers]

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None) -> list:
        """``fn(executable)`` on every rank (the object ``start`` made there, or ``None``);
        their results, in rank order."""
        self._started()
        return self._gather([w.call.remote(fn, None) for w in self.workers])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only; its result."""
        self._started()
        return self._gather([self.workers[0].call.remote(fn, None)])[0]

    def shutdown(self) -> None:
        """End the ranks (their output is written first)."""
        import ray

        self._write_output()
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []

    def _started(self) -> None:
        if not self.workers:
            raise HorovodError("the RayExecutor has no ranks: call start() first")

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every call's result, each rank's output written as it comes; the first failure
        as soon as it happens."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=0.1)
            self._write_output()
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as err:
                    self._write_output()
                    raise RankFailedError(refs.index(ref), err) from None
        self._write_output()
        return ray.get(refs)

    def _write_output(self) -> None:
        import ray

        if not self.workers:
            return
        for rank, lines in enumerate(ray.get([w.lines.remote() for w in self.workers])):
            sys.stdout.write("".join(f"[{rank}] {line}" for line in lines))
        sys.stdout.flush()


class _Lines:
    """A text stream that keeps whole lines for the executor to fetch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partial, self.lines = "", []

    def write(self, text: str) -> int:
        with self._lock:
            *whole, self._partial = (self._partial + text).split("\n")
            self.lines.extend(f"{line}\n" for line in whole)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def take(self) -> list[str]:
        with self._lock:
            lines, self.lines = self.lines, []
            return lines


class _Worker(_Rank):
    """A rank of a :class:`RayExecutor`: told its place once, it runs function after
    function; what they print is kept for the executor."""

    def __init__(self) -> None:
        self._output = _Lines()
        sys.stdout = sys.stderr = self._output
        self.executable: Any = None

    def setup(
        self,
        told: dict[str, str],
        executable_cls: type | None,
        args: list | None,
        kwargs: dict | None,
    ) -> None:
        os.environ.update(told)
        self._output = _Lines()
        sys.stdout = sys.stderr = self._output
        self.executable = (
            executable_cls(*(args or []), **(kwargs or {})) if executable_cls else None
        )

    def call(self, fn: Callable[..., Any], call: tuple[tuple, dict] | None) -> Any:
        """``fn(*args, **kwargs)`` for ``call=(args, kwargs)``; ``fn(executable)`` for
        ``None``."""
        return fn(self.executable) if call is None else fn(*call[0], **call[1])

    def lines(self) -> list[str]:
        """The whole lines written since the last call."""
        return self._output.take()
