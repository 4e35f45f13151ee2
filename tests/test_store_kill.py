"""SIGKILL a process while it saves checkpoints; the next load is always the newest commit.

The harness is ``bench.checkpoint_kill`` (which runs 1,000 kills); here it runs 50 kills on a
local disk and 6 on S3 (moto behind the proxy, slowed down so kills land mid-request).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.checkpoint_kill import run_kills
from tests.moto_s3 import Faults, S3Endpoint, s3_endpoint


def test_fifty_kills_on_a_local_disk_never_load_a_bad_checkpoint(tmp_path: Any) -> None:
    report = run_kills(str(tmp_path / "ckpt"), kills=50, seed=1)
    assert report.problems == []
    assert (report.kills, report.loads, report.bad_loads) == (50, 50, 0)
    assert report.newest_step > 10  # the children made progress between kills
    assert report.interrupted_writes >= 5  # and many kills hit a write in progress


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with s3_endpoint(Faults(seed=5, slow_rate=0.3, slow_s=0.05)) as endpoint:
        yield endpoint


def test_kills_on_s3_never_load_a_bad_checkpoint(s3: S3Endpoint) -> None:
    report = run_kills(
        s3.url("kill"),
        kills=6,
        seed=2,
        max_delay_s=0.8,
        storage_options=s3.storage_options(),
        settle=s3.proxy.settle,  # the killed child's last requests still reach moto
    )
    assert report.problems == []
    assert (report.kills, report.bad_loads) == (6, 0)
    assert report.newest_step > 0
