"""Warm workers that outlive a run.

A worker's process is a :class:`WorkerHost`: a Ray actor that imported torch, Lightning and
the engine once and builds one :class:`~ringflow.engine.worker.Worker` per run in it. When a
run ends well its hosts are reset (the worker closed, the environment, working directory,
threads, loggers and the user's modules as they were before it) and go back to the cluster's
pool, one named actor (:data:`POOL_NAME`) that any driver on the cluster leases from: the next
fit, tuning trial or retried flow run starts on warm processes instead of cold ones.

Hosts are pooled by what makes one reusable (:func:`pool_key`): the worker's resources, the
digest of the code the driver runs (ringflow's and the user's, so changed code never runs in a
stale process), the Python environment and the job's runtime environment. A pooled host
reserves no resources of its own: the run's placement group reserves them while it trains, so
an idle host never keeps Serve, Tune or Ray Data from a CPU. Idle hosts are released after
``RINGFLOW_POOL_IDLE_S`` seconds (300) and with the cluster (``deployments/stop.sh``); a lease
whose driver stops renewing it for ``RINGFLOW_POOL_GRACE_S`` seconds (30) is ended and its
hosts killed. ``RINGFLOW_WORKER_POOL=0`` starts every run on fresh processes.

Pooled runs are those of a one-node cluster (a laptop, a workstation, the local stack, one GPU
host); multi-node clusters start fresh hosts in their placement group, as before. A pooled GPU
worker reserves no GPU either: the driver tells each host which GPU its bundle of the placement
group holds (:meth:`HostLease.gpu`), and a reset frees what the run left on it (its tensors,
the allocator's cache, compiled graphs) and puts back the backends' flags (cuDNN, TF32, matmul
precision, deterministic algorithms); an idle GPU host keeps only its CUDA context (a few
hundred MiB of the GPU's memory) until it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import sys
import sysconfig
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from ringflow.engine.cluster import handles_from_local_code
from ringflow.engine.collective.registry import registrations, restore_registrations
from ringflow.engine.phases import mark
from ringflow.engine.worker import ASSIGNED_GPU, Worker
from ringflow.storage.lease import SERVED_JOB

__all__ = [
    "POOL_NAME",
    "HostLease",
    "WorkerHost",
    "owner",
    "pool_key",
    "pooled",
    "release_idle",
    "worker_pids",
]

log = logging.getLogger("ringflow.engine")

POOL_NAME = "ringflow-worker-pool"
NAMESPACE = "ringflow"


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {os.environ[name]!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {value:g}")
    return value


def pooled(gpus_per_worker: float, single_node: bool) -> bool:
    """Whether a run's workers are leased from the pool (see the module docstring): on a
    one-node cluster, CPU and GPU workers alike, unless ``RINGFLOW_WORKER_POOL=0``."""
    return os.environ.get("RINGFLOW_WORKER_POOL", "1") != "0" and single_node


# ---------------------------------------------------------------------------- what is reusable

_INSTALLED = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sys.prefix}
)


_RINGFLOW_PACKAGES = (
    "engine",
    "storage",
    "models",
    "flows",
    "tasks",
    "serving",
    "tuning",
    "horovod",
)
"""The folders of ``ringflow.*`` in a checkout (pyproject.toml's package-dir)."""


def _installed(path: str) -> bool:
    return os.path.realpath(path).startswith(_INSTALLED)


def _sources(objects: tuple[Any, ...]) -> list[str]:
    """The source files a run's code comes from, outside installed packages and the standard
    library: ringflow's own (a checkout), the top-level package (or module) of each of
    ``objects``' classes, and the script run as ``__main__``."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = set() if _installed(here) else {os.path.join(here, p) for p in _RINGFLOW_PACKAGES}
    for obj in objects:
        cls = obj if isinstance(obj, type) else type(obj)
        top = sys.modules.get(cls.__module__.split(".")[0])
        origin = getattr(top, "__file__", None)
        if origin and not _installed(origin):
            roots.add(os.path.dirname(origin) if origin.endswith("__init__.py") else origin)
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    files = {main} if main and not _installed(main) else set()
    for root in roots:
        if os.path.isfile(root):
            files.add(root)
            continue
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            files.update(os.path.join(folder, n) for n in names if n.endswith(".py"))
    return sorted(files)


def code_digest(*objects: Any) -> str:
    """A digest of the code a run of ``objects`` (the module class, the data) runs outside
    installed packages (each file's path, size and modification time): it changes when any
    of it is edited."""
    digest = hashlib.sha256()
    for path in _sources(objects):
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def pool_key(cpus_per_worker: float, env_vars: dict[str, str], *objects: Any) -> str:
    """What a host must share with a run to serve it: resources, code (of ``objects``: the
    module class and the data), Python and the job's runtime environment (``env_vars``: what
    the run's hosts start with)."""
    import ray

    parts = {
        "cpus": cpus_per_worker,
        "code": code_digest(*objects),
        "python": sys.executable,
        "env_vars": env_vars,
        "runtime_env": ray.get_runtime_context().runtime_env,
        "torch": torch.__version__,
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# ---------------------------------------------------------------------------- the host


@dataclass
class _Baseline:
    """What a host process was like before its first run, restored after every run."""

    environ: dict[str, str]
    cwd: str
    path: list[str]
    modules: frozenset[str]
    threads: frozenset[int]
    torch_threads: int
    backends: dict[str, Any] = field(default_factory=dict)
    """torch's global flags a run may set (cuDNN, TF32, matmul precision, determinism)."""
    handlers: list[logging.Handler] = field(default_factory=list)
    registered: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    """ringflow's registries of collectives and communication hooks."""

    @classmethod
    def take(cls) -> _Baseline:
        return cls(
            environ=dict(os.environ),
            cwd=os.getcwd(),
            path=list(sys.path),
            modules=frozenset(sys.modules),
            threads=frozenset(t.ident for t in threading.enumerate() if t.ident),
            torch_threads=torch.get_num_threads(),
            backends=_backend_flags(),
            handlers=list(logging.getLogger().handlers),
            registered=registrations(),
        )

    def restore(self) -> list[str]:
        """Put the process back; what could not be (a reason each: the host is not reused)."""
        dirty = []
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(self.environ)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        sys.path[:] = self.path
        for name in [n for n in sys.modules if n not in self.modules]:
            path = getattr(sys.modules[name], "__file__", None) or ""
            if path and not name.startswith("ringflow.") and not _installed(path):
                del sys.modules[name]  # the user's code: imported afresh by the next run
        logging.getLogger().handlers[:] = self.handlers
        restore_registrations(self.registered)
        torch.set_num_threads(self.torch_threads)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        _set_backend_flags(self.backends)
        if "torch._dynamo" in sys.modules:  # graphs compiled for the run's code
            torch._dynamo.reset()
        gc.collect()
        dirty += _free_cuda()
        deadline = time.monotonic() + 2.0
        while (left := self._new_threads()) and time.monotonic() < deadline:
            time.sleep(0.05)
        dirty += [f"thread {t.name} still runs" for t in left]
        return dirty

    def _new_threads(self) -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t.ident not in self.threads and not t.daemon and t.is_alive()
        ]


def _backend_flags() -> dict[str, Any]:
    return {
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    }


def _set_backend_flags(flags: dict[str, Any]) -> None:
    if not flags:
        return
    torch.backends.cudnn.benchmark = flags["cudnn.benchmark"]
    torch.backends.cudnn.deterministic = flags["cudnn.deterministic"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn.allow_tf32"]
    torch.backends.cuda.matmul.allow_tf32 = flags["cuda.matmul.allow_tf32"]
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
    torch.use_deterministic_algorithms(
        flags["deterministic_algorithms"], warn_only=flags["deterministic_warn_only"]
    )


_HELD_MIB = 64.0
"""GPU memory a run may leave allocated (libraries' workspaces) before its host is dropped."""


def _free_cuda() -> list[str]:
    """Free what a run left on its GPUs (after its objects are collected): cuBLAS's
    workspaces, the caching allocator's blocks and its statistics; a reason where more than
    :data:`_HELD_MIB` stays allocated (tensors something still holds)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    used = [i for i in range(torch.cuda.device_count()) if torch.cuda.memory_reserved(i)]
    for index in used:  # never a context on a GPU the run did not use
        torch.cuda.synchronize(index)
    with contextlib.suppress(AttributeError):  # a private helper of torch's own tests
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    dirty = []
    for index in used:
        torch.cuda.reset_peak_memory_stats(index)
        held = torch.cuda.memory_allocated(index) / 2**20
        if held > _HELD_MIB:
            dirty.append(f"{held:.0f} MiB still allocated on cuda:{index}")
    return dirty


class WorkerHost:
    """One worker process that outlives runs: builds a :class:`Worker` per run
    (:meth:`start`), runs its methods (:meth:`run`, called through
    ``engine.group.WorkerHandle``) and leaves nothing of it (:meth:`reset`)."""

    def __init__(self) -> None:
        mark("process started", role="worker", at=_process_start())
        mark("engine imported", role="worker")
        import lightning.pytorch  # noqa: F401  (imported once, before any run)

        mark("lightning imported", role="worker")
        self.worker: Worker | None = None
        self._baseline = _Baseline.take()

    def start(
        self,
        module_cls: type,
        *,
        job: str | None = None,
        gpu: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """Build this run's worker (``Worker(module_cls, **kwargs)``), for the Ray ``job``
        of its driver; a pooled GPU worker trains on GPU ``gpu`` (its bundle's)."""
        if self.worker is not None:
            raise RuntimeError("this worker host already holds a run's worker")
        mark("start called", role="worker")
        if gpu:  # the bundle's GPU ids (HostLease.gpu)
            os.environ[ASSIGNED_GPU] = gpu[0]  # reset with the environment
        self.serve(job)
        self.worker = Worker(module_cls, **kwargs)
        mark("worker built", role="worker")

    def serve(self, job: str | None) -> None:
        """Write for the driver's Ray ``job`` (its run key's lease: ``storage.lease``), not
        for the job that started this process."""
        if job:
            os.environ[SERVED_JOB] = job

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.worker is None:
            raise RuntimeError(f"Worker.{method} called on a host with no worker started")
        result = getattr(self.worker, method)(*args, **kwargs)
        mark(method, role="worker")
        return result

    def reset(self) -> list[str]:
        """Close the run's worker and restore the process; what kept it from being reused."""
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.close()
        del worker
        dirty = self._baseline.restore()
        mark("reset", role="worker")
        return dirty

    def pid(self) -> int:
        return os.getpid()


# ---------------------------------------------------------------------------- the pool


@dataclass
class _Idle:
    host: Any
    pid: int
    since: float


@dataclass
class _Lease:
    key: str
    grace_s: float
    run: str | None = None
    """The run whose in-memory commits the hosts hold: a lease its driver lost is kept for
    a driver of the same run to adopt (:meth:`_Pool.adopt`)..."""
    adopt_s: float = 180.0
    """... for this many seconds (``RINGFLOW_ADOPT_S``), then its hosts are killed."""
    owner: dict[str, Any] = field(default_factory=dict)
    """The driver's process (``pid`` and its ``start`` time, on this one node): when it is
    gone the pool knows at once, without waiting out the grace."""
    hosts: dict[int, Any] = field(default_factory=dict)
    renewed: float = field(default_factory=time.monotonic)


class _Pool:
    """The cluster's one pool (an async Ray actor): idle hosts by key, and the leases of
    running drivers, each renewed while its driver lives."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.idle: dict[str, list[_Idle]] = {}
        self.leases: dict[str, _Lease] = {}
        self.orphans: dict[str, tuple[_Lease, float]] = {}
        """Leases of lost drivers by run, each until its deadline (``RINGFLOW_ADOPT_S``)."""
        self._reaper: asyncio.Task | None = None
        self._resets: set[asyncio.Task] = set()
        """Hosts of ended leases being reset (:meth:`reset_and_give_back`)."""

    def _ensure_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            await self._find_lost_drivers()
            self.reap()

    async def _find_lost_drivers(self) -> None:
        for lease_id, lease in list(self.leases.items()):
            if _owner_died(lease.owner):
                self._lost(lease_id)

    def _lost(self, lease_id: str) -> None:
        """The lease's driver is gone: its hosts wait for a driver of its run, or go."""
        lease = self.leases.pop(lease_id)
        if lease.run is None:
            _kill(list(lease.hosts.values()))
            return
        old = self.orphans.pop(lease.run, None)
        if old is not None:
            _kill(list(old[0].hosts.values()))
        self.orphans[lease.run] = (lease, time.monotonic() + lease.adopt_s)

    def reap(self) -> None:
        now = time.monotonic()
        for key, hosts in list(self.idle.items()):
            expired = [h for h in hosts if now - h.since >= self.idle_s]
            self.idle[key] = [h for h in hosts if h not in expired]
            _kill([h.host for h in expired])
        for lease_id, lease in list(self.leases.items()):
            if now - lease.renewed >= lease.grace_s:
                self._lost(lease_id)
        for run, (lease, deadline) in list(self.orphans.items()):
            if now >= deadline:
                del self.orphans[run]
                _kill(list(lease.hosts.values()))

    async def adopt(
        self, lease_id: str, run: str, key: str, grace_s: float, owner: dict[str, Any]
    ) -> list[tuple[Any, int]]:
        """The hosts a lost driver of ``run`` left, now leased to ``lease_id``; none when
        no driver of that run was lost (a live one keeps its hosts)."""
        for other_id, lease in list(self.leases.items()):
            if lease.run == run and _owner_died(lease.owner):
                self._lost(other_id)
        found = self.orphans.pop(run, None)
        lease = self._lease(lease_id, key, grace_s, run, owner)
        if found is not None and found[0].key != key:  # other code: never run it
            _kill(list(found[0].hosts.values()))
            found = None
        if found is None:
            return []
        lease.hosts.update(found[0].hosts)
        return [(host, pid) for pid, host in found[0].hosts.items()]

    def _lease(
        self, lease_id: str, key: str, grace_s: float, run: str | None, owner: dict[str, Any]
    ) -> _Lease:
        self._ensure_reaper()
        if lease_id not in self.leases:
            adopt_s = float((owner or {}).get("adopt_s", 180.0))
            self.leases[lease_id] = _Lease(key, grace_s, run, adopt_s, owner)
        return self.leases[lease_id]

    async def lease(
        self,
        lease_id: str,
        key: str,
        count: int,
        grace_s: float,
        run: str | None = None,
        owner: dict[str, Any] | None = None,
    ) -> list[tuple[Any, int]]:
        """Up to ``count`` idle hosts of ``key``, now leased to ``lease_id``, which ends
        unless renewed every ``grace_s`` seconds or when ``owner`` is lost."""
        await self._settled()  # the hosts a run just gave back may serve this one
        lease = self._lease(lease_id, key, grace_s, run, owner or {})
        idle = self.idle.get(key, [])
        kept = len(idle) - min(count, len(idle))
        taken, self.idle[key] = idle[kept:], idle[:kept]
        lease.hosts.update({h.pid: h.host for h in taken})
        lease.renewed = time.monotonic()
        return [(h.host, h.pid) for h in taken]

    async def add(
        self,
        lease_id: str,
        key: str,
        grace_s: float,
        host: Any,
        pid: int,
        run: str | None = None,
        owner: dict[str, Any] | None = None,
    ) -> None:
        """A host the driver started for its lease."""
        lease = self._lease(lease_id, key, grace_s, run, owner or {})
        lease.hosts[pid] = host
        lease.renewed = time.monotonic()

    def renew(self, lease_id: str) -> bool:
        if lease_id not in self.leases:
            return False
        self.leases[lease_id].renewed = time.monotonic()
        return True

    async def give_back(self, lease_id: str, clean: list[int], cap: int) -> None:
        """End the lease: its ``clean`` hosts (by pid) are idle now, the rest are killed;
        at most ``cap`` hosts stay idle in all (the oldest go first)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:  # ended already: its hosts were killed
            return
        self._idle(lease, clean, cap)

    async def reset_and_give_back(
        self, lease_id: str, members: list[int], cap: int, timeout_s: float
    ) -> None:
        """End the lease now; its ``members`` (by pid) reset meanwhile, each idle once it
        reset clean within ``timeout_s``, the rest killed (:meth:`give_back`). Whatever asks
        the pool for hosts or their pids first waits for the resets (:meth:`_settled`), so
        the driver need not: its run ends while they run."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        task = asyncio.get_running_loop().create_task(self._reset(lease, members, cap, timeout_s))
        self._resets.add(task)
        task.add_done_callback(self._resets.discard)

    async def _reset(self, lease: _Lease, members: list[int], cap: int, timeout_s: float) -> None:
        async def reset(pid: int, host: Any) -> int | None:
            try:
                future = asyncio.wrap_future(host.reset.remote().future())
                dirty = await asyncio.wait_for(future, timeout_s)
            except Exception as err:  # noqa: BLE001 - a host that died or failed its reset
                log.debug("a worker host was not reused: %s", err)
                return None
            if dirty:
                log.info("a worker process is not reused: %s", "; ".join(dirty))
                return None
            return pid

        resets = [reset(pid, host) for pid, host in lease.hosts.items() if pid in members]
        clean = [pid for pid in await asyncio.gather(*resets) if pid is not None]
        self._idle(lease, clean, cap)

    async def _settled(self) -> None:
        """Wait for the hosts being reset (:meth:`reset_and_give_back`)."""
        while self._resets:
            await asyncio.wait(list(self._resets))

    def _idle(self, lease: _Lease, clean: list[int], cap: int) -> None:
        now = time.monotonic()
        for pid, host in lease.hosts.items():
            if pid in clean:
                self.idle.setdefault(lease.key, []).append(_Idle(host, pid, now))
            else:
                _kill([host])
        everyone = sorted(
            ((h.since, k, h) for k, hs in self.idle.items() for h in hs), key=lambda e: e[0]
        )
        for _, k, h in everyone[: max(0, len(everyone) - cap)]:
            self.idle[k].remove(h)
            _kill([h.host])

    async def release_idle(self) -> int:
        await self._settled()
        hosts = [h.host for hs in self.idle.values() for h in hs]
        self.idle = {}
        _kill(hosts)
        return len(hosts)

    async def pids(self) -> dict[str, list[int]]:
        await self._settled()
        return {
            "idle": sorted(h.pid for hs in self.idle.values() for h in hs),
            "leased": sorted(pid for lease in self.leases.values() for pid in lease.hosts),
            "orphaned": sorted(pid for lease, _ in self.orphans.values() for pid in lease.hosts),
        }


def _process_start() -> float | None:
    """When this process started (``time.time()``), where ``psutil`` can tell."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def _started(pid: int) -> str | None:
    """When process ``pid`` started (``/proc``), or ``None`` where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def owner() -> dict[str, Any]:
    """This process, as a lease names its driver, and how long its workers wait for a
    driver of the same run if it is lost (``RINGFLOW_ADOPT_S``)."""
    pid = os.getpid()
    return {"pid": pid, "start": _started(pid), "adopt_s": _seconds("RINGFLOW_ADOPT_S", 180.0)}


def _owner_died(owner: dict[str, Any]) -> bool:
    """Whether the driver ``owner`` names is gone (leases are pooled on one node only)."""
    if not owner or owner.get("start") is None:
        return False  # not known: the lease ends when it is not renewed
    return _started(owner["pid"]) != owner["start"]


def _kill(hosts: list[Any]) -> None:
    import ray

    if not ray.is_initialized():  # no cluster holds them; never start or join one to kill
        return
    for host in hosts:
        with contextlib.suppress(Exception):
            ray.kill(host, no_restart=True)


def _pool() -> Any:
    import ray

    return (
        ray.remote(_Pool)
        .options(
            name=POOL_NAME,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
        )
        .remote(idle_s=_seconds("RINGFLOW_POOL_IDLE_S", 300.0))
    )


def driver_job() -> str:
    """This process's Ray job, as a run key's lease names its writer (``storage.lease``)."""
    import ray

    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_job_id()}"


def release_idle() -> int:
    """Kill the pool's idle hosts (this process must be connected to Ray); how many."""
    import ray

    return ray.get(_pool().release_idle.remote())


def worker_pids() -> dict[str, list[int]]:
    """The pids of the pool's ``idle`` hosts and of those ``leased`` to running drivers."""
    import ray

    return ray.get(_pool().pids.remote())


class HostLease:
    """A driver's hosts from the pool: leased idle ones first, then fresh ones; renewed from
    a thread while the driver lives; reset and given back at the end."""

    def __init__(self, key: str, env_vars: dict[str, str], *, run: str | None = None) -> None:
        self.key, self.env_vars, self.run = key, env_vars, run
        self.id = uuid.uuid4().hex
        self.owner = owner()
        self.grace_s = _seconds("RINGFLOW_POOL_GRACE_S", 30.0)
        self._pool = _pool()
        self._pids: dict[int, int] = {}  # id(actor) -> pid
        self._gpus: list[Any] = []
        """Per bundle of the run's placement group, a ref of the Ray id of its GPU."""
        self._stop = threading.Event()
        self._renewing = threading.Thread(target=self._renew, name="ringflow-lease", daemon=True)
        self._renewing.start()

    def _renew(self) -> None:
        every = max(0.2, self.grace_s / 4)
        while not self._stop.wait(every):
            self._pool.renew.remote(self.id)

    def place(self, placement_group: Any, bundles: int, gpus_per_worker: float) -> None:
        """The run's ``placement_group``: with GPUs, a task in each of its ``bundles`` asks
        Ray which GPU it holds (the pooled hosts reserve none: :meth:`gpu`)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not gpus_per_worker:
            return
        # A lambda travels by value: the task's process need not import ringflow or torch.
        probe = ray.remote(lambda: [str(i) for i in ray.get_gpu_ids()])
        self._gpus = [
            probe.options(
                num_cpus=0,
                num_gpus=gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle
                ),
            ).remote()
            for bundle in range(bundles)
        ]

    def gpu(self, bundle: int) -> Any:
        """What a host of ``bundle`` is started with (``WorkerHost.start``'s ``gpu``): a ref
        of its GPU's Ray id (Ray resolves it before the call runs), ``None`` on CPU."""
        return self._gpus[bundle] if self._gpus else None

    def take(self, count: int) -> list[Any]:
        """``count`` hosts: idle ones of this lease's key, the rest started now."""

        hosts = self._received(
            self._pool.lease.remote(self.id, self.key, count, self.grace_s, self.run, self.owner)
        )
        for host, pid in hosts:
            self._pids[id(host)] = pid
        taken = [host for host, _ in hosts]
        if len(taken) < count:
            log.debug("%d warm worker(s), %d started", len(taken), count - len(taken))
        fresh = [self._start() for _ in range(count - len(taken))]
        return taken + fresh

    def adopt(self) -> list[Any]:
        """The hosts a lost driver of this lease's run left, with their in-memory commits,
        now this lease's; none if there are none."""

        if self.run is None:
            return []
        hosts = self._received(
            self._pool.adopt.remote(self.id, self.run, self.key, self.grace_s, self.owner)
        )
        for host, pid in hosts:
            self._pids[id(host)] = pid
        return [host for host, _ in hosts]

    @staticmethod
    def _received(ref: Any) -> list[tuple[Any, int]]:
        """The hosts the pool answered with; none where their handles cannot be read (the
        lease's hosts this driver cannot use are killed when it gives the lease back)."""
        import ray

        try:
            with handles_from_local_code():
                return ray.get(ref)
        except ray.exceptions.RayError as err:
            log.warning("warm workers from the pool could not be used (%s); starting new ones", err)
            return []

    def _start(self) -> Any:
        import ray

        host = (
            ray.remote(WorkerHost)
            .options(
                num_cpus=0,
                lifetime="detached",
                runtime_env={"env_vars": self.env_vars},
            )
            .remote()
        )
        pid = host.pid.remote()
        self._pool.add.remote(self.id, self.key, self.grace_s, host, pid, self.run, self.owner)
        self._pids[id(host)] = pid
        return host

    def give_back(self, hosts: list[Any], *, reuse: bool, timeout_s: float = 10.0) -> None:
        """End the lease: ``hosts`` that reset clean (with ``reuse``) go back to the pool,
        every other host of the lease is killed. The pool resets them: this returns at once
        (``_Pool.reset_and_give_back``)."""
        import ray

        self._stop.set()
        members: list[int] = []
        for host in hosts if reuse else []:
            pid = self._pids.get(id(host))
            try:
                members.append(pid if isinstance(pid, int) else ray.get(pid, timeout=timeout_s))
            except Exception as err:  # noqa: BLE001 - a host that died is killed
                log.debug("a worker host was not reused: %s", err)
        cap = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        if members:
            ray.get(self._pool.reset_and_give_back.remote(self.id, members, cap, timeout_s))
        else:
            ray.get(self._pool.give_back.remote(self.id, [], cap))
