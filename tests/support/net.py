"""Ports on loopback and calls to a Prefect server, for tests that start servers."""

from __future__ import annotations

import socket
import time

import httpx


def free_port(count: int = 1) -> int:
    """A port on 127.0.0.1 such that it and the ``count - 1`` ports after it are free."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count < 65536 and all(_is_free(base + i) for i in range(1, count)):
            return base


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def prefect_api(method: str, url: str, **kwargs):
    """An HTTP call to the Prefect server, repeated while it answers 503: the server says so
    when its SQLite database is busy, and nothing was done (Prefect's own client retries
    these too)."""
    kwargs.setdefault("timeout", 60)
    for _ in range(10):
        reply = httpx.request(method, url, **kwargs)
        if reply.status_code != 503:
            break
        time.sleep(1.0)
    return reply.raise_for_status()
