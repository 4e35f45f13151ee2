"""The private local Ray a run starts (``engine.cluster.connect`` with no ``RAY_ADDRESS``)
starts no idle worker processes: Ray would prestart one per CPU, each importing Ray, that
ringflow's workers (started in an environment of their own) never use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ringflow.engine.cluster import LEAN_RAY_ENV

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration

_CONNECT_AND_LOOK = textwrap.dedent(
    """
    import json, sys, time
    import psutil
    import ray
    from ringflow.engine.cluster import connect

    if sys.argv[1] == "ringflow":
        connect(num_cpus=2)
    else:  # Ray's defaults, for comparison
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    seen, deadline = set(), time.monotonic() + 4  # prestarted workers come within a second
    while time.monotonic() < deadline:
        for proc in psutil.Process().children(recursive=True):
            try:
                command = proc.cmdline()
            except psutil.Error:
                continue
            # a worker as it starts (Python running default_worker.py), then idle
            starting = len(command) > 1 and command[1].endswith("default_worker.py")
            if starting or command and command[0].strip() == "ray::IDLE":
                seen.add(proc.pid)
        time.sleep(0.2)
    print(json.dumps({"idle_workers": len(seen)}))
    """
)


def _idle_workers(how: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k not in LEAN_RAY_ENV}
    done = subprocess.run(
        [sys.executable, "-c", _CONNECT_AND_LOOK, how],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["idle_workers"]


def test_a_private_local_ray_starts_no_idle_workers_where_rays_defaults_start_them():
    assert _idle_workers("ray") >= 2  # one per CPU: what the lean start saves
    assert _idle_workers("ringflow") == 0
