"""Connecting to Ray: an existing cluster through ``RAY_ADDRESS``, else a private local one."""

from __future__ import annotations

import logging
import os

__all__ = ["QUIET_ENV", "connect", "quiet_environment"]

log = logging.getLogger("ringflow.engine")

QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "DO_NOT_TRACK": "1",
}
"""Offline and quiet: no usage statistics, nothing bound beyond loopback on one machine."""


def quiet_environment(**extra: str) -> None:
    """Set ``QUIET_ENV`` (and ``extra``) in this process's environment where not set already.

    Ray reads some of these once, when it is imported: call this before importing Ray.
    """
    for key, value in {**QUIET_ENV, **extra}.items():
        os.environ.setdefault(key, value)


def connect(address: str | None = None, *, num_cpus: int | None = None) -> str:
    """Make sure this process is connected to Ray and return the cluster's address.

    Args:
        address: a Ray address; defaults to ``RAY_ADDRESS``. When neither is set a private
            local Ray starts in this process and stops with it.
        num_cpus: CPUs of that local Ray; defaults to this machine's.
    """
    import ray

    quiet_environment()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(
                address="local",
                num_cpus=num_cpus or os.cpu_count(),
                include_dashboard=False,
                log_to_driver=False,
            )
    where = ray.get_runtime_context().gcs_address
    log.info("connected to Ray at %s", where)
    return where
