"""Shared fixtures: one Ray instance per test session, quiet and on loopback only."""

from __future__ import annotations

import os
import socket

import pytest

# Offline and quiet before anything imports Ray or Prefect.
for _key, _value in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "GLOO_SOCKET_IFNAME": "lo",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The bundled digits, preprocessed once per session, as the engine takes them."""
    from ringflow.engine import DataSpec
    from ringflow.models.digits import SCHEMA, write_digits_csv
    from ringflow.storage.dataset import preprocess

    root = str(tmp_path_factory.mktemp("digits"))
    write_digits_csv(f"{root}/raw/digits.csv")
    result = preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0)
    return DataSpec(dataset_url=result.dataset_url, schema=SCHEMA)


def relative_difference(a: dict, b: dict) -> float:
    """The largest relative difference, by norm, between two state dicts' tensors."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)


@pytest.fixture(scope="session")
def ray_session():
    """A private local Ray instance (never joins another one on the machine)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


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
    import time

    import httpx

    kwargs.setdefault("timeout", 60)
    for _ in range(10):
        reply = httpx.request(method, url, **kwargs)
        if reply.status_code != 503:
            break
        time.sleep(1.0)
    return reply.raise_for_status()
