"""Horovod's ``horovod.ray.ElasticRayExecutor`` on ringflow's elastic runs.

The executor runs a function as ``ringflow.horovod.run(fn, np=, min_np=, max_np=,
reset_limit=)`` does: its workers are Ray actors, the run's :class:`Membership` forms them
into ranks generation by generation (deciding through the engine's elastic coordinator), a
lost worker's place is taken by a new one that joins at the ranks' next commit. How many
workers it keeps comes from its discovery, as Horovod's: the slots of the Ray cluster's
nodes (``cpus_per_slot`` CPUs, and ``gpus_per_slot`` GPUs with ``use_gpu``, each), asked
again every second, between ``min_num_proc`` and ``max_num_proc``.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ringflow.horovod.basics import HorovodError
from ringflow.horovod.ray.worker import _ElasticWorker, _Output, _start_mailbox
from ringflow.horovod.runner import _Elastic, _results_elastic

__all__ = ["ElasticRayExecutor", "ElasticSettings", "HostDiscovery", "RayHostDiscovery"]

DISCOVERY_INTERVAL_S = 1.0
"""How often a run asks its discovery for the slots there are (Horovod's driver: 1 s)."""
MOST_RANKS = 128
"""The most ranks of a run without ``max_num_proc`` (each waits on the run's membership in
a thread of its own while the ranks form)."""


class HostDiscovery(Protocol):
    """Horovod's ``HostDiscovery``: which hosts there are, and how many ranks each takes."""

    def find_available_hosts_and_slots(self) -> dict[str, int]: ...


@dataclass(kw_only=True)
class ElasticSettings:
    """What ``ElasticRayExecutor.create_settings`` makes (Horovod's ``ElasticSettings``);
    ``discovery`` may be set after, as Horovod's."""

    min_num_proc: int = 1
    """The fewest ranks training goes on with; fewer wait for more."""
    max_num_proc: int | None = None
    """The most ranks, whatever the discovery finds (``None``: as many as it finds, up to
    :data:`MOST_RANKS`)."""
    reset_limit: int | None = None
    """How many times the ranks may change (each loss and each join one); ``None``: any."""
    elastic_timeout: float = 600.0
    """How long :meth:`ElasticRayExecutor.start` waits for ``min_num_proc`` slots."""
    timeout_s: float = 30.0
    """Every collective's deadline: a rank that died or stopped answering makes the others
    fail within it."""
    discovery: HostDiscovery | None = None
    """The hosts and their slots; the executor sets Ray's unless ``override_discovery`` is
    false."""
    verbose: int | bool = 0
    """Accepted; the run's events are always printed on the standard error."""

    @property
    def num_proc(self) -> int:
        return self.min_num_proc

    def check(self) -> None:
        """Raise ``ValueError`` naming the field where a value cannot be run."""
        if self.min_num_proc < 1:
            raise ValueError(f"min_num_proc must be 1 or more, got {self.min_num_proc}")
        if self.max_num_proc is not None and self.max_num_proc < self.min_num_proc:
            raise ValueError(
                f"max_num_proc must be min_num_proc ({self.min_num_proc}) or more, got "
                f"{self.max_num_proc}"
            )
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(f"reset_limit must be 0 or more, got {self.reset_limit}")
        for name in ("elastic_timeout", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be more than 0, got {getattr(self, name)}")


class RayHostDiscovery:
    """Horovod's: every alive node of the Ray cluster, with as many slots as its CPUs (and
    GPUs, with ``use_gpu``) make whole slots of."""

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1, gpus_per_slot: int = 1):
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = (
            use_gpu,
            cpus_per_slot,
            gpus_per_slot,
        )

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Each host's address and its slots (hosts with none left out)."""
        import ray

        hosts: dict[str, int] = {}
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            resources = node["Resources"]
            slots = resources.get("CPU", 0) // self.cpus_per_slot
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // self.gpus_per_slot)
            if slots >= 1:
                host = node["NodeManagerAddress"]
                hosts[host] = hosts.get(host, 0) + int(slots)
        return hosts


class TestDiscovery(RayHostDiscovery):
    """Horovod's test discovery: Ray's hosts, with one host at a time taken out of (or put
    back into) what it finds every ``change_frequency_s``, between ``min_hosts`` and
    ``max_hosts``. A host taken out only lowers the slots counted: the workers there go on.

    Raises:
        HorovodError: ``_graceful=False`` (Horovod's kills a cloud node through Ray's
            autoscaler there).
    """

    __test__ = False  # not a pytest class

    def __init__(
        self,
        min_hosts: int,
        max_hosts: int,
        change_frequency_s: float,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: int = 1,
        verbose: bool = True,
        _graceful: bool = True,
    ):
        if not _graceful:
            raise HorovodError(
                "TestDiscovery(_graceful=False) kills cloud nodes through Ray's autoscaler: "
                "not in ringflow.horovod.ray; leave _graceful=True"
            )
        super().__init__(use_gpu=use_gpu, cpus_per_slot=cpus_per_slot, gpus_per_slot=gpus_per_slot)
        self._min_hosts, self._max_hosts = min_hosts, max_hosts
        self._change_frequency_s, self.verbose = change_frequency_s, verbose
        self._last_change: float | None = None
        self._removed: set[str] = set()

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        now = time.time()
        self._last_change = self._last_change or now
        hosts = super().find_available_hosts_and_slots()
        if now - self._last_change >= self._change_frequency_s:
            self._change(hosts)
            self._last_change = now
        remaining = {host: slots for host, slots in hosts.items() if host not in self._removed}
        if self.verbose:
            print(f"Total hosts: {len(hosts)}")
            print(f"Remaining hosts: {len(remaining)} -- {remaining}")
        return remaining

    def _change(self, hosts: dict[str, int]) -> None:
        self._removed &= set(hosts)
        current = len(hosts) - len(self._removed)
        add = current <= self._min_hosts or (current < self._max_hosts and random.random() < 0.5)
        if add and self._removed:
            self._removed.remove(random.choice(sorted(self._removed)))
        elif add:
            print("No hosts to add.")
        else:
            present = sorted(set(hosts) - self._removed)
            if present:
                self._removed.add(random.choice(present))


class ElasticRayExecutor:
    """Runs an elastic function on the Ray cluster's slots (Horovod's
    ``ElasticRayExecutor``).

    Args:
        settings: from :meth:`create_settings`.
        use_gpu: each rank takes ``gpus_per_slot`` GPUs (1 by default), and a node's slots
            are also bounded by its GPUs.
        cpus_per_slot: CPUs each rank's actor takes.
        gpus_per_slot: GPUs each rank's actor takes (needs ``use_gpu``).
        env_vars: set in every rank's environment before the function runs.
        override_discovery: set ``settings.discovery`` to the Ray cluster's slots
            (:class:`RayHostDiscovery`); false keeps the one the settings have.

    Raises:
        ValueError: ``gpus_per_slot`` without ``use_gpu``, or less than 1 with it; a setting
            out of its range (named).
    """

    @staticmethod
    def create_settings(
        min_num_proc: int = 1,
        max_num_proc: int | None = None,
        reset_limit: int | None = None,
        elastic_timeout: float = 600,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        nics: Any = None,
        min_np: int | None = None,
        max_np: int | None = None,
        verbose: int | bool = 0,
    ) -> ElasticSettings:
        """The executor's settings (``min_np`` and ``max_np`` are Horovod's deprecated names
        of ``min_num_proc`` and ``max_num_proc``); ``ssh_identity_file`` and ``nics`` are
        accepted and mean nothing here (Ray starts the ranks; the ring picks its
        transports)."""
        if min_np is not None:
            warnings.warn(
                "min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2
            )
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn(
                "max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2
            )
            max_num_proc = max_np
        settings = ElasticSettings(
            min_num_proc=min_num_proc,
            max_num_proc=max_num_proc,
            reset_limit=reset_limit,
            elastic_timeout=elastic_timeout,
            timeout_s=timeout_s,
            verbose=verbose,
        )
        settings.check()
        return settings

    def __init__(
        self,
        settings: ElasticSettings,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: int | None = None,
        env_vars: dict[str, str] | None = None,
        override_discovery: bool = True,
    ) -> None:
        if gpus_per_slot and not use_gpu:
            raise ValueError("gpus_per_slot is set, but use_gpu is False: set use_gpu=True")
        gpus_per_slot = gpus_per_slot or int(use_gpu)
        if use_gpu and gpus_per_slot < 1:
            raise ValueError(f"gpus_per_slot must be 1 or more, got {gpus_per_slot}")
        if override_discovery:
            settings.discovery = RayHostDiscovery(use_gpu, cpus_per_slot, gpus_per_slot)
        self.settings, self.use_gpu = settings, use_gpu
        self.cpus_per_slot, self.gpus_per_slot = cpus_per_slot, gpus_per_slot
        self.env_vars = dict(env_vars or {})
        self._started = False

    def start(self) -> None:
        """Connect to Ray (the cluster ``ray.init`` joined, or ``RAY_ADDRESS``'s, or a
        private local one) and wait until the discovery finds ``min_num_proc`` slots.

        Raises:
            HorovodError: there were fewer within ``elastic_timeout``, or no discovery.
        """
        from ringflow.engine.cluster import connect

        self.settings.check()
        if self.settings.discovery is None:
            raise HorovodError(
                "settings.discovery is None: set it, or pass override_discovery=True to use "
                "the Ray cluster's slots"
            )
        connect()
        deadline = time.monotonic() + self.settings.elastic_timeout
        while (found := self._slots()) < self.settings.min_num_proc:
            if time.monotonic() > deadline:
                raise HorovodError(
                    f"the discovery found {found} slots, fewer than min_num_proc="
                    f"{self.settings.min_num_proc}, within elastic_timeout="
                    f"{self.settings.elastic_timeout:g} s: add nodes, or lower cpus_per_slot "
                    f"({self.cpus_per_slot}) or gpus_per_slot ({self.gpus_per_slot})"
                )
            time.sleep(DISCOVERY_INTERVAL_S)
        self._started = True

    def run(
        self, worker_fn: Callable[[], Any], callbacks: list[Callable[[Any], Any]] | None = None
    ) -> list[Any]:
        """``worker_fn()`` on as many ranks as the discovery finds slots (within
        ``min_num_proc`` and ``max_num_proc``), through losses and joins: each rank's output
        is written on this process's standard output, each line prefixed by ``[worker]``;
        every value a rank logs with ``ray_logger.log`` is given to each of ``callbacks``.

        Returns:
            The results of the workers that finished, in their last rank order.

        Raises:
            RankFailedError: a rank's ``worker_fn`` raised (by worker and exception).
            HorovodError: :meth:`start` was not called, or the run gave up (every worker
                lost, or ``reset_limit`` spent: the elastic coordinator's reason).
        """
        import ray

        if not self._started:
            raise HorovodError("the ElasticRayExecutor is not started: call start() first")
        settings = self.settings
        output = _Output(_start_mailbox(), callbacks)
        options = {
            "timeout_s": settings.timeout_s,
            "reset_limit": settings.reset_limit,
            "cpus": self.cpus_per_slot,
            "gpus": self.gpus_per_slot if self.use_gpu else 0,
            "env": self.env_vars,
        }
        size = self._size()
        max_np = settings.max_num_proc or max(size, MOST_RANKS)
        run = _Elastic(
            size, settings.min_num_proc, max_np, options, _ElasticWorker, (output.mailbox,)
        )
        asked = [time.monotonic()]

        def tick() -> None:
            output.write()
            if time.monotonic() - asked[0] >= DISCOVERY_INTERVAL_S:
                asked[0] = time.monotonic()
                run.resize(self._size())

        try:
            return _results_elastic(run, worker_fn, (), {}, tick)
        finally:
            run.stop()
            ray.kill(output.mailbox)

    def _slots(self) -> int:
        return sum(self.settings.discovery.find_available_hosts_and_slots().values())

    def _size(self) -> int:
        """How many ranks to keep: the slots found, within ``min_num_proc`` and
        ``max_num_proc``."""
        settings = self.settings
        size = max(self._slots(), settings.min_num_proc)
        return min(size, settings.max_num_proc or MOST_RANKS)
