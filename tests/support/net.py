"""Ports on loopback and calls to a Prefect server, for tests that start servers."""

from __future__ import annotations

import random
import socket
import time

import httpx

_QUIET = range(20000, 32000)
"""Ports nothing else here takes on its own: above Ray's workers' (10002-19999) and below
the kernel's ephemeral range (32768-60999 on Linux), from which every ``bind(0)`` (Ray's
processes start dozens) draws. A port a test picks there stays free until its server
binds it."""


def free_port(count: int = 1) -> int:
    """A port on 127.0.0.1 such that it and the ``count - 1`` ports after it are free."""
    draw = random.SystemRandom()
    while True:
        base = draw.randrange(_QUIET.start, _QUIET.stop - count)
        if all(_is_free(base + i) for i in range(count)):
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
