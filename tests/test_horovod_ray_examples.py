"""Horovod's Ray examples, ``examples/ray/pytorch_ray_elastic.py`` and
``examples/ray/basic_ray_elastic.py`` (tests/horovod_examples/, NOTICE there), with
``horovod`` resolving to ringflow (tests/horovod_contract/shim/) and nothing changed but their
data source: each joins the module's Ray cluster (``ray.init(address="auto")``) of 4 CPUs and
2 declared GPUs, in turn, since both ask for ``use_gpu=True``; torch here has no CUDA, so they
train on CPU, on 2 ranks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.ray_cluster import RayCluster, shared_cluster

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "tests" / "horovod_examples"
SHIM = ROOT / "tests" / "horovod_contract" / "shim"


@pytest.fixture(scope="module")
def examples_ray(tmp_path_factory) -> Iterator[tuple[RayCluster, Path]]:
    """The cluster both examples join, and the folder they run in: its workers' (where the
    examples write their checkpoints) and theirs."""
    where = tmp_path_factory.mktemp("examples")
    with shared_cluster(num_cpus=4, num_gpus=2, cwd=where) as cluster:
        yield cluster, where


def _example(cluster: RayCluster, name: str, *args: str, cwd: Path) -> subprocess.Popen:
    """The example ``name`` with ``args``, its output (standard error too) read by line."""
    path = os.pathsep.join(filter(None, [str(SHIM), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / name), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env={**os.environ, "RAY_ADDRESS": cluster.address, "PYTHONPATH": path},
    )


def test_the_elastic_mnist_example_loses_a_rank_mid_run_and_finishes_with_its_replacement(
    examples_ray,
):
    """A rank's process is SIGKILLed in the first epoch: the other rolls back to its last
    commit and goes on alone, a worker started in its place joins at a commit, and the run
    trains its epochs to the end on 2 ranks and tests."""
    cluster, where = examples_ray
    run = _example(
        cluster, "pytorch_ray_elastic.py", "--epochs", "15", "--batch-size", "8", cwd=where
    )
    lines = []
    for line in run.stdout:
        lines.append(line)
        if re.match(r"\[\d\] Train Epoch: 1 \[80/", line):
            break
    workers = cluster.actor_processes("_ElasticWorker")
    assert len(workers) == 2, "".join(lines)
    cluster.kill(workers[0])
    lines += run.stdout.readlines()
    assert run.wait(timeout=600) == 0, "".join(lines)[-5000:]
    text = "".join(lines)
    lost = re.search(r"ringflow-run: worker (\d) lost \(its process died\)", text)
    assert lost, text[-5000:]
    survivor = "1" if lost.group(1) == "0" else "0"
    # The survivor's reset rolls it back to its last commit, and may take the worker started
    # in place of the lost one in at once where that one is ready by then (a busy machine).
    reset = re.search(
        rf"\[{survivor}\] ringflow.horovod: 2 -> (\d) ranks, this one rank \d, in [\d.]+ s: (.*)",
        text,
    )
    assert reset, text[-5000:]
    assert reset.group(2).startswith("rolled back") or reset.group(1) == "2", reset.group(0)
    assert re.search(r"joined at step \d+: 2: a worker started in place of a lost one", text)
    assert re.search(r"\[2\] Train Epoch: \d+ ", text)  # the replacement trained
    for worker in (survivor, "2"):
        assert f"[{worker}] Train Epoch: 15 [720/750" in text  # both to the last batch
    assert re.search(rf"\[{survivor}\] Test set: Average loss: [\d.]+, Accuracy: ", text)


def test_the_basic_elastic_example_trains_and_its_callbacks_get_rank_0s_logs(examples_ray):
    """Its LR scheduler and elastic sampler ride in the ``TorchState``; what rank 0 logs
    (``ray_logger.log``) reaches both callbacks: tqdm's bars and the TensorBoard writer."""
    cluster, where = examples_ray
    run = _example(cluster, "basic_ray_elastic.py", "--epochs", "1", cwd=where)
    text = run.stdout.read()
    assert run.wait(timeout=600) == 0, text[-5000:]
    assert "[mode=train] Epoch     #1: 100%|" in text  # tqdm_callback: 94 batches of 8
    logged = [json.loads(line) for line in (where / "logs" / "scalars.jsonl").open()]
    assert {entry["tag"] for entry in logged} == {"train/loss", "train/accuracy"}
    assert len(logged) == 2 * 94  # one value of each per batch of rank 0
    # its learning rate is a numpy float (lr * np.sqrt(hvd.size())): not weights only
    checkpoint = torch.load(where / "checkpoint-1.pth.tar", weights_only=False)
    assert checkpoint["scheduler"]["last_epoch"] == 1  # stepped once, at the epoch's end
    assert set(checkpoint) == {"model", "optimizer", "scheduler"}
