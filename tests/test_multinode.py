"""A 2-node Ray cluster on this machine loses a node mid-training, and gets it back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.support.fitting import relative_difference
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration  # a Ray cluster of its own

# The driver: 2 workers of 1 CPU spread over the head and node "b" (1 CPU each), so losing
# "b" leaves one worker until "b" is back. ``on_epoch`` paces the epochs from the driver
# while a file "pace" exists (the workers stay idle meanwhile), so the test has time to kill
# and restart the node; once the worker is back the test removes it and training runs out.
DRIVER = textwrap.dedent(
    """
    import json, os, sys, time
    import ray
    from safetensors.torch import save_file
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.models.digits import SCHEMA, DigitsClassifier

    dataset, out = sys.argv[1:3]
    ray.init(log_to_driver=False)

    def on_epoch(m):
        print(f"epoch {m.epoch}", flush=True)
        if os.path.exists(out + "/pace"):
            time.sleep(1.0)

    result = fit(
        DigitsClassifier,
        hparams={"hidden": 32, "lr": 0.01},
        data=DataSpec(dataset_url=dataset, schema=SCHEMA),
        config=TrainConfig(
            workers=2, min_workers=1, epochs=100, batch_size=64, seed=4, placement="spread",
            cpus_per_worker=1, collective_timeout_s=3.0, timeout_s=60,
        ),
        checkpoint_uri=out + "/model",
        on_epoch=on_epoch,
    )
    save_file(result.state_dict, out + "/final.safetensors")
    print(json.dumps({"events": [vars(e) for e in result.events]}), flush=True)
    """
)


def _cluster(env: dict, *args: str) -> None:
    subprocess.run(
        ["./deployments/ray-cluster.sh", *args], cwd=ROOT, env=env, check=True, timeout=240
    )


def test_a_lost_node_is_survived_and_its_worker_grows_back(digits, tmp_path):
    from safetensors.torch import load_file

    from ringflow.engine import TrainConfig, fit
    from ringflow.models.digits import DigitsClassifier

    port = free_port(20)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RINGFLOW_"))},
        "RINGFLOW_STATE": str(tmp_path / "state"),
        "RINGFLOW_RAY_PORT": str(port),
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "RINGFLOW_LOCAL_RAY": "1",
        "PYTHONPATH": str(ROOT),
    }
    env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "state" / "ray" / "auth_token")
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the driver connects on loopback
    try:
        _cluster(env, "head", "1")
        _cluster(env, "node", "b", "1", str(port + 10))
        (tmp_path / "pace").touch()
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, digits.dataset_url, str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = _Lines(driver)
        lines.wait_for("epoch 2", timeout=240)
        _cluster(env, "kill-node", "b")
        lines.wait_for("lost during", timeout=60)
        _cluster(env, "node", "b", "1", str(port + 10))
        lines.wait_for("joined at step", timeout=240)
        (tmp_path / "pace").unlink()
        lines.wait_for('"events"', timeout=300)
        assert driver.wait(timeout=60) == 0, lines.tail()
    finally:
        _cluster(env, "stop")
    kinds = [e["kind"] for e in json.loads(lines.last)["events"]]
    assert kinds[:3] in (["lost", "went_on", "recovered"], ["lost", "rollback", "recovered"]), kinds
    assert "joined" in kinds, kinds
    reference = fit(
        DigitsClassifier,
        hparams={"hidden": 32, "lr": 0.01},
        data=digits,
        config=TrainConfig(workers=1, epochs=100, batch_size=64, seed=4),
        checkpoint_uri=str(tmp_path / "reference"),
        in_process=True,
    )
    final = load_file(str(tmp_path / "final.safetensors"))
    assert relative_difference(final, reference.state_dict) < 1e-5
    assert not torch.equal(final["net.0.weight"], DigitsClassifier(hidden=32).net[0].weight)


class _Lines:
    """The driver's output, read line by line until a marker shows up."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.seen, self.last = proc, [], ""

    def wait_for(self, marker: str, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the driver ended before {marker!r}:\n{self.tail()}")
            self.seen.append(line)
            if marker in line:
                self.last = line
                return
        raise AssertionError(f"no {marker!r} within {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        return "".join(self.seen[-40:])
