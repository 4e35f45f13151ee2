"""One of four GPU workers dies mid-training: the others go on within seconds, a replacement
takes the freed GPU, and the run ends where an uninterrupted one does.

Needs 4 CUDA devices (``-m gpu`` on the lent 4-GPU machine); skipped elsewhere. The same as
``tests/test_elastic.py`` does on CPU, with the workers on GPUs: gradients over NCCL and the
ring's symmetric-memory transport, whose deadlines turn the dead peer into an error.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from tests.conftest import relative_difference
from tests.test_elastic import HPARAMS, PacedDigits, _strike

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices"),
]


@pytest.fixture(scope="module")
def ray4():
    import ray

    if ray.is_initialized():
        if ray.cluster_resources().get("GPU", 0) < 4:
            pytest.skip("the running Ray instance has fewer than 4 GPUs")
        yield ray
        return
    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
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
        "workers": 4,
        "epochs": 30,
        "batch_size": 64,
        "seed": 2,
        "cpus_per_worker": 1,
        "gpus_per_worker": 1,
        "collective": "ring",
        "collective_timeout_s": 3.0,
        **config,
    }
    result = fit(
        SlowDigits,
        hparams=HPARAMS,
        data=digits,
        config=TrainConfig(**config),
        checkpoint_uri=str(tmp_path / name),
        on_epoch=on_epoch,
    )
    return result, {k: v.detach().cpu() for k, v in result.state_dict.items()}


def test_a_killed_gpu_worker_leaves_three_that_go_on_and_a_fourth_rejoins(ray4, digits, tmp_path):
    reference, want = _fit(digits, tmp_path, "reference")
    on_epoch, struck = _strike(signal.SIGKILL, after_epoch=1, delay_s=0.02)
    result, got = _fit(digits, tmp_path, "elastic", min_workers=3, on_epoch=on_epoch)
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
    assert result.events[-1].workers == 4
    assert relative_difference(got, want) < 1e-5
