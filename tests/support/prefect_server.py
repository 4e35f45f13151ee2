"""A Prefect server of this test process, for the flow runs its tests start from the command
line: each would otherwise start a temporary server of its own (8 s here, most of a small
run). Runs report to it as to any server a user names with ``PREFECT_API_URL``; what the CLI
does with none named (the temporary server) stays tested in tests/test_e2e.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.net import free_port


@contextlib.contextmanager
def prefect_server(home: Path) -> Iterator[str]:
    """Prefect's API (its URL) on a free port of 127.0.0.1, its database under ``home``,
    until the block ends."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_UI_ENABLED="false",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
        + ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error"],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180  # migrations first, on a busy machine
        while True:
            assert server.poll() is None, "the Prefect server exited at start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{api}/health", timeout=5, trust_env=False).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the Prefect server did not answer in 180 s"
            time.sleep(0.2)
        yield api
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
