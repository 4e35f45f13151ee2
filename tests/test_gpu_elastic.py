"""One of four GPU workers dies mid-training: the others go on within seconds, a replacement
takes the freed GPU, and the run ends where an uninterrupted one does.

Needs 4 CUDA devices (``-m gpu`` on the lent 4-GPU machine); skipped elsewhere. With
``RINGFLOW_GPU_WORLD=2`` the same test runs 2 workers on 2 GPUs. The same as
``tests/test_elastic.py`` does on CPU, with the workers on GPUs: gradients over NCCL and the
ring's symmetric-memory transport, whose deadlines turn the dead peer into an error.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from tests.support.fitting import relative_difference
from tests.test_elastic import HPARAMS, PacedDigits, _strike

WORKERS = int(os.environ.get("RINGFLOW_GPU_WORLD", "4"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < WORKERS, reason=f"needs {WORKERS} CUDA devices"),
]


@pytest.fixture(scope="module")
def ray_gpus():
    import ray

    if ray.is_initialized():
        if ray.cluster_resources().get("GPU", 0) < WORKERS:
            pytest.skip(f"the running Ray instance has fewer than {WORKERS} GPUs")
        yield ray
        return
    ray.init(
        address="local",
        num_cpus=2 * WORKERS,
        num_gpus=WORKERS,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


class SlowDigits(PacedDigits):
    """Steps slow enough that a replacement GPU worker (a process importing torch and making
    a CUDA context) is up before the survivors finish."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.04)
        return super().training_step(batch, batch_idx)


def _fit(digits, tmp_path, name, *, on_epoch=None, **config):
    config = {
        "workers": WORKERS,
        "epochs": 30,
        "batch_size": 64,
        "seed": 2,
        "cpus_per_worker": 1,
        "gpus_per_worker": 1,
        "collective": "ring",
        "collective_timeout_s": 3.0,
        **config,
    }

    def progress(metrics) -> None:  # with -s, where a run that does not end got to
        print(f"{name}: epoch {metrics.epoch} done at {time.time():.2f}", flush=True)
        if on_epoch is not None:
            on_epoch(metrics)

    result = fit(
        SlowDigits,
        hparams=HPARAMS,
        data=digits,
        config=TrainConfig(**config),
        checkpoint_uri=str(tmp_path / name),
        on_epoch=progress,
    )
    print(f"{name}: {result.events}", flush=True)
    return result, {k: v.detach().cpu() for k, v in result.state_dict.items()}


def test_a_killed_gpu_worker_leaves_the_others_going_on_and_is_replaced(ray_gpus, digits, tmp_path):
    reference, want = _fit(digits, tmp_path, "reference")
    on_epoch, struck = _strike(signal.SIGKILL, after_epoch=1, delay_s=0.02)
    result, got = _fit(digits, tmp_path, "elastic", min_workers=WORKERS - 1, on_epoch=on_epoch)
    assert struck, "no worker was killed"
    kinds = [e.kind for e in result.events]
    assert kinds[:3] == ["lost", "rollback", "recovered"] or kinds[:3] == [
        "lost",
        "rollback",
        "joined",
    ], result.events
    assert "joined" in kinds, result.events  # the freed GPU took a replacement
    lost = result.events[0]
    going_on = next(e for e in result.events if e.kind in ("recovered", "joined"))
    assert lost.at - struck[0][1] < 10  # the loss was seen within seconds
    assert going_on.at - struck[0][1] < 10  # and training went on within seconds
    assert result.events[-1].workers == WORKERS
    assert relative_difference(got, want) < 1e-5
