"""Horovod's ``horovod.ray.RayExecutor`` on ringflow's ranks.

The executor starts its workers as the ranks of ``ringflow.horovod.run`` (Ray actors, each
told its place; ``hvd.init()`` inside a function joins their ring), runs functions on them,
and writes each rank's output on the caller's standard output, each line prefixed by
``[rank]``, as ``ringflow-run`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringflow.horovod.basics import HorovodError
from ringflow.horovod.ray.elastic import ElasticRayExecutor, ElasticSettings
from ringflow.horovod.ray.worker import _Output, _start_mailbox, _Worker
from ringflow.horovod.runner import RankFailedError, _start

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
        min_workers: instead of ``num_workers``: an elastic executor (Horovod's elastic
            mode), which runs each function as :class:`ElasticRayExecutor` does, on as many
            ranks as the Ray cluster has slots, at least ``min_workers``.
        max_workers: the most ranks of an elastic executor.
        reset_limit: how many times an elastic executor's ranks may change (each loss and
            each join one; ``None``: any).
        elastic_timeout: how long an elastic executor's ``start`` waits for
            ``min_workers`` slots.
        override_discovery: see :class:`ElasticRayExecutor`.
        cooldown_range: accepted; a lost worker's replacement backs off as the engine's do.

    Raises:
        ValueError: neither or both of ``num_workers`` (or ``num_hosts``) and
            ``min_workers``; ``max_workers`` without ``min_workers``; fewer than 1.
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
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: Any = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
    ) -> None:
        if max_workers and not min_workers:
            raise ValueError("max_workers needs a positive min_workers (an elastic executor)")
        self.settings = settings
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.workers: list[Any] = []
        self._output: _Output | None = None
        self._elastic: ElasticRayExecutor | None = None
        if min_workers is not None:
            if num_workers is not None or num_hosts is not None:
                raise ValueError(
                    "give num_workers (a static executor) or min_workers (an elastic one), not both"
                )
            elastic = ElasticSettings(
                min_num_proc=min_workers,
                max_num_proc=max_workers,
                reset_limit=reset_limit,
                elastic_timeout=elastic_timeout,
                timeout_s=settings.timeout_s,
            )
            elastic.check()
            self._elastic = ElasticRayExecutor(
                elastic,
                use_gpu=use_gpu,
                cpus_per_slot=cpus_per_worker,
                gpus_per_slot=gpus_per_worker,
                override_discovery=override_discovery,
            )
            return
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("give num_workers, or num_hosts with num_workers_per_host")
        self.num_workers = num_workers or num_hosts * num_workers_per_host
        if self.num_workers < 1:
            raise ValueError(f"need 1 or more workers, got {self.num_workers}")

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: list | None = None,
        executable_kwargs: dict | None = None,
        extra_env_vars: dict[str, str] | None = None,
    ) -> None:
        """Start the ranks; on each, ``executable_cls(*executable_args,
        **executable_kwargs)`` (what :meth:`execute` passes its function), with
        ``extra_env_vars`` in its environment. An elastic executor waits for its slots; its
        ranks start with each function and end with it, the executable made anew on each."""
        import ray

        if self._elastic is not None:
            self._elastic.env_vars = dict(extra_env_vars or {})
            self._executable = (executable_cls, executable_args or [], executable_kwargs or {})
            self._elastic.start()
            return

        from ringflow.engine.cluster import connect

        connect()
        self._output = _Output(_start_mailbox())
        self.workers, variables = _start(
            self.num_workers,
            self.cpus_per_worker,
            self.gpus_per_worker,
            self.settings.timeout_s,
            extra_env_vars,
            rank_cls=_Worker,
            rank_args=(self._output.mailbox,),
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

        An elastic executor calls ``callbacks`` with what its ranks log
        (``ray_logger.log``), and returns the results of the ranks that finished.

        Raises:
            RankFailedError: a rank's ``fn`` raised (the first, by rank and exception).
        """
        if self._elastic is not None:
            call = (tuple(args or ()), dict(kwargs or {}))
            return self._elastic.run(functools.partial(_call, fn, call), callbacks)
        return self._gather(self.run_remote(fn, args, kwargs))

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: list | tuple | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank; Ray's references to the results
        (their output is written once :meth:`run`, :meth:`execute` or :meth:`shutdown`
        next reads it). Not for an elastic executor, whose ranks end with each function."""
        self._static("run_remote", "ObjectRefs cannot be returned from elastic runs")
        self._started()
        call = (tuple(args or ()), dict(kwargs or {}))
        return [w.call.remote(fn, call) for w in self.workers]

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None) -> list:
        """``fn(executable)`` on every rank (the object ``start`` made there, or ``None``);
        their results, in rank order."""
        if self._elastic is not None:
            cls, args, kwargs = self._executable
            made = functools.partial(_call, fn, None, cls, args, kwargs)
            return self._elastic.run(made, callbacks)
        self._started()
        return self._gather([w.call.remote(fn, None) for w in self.workers])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only; its result (not for an elastic executor)."""
        self._static("execute_single", "use execute")
        self._started()
        return self._gather([self.workers[0].call.remote(fn, None)])[0]

    def shutdown(self) -> None:
        """End the ranks (their output is written first)."""
        import ray

        self._write_output()
        for worker in self.workers:
            ray.kill(worker)
        if self._output is not None:
            ray.kill(self._output.mailbox)
        self.workers, self._output = [], None

    def _static(self, method: str, instead: str) -> None:
        if self._elastic is not None:
            raise NotImplementedError(f"an elastic RayExecutor has no {method}: {instead}")

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
        if self._output is not None:
            self._output.write()


def _call(
    fn: Callable[..., Any],
    call: tuple[tuple, dict] | None,
    cls: type | None = None,
    args: list | None = None,
    kwargs: dict | None = None,
) -> Any:
    """An elastic rank's function: ``fn(*args, **kwargs)`` for ``call=(args, kwargs)``;
    for ``None``, ``fn`` of the executable made here."""
    if call is not None:
        return fn(*call[0], **call[1])
    return fn(cls(*(args or []), **(kwargs or {})) if cls else None)
