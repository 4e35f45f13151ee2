"""Connecting to Ray: an existing cluster through ``RAY_ADDRESS``, else a private local one."""

from __future__ import annotations

import importlib
import logging
import os
import site
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "LEAN_RAY_ENV",
    "QUIET_ENV",
    "SECRET_ENV",
    "connect",
    "dashboard_url",
    "handles_from_local_code",
    "trains_in_process",
    "log_files",
    "quiet_environment",
    "without_secrets",
]

log = logging.getLogger("ringflow.engine")

QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "DO_NOT_TRACK": "1",
}
"""Offline and quiet: no usage statistics, nothing bound beyond loopback on one machine."""


LEAN_RAY_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}
"""A Ray that ringflow starts (a private local one, the local stack's head) starts no idle
worker processes ahead of time. Ray prestarts one per CPU, and one more for each driver, in
the default environment, each importing Ray; ringflow's workers start in an environment of
their own (``engine/pool.py``), so those would never be used, only cost CPU while the run's
own workers start (16 of them on a 16-core host)."""


SECRET_ENV = ("RINGFLOW_SERVE_TOKEN",)
"""Secrets that only the driving process reads: Ray's processes (workers, Serve replicas)
start without them. The model server gets a digest of the serving token, never the token."""


@contextmanager
def without_secrets() -> Iterator[None]:
    """:data:`SECRET_ENV` out of this process's environment while the block runs (starting
    Ray's processes, which inherit it), and back afterwards."""
    held = {key: os.environ.pop(key) for key in SECRET_ENV if key in os.environ}
    try:
        yield
    finally:
        os.environ.update(held)


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the block runs, then as they were."""
    held = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in held.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def quiet_environment(**extra: str) -> None:
    """Set ``QUIET_ENV`` (and ``extra``) in this process's environment where not set already.

    Ray reads some of these once, when it is imported: call this before importing Ray.
    """
    for key, value in {**QUIET_ENV, **extra}.items():
        os.environ.setdefault(key, value)


def connect(
    address: str | None = None, *, num_cpus: int | None = None, model: str | None = None
) -> str:
    """Make sure this process is connected to Ray and return the cluster's address.

    Args:
        address: a Ray address; defaults to ``RAY_ADDRESS``. When neither is set a private
            local Ray starts in this process and stops with it; its processes start without
            :data:`SECRET_ENV`.
        num_cpus: CPUs of that local Ray; defaults to this machine's.
        model: the import path of the model to train or serve (``package.module:Class``).
            On an existing cluster, a model whose code is not installed (a user's project
            directory) is shipped to the workers with the job (Ray's ``py_modules``); a
            private local Ray's workers start in this process's directory and see it anyway.
    """
    import ray

    quiet_environment()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False, runtime_env=_project_code(model))
        else:
            # every Ray process inherits the environment of this one
            with without_secrets(), _environment(LEAN_RAY_ENV):
                ray.init(
                    address="local",
                    num_cpus=num_cpus or os.cpu_count(),
                    include_dashboard=False,
                    log_to_driver=False,
                )
    where = ray.get_runtime_context().gcs_address
    log.info("connected to Ray at %s", where)
    return where


def trains_in_process(*, workers: int, gpus_per_worker: float, stages: int = 1) -> bool:
    """Whether a run trains in this process, starting no Ray: one CPU worker in one piece,
    with no cluster named (``RAY_ADDRESS``) and none this process is already connected to
    (a run that used Ray before, or will serve on it, trains where its workers are warm)."""
    import sys

    ray = sys.modules.get("ray")
    connected = ray is not None and ray.is_initialized()
    alone = workers == 1 and not gpus_per_worker and stages == 1
    return alone and not connected and not os.environ.get("RAY_ADDRESS")


@contextmanager
def handles_from_local_code() -> Iterator[None]:
    """Actor handles this process receives inside the block load their class from its own
    code (an importable module), not from the job that created the actor: the pool's
    workers (``engine.pool``) outlive the job that started them, and Ray drops a finished
    job's classes, so a handle of one would not load. Ray's private switch, checked with
    ray 2.60."""
    from ray._private import worker

    was = worker.global_worker.load_code_from_local
    worker.global_worker.set_load_code_from_local(True)
    try:
        yield
    finally:
        worker.global_worker.set_load_code_from_local(was)


def dashboard_url() -> str | None:
    """The dashboard of the Ray cluster this process is connected to (``http://host:port``),
    or ``None`` when it runs none or this process is not connected."""
    import ray

    if not ray.is_initialized():
        return None
    from ray._private import worker

    url = getattr(getattr(worker, "_global_node", None), "webui_url", None)
    if not url:
        return None
    return url if "://" in url else f"http://{url}"


def log_files() -> dict[str, str]:
    """Where this process's output goes: ``stdout`` and ``stderr`` where they are files (as
    in a Ray worker, whose output Ray writes under its session's ``logs`` folder), and the
    ``node`` (host name) they are on."""
    import socket

    where = {"node": socket.gethostname()}
    for name, fd in (("stdout", 1), ("stderr", 2)):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if path.startswith("/") and not path.startswith("/dev/"):
            where[name] = path
    return where


def _project_code(model: str | None) -> dict | None:
    """A runtime environment carrying the model's top-level package when it is not installed.

    Installed code (site-packages, ringflow itself) is on every node already; anything else
    was found through this process's working directory or ``PYTHONPATH``.
    """
    if model is None:
        return None
    top = model.partition(":")[0].split(".")[0]
    module = importlib.import_module(top)
    origin = getattr(module, "__file__", None)
    if top == "ringflow" or origin is None:
        return None
    location = os.path.dirname(origin) if origin.endswith("__init__.py") else origin
    installed = {*site.getsitepackages(), site.getusersitepackages(), sys.prefix}
    if any(_inside(location, folder) for folder in installed):
        return None
    log.info("shipping %s to the Ray workers with the job", location)
    return {"py_modules": [location]}


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder
