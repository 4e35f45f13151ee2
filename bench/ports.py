"""A free TCP port on the loopback, for the benchmarks' rendezvous stores and servers."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A port nothing listens on now on 127.0.0.1 (free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
