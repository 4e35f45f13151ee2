"""GPU workers from the warm pool: each learns its bundle's GPU, and one that goes back to the
pool leaves nothing of its run on the GPU or in torch's flags (the test marked ``gpu`` needs a
CUDA device; the others run anywhere)."""

from __future__ import annotations

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.engine.pool import _backend_flags, _free_cuda, _set_backend_flags, pooled
from ringflow.engine.worker import ASSIGNED_GPU, NOSET_VISIBLE_DEVICES, _assigned_gpu
from ringflow.models.digits import DigitsClassifier


def test_gpu_workers_are_pooled_on_one_node_only(monkeypatch):
    monkeypatch.delenv("RINGFLOW_WORKER_POOL", raising=False)
    assert pooled(1, True)
    assert pooled(0.5, True)
    assert pooled(0, True)
    assert not pooled(1, False)
    monkeypatch.setenv("RINGFLOW_WORKER_POOL", "0")
    assert not pooled(1, True)


def test_a_pooled_worker_trains_on_the_gpu_its_bundle_holds(monkeypatch):
    monkeypatch.setenv(NOSET_VISIBLE_DEVICES, "1")
    monkeypatch.setenv(ASSIGNED_GPU, "3")  # Ray's id of the bundle's GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _assigned_gpu() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")  # the node shows these two
    assert _assigned_gpu() == 1


def test_a_reset_puts_back_the_backend_flags_a_run_set():
    before = _backend_flags()
    try:
        torch.backends.cudnn.benchmark = not before["cudnn.benchmark"]
        torch.backends.cuda.matmul.allow_tf32 = not before["cuda.matmul.allow_tf32"]
        torch.set_float32_matmul_precision("medium")
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert _backend_flags() != before
    finally:
        _set_backend_flags(before)
    assert _backend_flags() == before
    if not torch.cuda.is_available():
        assert _free_cuda() == []  # nothing to free where CUDA never started


@pytest.fixture(scope="module")  # started before the leak guard looks (Ray sets PYTHONBREAKPOINT)
def one_gpu_ray():
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is running")
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_consecutive_gpu_fits_share_a_warm_process_and_end_bit_for_bit(
    one_gpu_ray, digits, tmp_path
):
    from ringflow.engine.pool import worker_pids

    def run(name: str) -> dict[str, torch.Tensor]:
        result = fit(
            DigitsClassifier,
            hparams={"hidden": 64, "lr": 0.01},
            data=digits,
            config=TrainConfig(workers=1, epochs=2, batch_size=64, seed=3, gpus_per_worker=1),
            checkpoint_uri=str(tmp_path / name),
        )
        return {k: v.cpu() for k, v in result.state_dict.items()}

    first = run("first")
    idle = worker_pids()["idle"]
    assert len(idle) == 1
    second = run("second")
    assert worker_pids()["idle"] == idle  # the same process, reset clean, served both
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name
