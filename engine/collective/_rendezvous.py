"""Joining a ring: the TCP store rank 0 hosts, and whether every rank shares this host."""

from __future__ import annotations

import datetime as dt
import os
import socket
import urllib.parse

import torch.distributed as dist

__all__ = ["open_store", "same_host", "tcp_store"]


def open_store(init_method: str, *, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """Connect to (on rank 0: host) the TCP store at ``init_method``, ``tcp://host:port``.

    Raises:
        ValueError: ``init_method`` is not a ``tcp://host:port`` URL.
    """
    url = urllib.parse.urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must look like tcp://host:port, got {init_method!r}")
    return tcp_store(init_method, is_master=rank == 0, timeout_s=timeout_s, world_size=world_size)


def tcp_store(
    address: str, *, is_master: bool, timeout_s: float, world_size: int | None = None
) -> dist.Store:
    """The TCP store at ``address`` (``tcp://host:port``); the master listens on that host
    only, not on every interface as torch's own store does."""
    url = urllib.parse.urlparse(address)
    timeout = dt.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in url.hostname else socket.AF_INET
    listening = socket.create_server((url.hostname, url.port), family=family, backlog=128)
    return dist.TCPStore(
        url.hostname,
        url.port,
        world_size,
        is_master=True,
        timeout=timeout,
        master_listen_fd=listening.detach(),  # the store owns the socket from here
    )


def same_host(store: dist.Store, *, rank: int, world_size: int) -> bool:
    """Whether every rank runs on this host, sees the same ``/dev/shm`` and the same pids."""
    store.set(f"host/{rank}", _host_identity())
    identities = store.multi_get([f"host/{q}" for q in range(world_size)])
    return len(set(identities)) == 1


def _host_identity() -> str:
    """Boot id plus pid and mount namespaces: containers on one machine differ here."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespaces = [str(os.stat(f"/proc/self/ns/{ns}").st_ino) for ns in ("pid", "mnt")]
    except OSError:
        return f"unknown-{os.getpid()}"  # never equal to another process's: no shared memory
    return ":".join([boot, *namespaces])
