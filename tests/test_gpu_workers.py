"""Workers on GPUs: ``gpus_per_worker`` is checked, reserved from Ray, and trained on.

The tests marked ``gpu`` need CUDA devices (``-m gpu`` on the lent GPU machine) and are
skipped elsewhere; the others run on any machine, against Ray clusters without GPUs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from ringflow.engine import EngineError, TrainConfig, fit
from ringflow.engine.group import RayWorkerGroup, _worker_bundle
from ringflow.engine.worker import Worker, worker_device
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import relative_difference

HPARAMS = {"hidden": 32, "lr": 0.01}


def needs_2_gpus(test):
    """Marks ``test`` ``gpu`` and skips it without 2 CUDA devices (before any fixture)."""
    test = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")(test)
    return pytest.mark.gpu(test)


# ---------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("value", [-1, 1.0, 0.5, True, "1", None])
def test_bad_gpus_per_worker_names_the_field(value):
    with pytest.raises(ValueError, match="gpus_per_worker"):
        TrainConfig(gpus_per_worker=value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ring_transport": "tcp"}, "ring_transport must be one of"),
        ({"ring_transport": "symm"}, "is for GPU workers: set gpus_per_worker"),
        ({"ring_transport": "nccl"}, "is for GPU workers"),
        ({"ring_transport": "shm", "gpus_per_worker": 1}, "GPU workers use 'auto', 'nccl'"),
    ],
)
def test_a_ring_transport_that_cannot_serve_the_workers_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_gpus_are_reserved_only_when_asked_for():
    assert TrainConfig().gpus_per_worker == 0
    assert worker_device(TrainConfig()) == torch.device("cpu")
    assert _worker_bundle(TrainConfig()) == {"CPU": 1.0}
    assert _worker_bundle(TrainConfig(cpus_per_worker=4, gpus_per_worker=2)) == {
        "CPU": 4,
        "GPU": 2,
    }


def test_in_process_pipeline_stages_refuse_gpus_before_any_worker_starts(digits, tmp_path):
    from ringflow.engine.pipeline import PipelineConfig
    from tests.test_pipeline_ray import DigitsPipe

    with pytest.raises(ValueError, match="in_process runs the stages as threads on CPU"):
        fit(
            DigitsPipe,
            hparams={},
            data=digits,
            config=TrainConfig(workers=1, gpus_per_worker=1),
            pipeline=PipelineConfig(stages=2),
            checkpoint_uri=str(tmp_path / "never"),
            in_process=True,
        )
    assert not (tmp_path / "never").exists()


# ---------------------------------------------------------------------------- clusters without GPUs


@pytest.mark.ray
@pytest.mark.parametrize("min_workers", [None, 1])
def test_more_gpus_than_the_cluster_has_are_refused_before_any_worker_starts(
    ray_session, digits, tmp_path, min_workers
):
    """Every bundle is reserved up front, elastic or not: the whole cluster must hold them."""
    ray = ray_session
    gpus = int(ray.cluster_resources().get("GPU", 0))
    per_worker = gpus // 2 + 1  # 1 on a cluster without GPUs: 2 workers need more than it has
    placed = len(ray.util.placement_group_table())
    with pytest.raises(EngineError, match="lower workers or gpus_per_worker") as refused:
        fit(
            DigitsClassifier,
            hparams=HPARAMS,
            data=digits,
            config=TrainConfig(
                workers=2, epochs=1, gpus_per_worker=per_worker, min_workers=min_workers
            ),
            checkpoint_uri=str(tmp_path / "never"),
        )
    assert f"need {2 * per_worker} GPUs but the Ray cluster has {gpus}" in str(refused.value)
    assert len(ray.util.placement_group_table()) == placed  # nothing was even placed
    assert not (tmp_path / "never").exists()


@pytest.mark.ray
def test_pipeline_stages_on_more_gpus_than_the_cluster_has_are_refused_before_placing(
    ray_session, digits, tmp_path
):
    from ringflow.engine.pipeline import PipelineConfig
    from tests.test_pipeline_ray import DigitsPipe

    gpus = int(ray_session.cluster_resources().get("GPU", 0))
    per_worker = gpus // 4 + 1  # 2 replicas x 2 stages need more than the cluster has
    placed = len(ray_session.util.placement_group_table())
    with pytest.raises(EngineError, match="add Ray nodes with GPUs") as refused:
        fit(
            DigitsPipe,
            hparams={},
            data=digits,
            config=TrainConfig(
                workers=2, epochs=1, cpus_per_worker=0.5, gpus_per_worker=per_worker
            ),
            pipeline=PipelineConfig(stages=2),
            checkpoint_uri=str(tmp_path / "never"),
        )
    assert f"4 stage workers x {per_worker} GPU need {4 * per_worker} GPUs" in str(refused.value)
    assert f"the Ray cluster has {gpus}" in str(refused.value)
    assert len(ray_session.util.placement_group_table()) == placed
    assert not (tmp_path / "never").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can use CUDA")
def test_an_in_process_worker_without_cuda_says_what_to_change(digits, tmp_path):
    with pytest.raises(EngineError, match="set gpus_per_worker=0 to train on CPU"):
        fit(
            DigitsClassifier,
            hparams=HPARAMS,
            data=digits,
            config=TrainConfig(workers=1, epochs=1, gpus_per_worker=1),
            checkpoint_uri=str(tmp_path / "never"),
            in_process=True,
        )


_CLAIMS_GPUS = textwrap.dedent(
    """
    import sys

    import ray

    from ringflow.engine import DataSpec, EngineError, TrainConfig, fit
    from ringflow.models.digits import SCHEMA, DigitsClassifier

    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False,
             log_to_driver=False)
    try:
        fit(
            DigitsClassifier,
            hparams={"hidden": 8},
            data=DataSpec(dataset_url=sys.argv[1], schema=SCHEMA),
            config=TrainConfig(workers=2, epochs=1, gpus_per_worker=1, max_failures=0),
            checkpoint_uri=sys.argv[2],
        )
    except EngineError as err:
        print("REFUSED", err)
    finally:
        ray.shutdown()
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can use CUDA")
def test_workers_placed_on_gpus_they_cannot_use_say_so(digits, tmp_path):
    """A Ray cluster that declares GPUs (its own process: the session's has none) places
    the workers, whose torch cannot use CUDA here: the run fails naming the cause."""
    done = subprocess.run(
        [sys.executable, "-c", _CLAIMS_GPUS, digits.dataset_url, str(tmp_path / "never")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    refused = next(line for line in done.stdout.splitlines() if line.startswith("REFUSED"))
    assert "it failed to start" in refused
    assert "gpus_per_worker=1 but torch cannot use CUDA" in refused
    assert "set gpus_per_worker=0 to train on CPU" in refused


# ---------------------------------------------------------------------------- GPUs


@pytest.fixture(scope="module")
def gpu_ray():
    """Ray with 2 GPUs: the running instance (the session's finds the GPUs by itself) if it
    has them, else a private one of our own, shut down after this module."""
    import ray

    if ray.is_initialized():
        if ray.cluster_resources().get("GPU", 0) < 2:
            pytest.skip("the running Ray instance has fewer than 2 GPUs")
        yield ray
        return
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in state.items()}


def _fit(digits, tmp_path, **config) -> dict[str, torch.Tensor]:
    result = fit(
        DigitsClassifier,
        hparams=HPARAMS,
        data=digits,
        config=TrainConfig(workers=2, epochs=2, batch_size=64, seed=3, **config),
        checkpoint_uri=str(tmp_path / "_".join(f"{k}-{v}" for k, v in config.items())),
    )
    assert result.history[-1].metrics["train_loss"] < result.history[0].metrics["train_loss"]
    assert "val_loss" in result.metrics  # evaluated on the workers' device too
    return _cpu(result.state_dict)


@needs_2_gpus
def test_two_gpu_workers_train_as_native_and_as_on_cpu(gpu_ray, digits, tmp_path):
    # Small buckets: several NCCL all-reduces per step, started from inside backward.
    ring = _fit(digits, tmp_path, gpus_per_worker=1, collective="ring", bucket_mb=0.004)
    native = _fit(digits, tmp_path, gpus_per_worker=1, collective="native")
    cpu = _fit(digits, tmp_path, collective="ring", bucket_mb=0.004)
    assert relative_difference(ring, native) < 1e-5
    assert relative_difference(ring, cpu) < 1e-4
    assert relative_difference(native, cpu) < 1e-4
    initial = DigitsClassifier(**HPARAMS).state_dict()
    assert relative_difference(ring, initial) > 1e-2  # training really moved the weights


@needs_2_gpus
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_on_two_gpus_matches_one_gpu(precision, gpu_ray, digits, tmp_path):
    states = {}
    for workers in (1, 2):
        result = fit(
            DigitsClassifier,
            hparams=HPARAMS,
            data=digits,
            config=TrainConfig(
                workers=workers,
                epochs=2,
                batch_size=64,
                seed=3,
                gpus_per_worker=1,
                precision=precision,
            ),
            checkpoint_uri=str(tmp_path / f"{precision}-{workers}"),
        )
        states[workers] = _cpu(result.state_dict)
    assert relative_difference(states[2], states[1]) < 1e-2  # mixed-precision tolerance
    full = _fit(digits, tmp_path, gpus_per_worker=1)
    assert relative_difference(states[1], full) > 1e-5  # it did run in reduced precision


@needs_2_gpus
def test_a_16_mixed_run_resumed_mid_epoch_ends_bit_for_bit_scaler_included(
    gpu_ray, digits, tmp_path
):
    import shutil

    from ringflow.storage import CheckpointStore

    def run():
        return fit(
            DigitsClassifier,
            hparams=HPARAMS,
            data=digits,
            config=TrainConfig(
                workers=1,
                epochs=2,
                batch_size=64,
                seed=3,
                gpus_per_worker=1,
                precision="16-mixed",
                checkpoint_every=5,
            ),
            checkpoint_uri=str(tmp_path / "model"),
            store_url=str(tmp_path / "store"),
            run_key="cut",
        )

    whole = run()
    store = CheckpointStore(str(tmp_path / "store"))
    kept = store.checkpoints("cut")
    # Asynchronous saves that wait behind a newer one are replaced, so which mid-epoch steps
    # were committed depends on timing: resume from the newest mid-epoch one kept.
    mid = max((c for c in kept[:-1] if c.step % 23), key=lambda c: c.step)  # 23 steps an epoch
    assert mid.metadata["optimization"]["scaler"]["scale"] > 0
    for newer in (c for c in kept if c.step > mid.step):
        shutil.rmtree(tmp_path / "store" / "cut" / f"step-{newer.step:012d}")
    again = run()
    assert again.resumed_from == mid.step
    for name, tensor in _cpu(whole.state_dict).items():
        assert torch.equal(_cpu(again.state_dict)[name], tensor), name


@needs_2_gpus
def test_gpu_workers_get_a_gpu_each_and_commit_to_host_memory(gpu_ray, digits):
    """A commit's copies land while the next steps run; what it holds is the state at its step."""
    config = TrainConfig(
        workers=2, epochs=1, batch_size=64, seed=3, gpus_per_worker=1, ring_transport="symm"
    )
    # Wide: 58 MB of weights and AdamW state take a millisecond or more to copy, longer than
    # a step's forward and backward passes, so an optimizer step not waiting for the copies
    # would change weights they had not read yet.
    wide = {**HPARAMS, "hidden": 1 << 16}
    group = RayWorkerGroup(DigitsClassifier, hparams=wide, data=digits, config=config)
    try:
        where = group.call(Worker.device_info)
        assert sorted(w["device"] for w in where) == ["cuda:0", "cuda:1"]
        assert where[0]["bus"] != where[1]["bus"]  # a GPU each, not the same one
        assert [w["transport"] for w in where] == ["symm", "symm"]  # GPU shared memory
        group.call(Worker.train_steps, 0, 0, 3)
        at_commit = [_cpu(s) for s in group.call(Worker.state_dict)]
        assert all(torch.equal(at_commit[0][k], at_commit[1][k]) for k in at_commit[0])
        group.commit(3)
        group.call(Worker.train_steps, 0, 3, 2)  # at once, while the copies may still be landing
        commit = group.call_rank0(Worker.committed_state, 3)
        model, optimizer, *_ = commit
        tensors = [*model.values()]
        tensors += [v for s in optimizer["state"].values() for v in s.values()]
        assert len(tensors) > len(model)  # the optimizer has state by now
        assert all(t.device.type == "cpu" for t in tensors)
        assert all(torch.equal(model[k], at_commit[0][k]) for k in at_commit[0])
        group.call(Worker.rollback, 3)
        rolled_back = [_cpu(s) for s in group.call(Worker.state_dict)]
        assert all(torch.equal(s[k], at_commit[0][k]) for s in rolled_back for k in s)
        group.call(Worker.train_steps, 0, 3, 2)
        group.call(Worker.adopt, 3, commit)  # as a joining worker takes rank 0's commit
        adopted = [_cpu(s) for s in group.call(Worker.state_dict)]
        assert all(torch.equal(s[k], at_commit[0][k]) for s in adopted for k in s)
        group.call(Worker.train_steps, 0, 3, 2)  # and training goes on from there, on the GPUs
        # Committed and rolled back right after steps, and committed twice in a row.
        group.commit(5)
        group.commit(5)
        group.call(Worker.train_steps, 0, 5, 2)
        group.call(Worker.rollback, 5)
        again = [_cpu(s) for s in group.call(Worker.state_dict)]
        group.call(Worker.train_steps, 0, 5, 2)
        group.call(Worker.rollback, 5)
        assert all(torch.equal(s[k], again[0][k]) for s in group.call(Worker.state_dict) for k in s)
    finally:
        group.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_in_process_worker_trains_on_the_gpu(digits, tmp_path):
    def run(name: str, gpus: int) -> dict[str, torch.Tensor]:
        result = fit(
            DigitsClassifier,
            hparams=HPARAMS,
            data=digits,
            config=TrainConfig(workers=1, epochs=2, batch_size=64, seed=3, gpus_per_worker=gpus),
            checkpoint_uri=str(tmp_path / name),
            in_process=True,
        )
        return _cpu(result.state_dict)

    assert relative_difference(run("gpu", 1), run("cpu", 0)) < 1e-4


@pytest.fixture
def _pipes_by_value(gpu_ray):
    """Ship the test models to the stage actors by value: they need not import tests/."""
    from tests import test_pipeline, test_pipeline_ray

    modules = (test_pipeline, test_pipeline_ray)
    for module in modules:
        gpu_ray.cloudpickle.register_pickle_by_value(module)
    yield
    for module in modules:
        gpu_ray.cloudpickle.unregister_pickle_by_value(module)


@needs_2_gpus
@pytest.mark.usefixtures("_pipes_by_value")
@pytest.mark.parametrize(("stages", "replicas"), [(2, 1), (1, 2)], ids=["2-stages", "2-replicas"])
def test_pipeline_stages_train_on_a_gpu_each_as_on_cpu(digits, tmp_path, stages, replicas):
    """Two stages on two GPUs (activations over NCCL), or two one-stage replicas (gradients
    through the ring over an NCCL group of the run's world), end where the CPU does; a run
    resumed from its GPU checkpoint ends where the uninterrupted one does."""
    from ringflow.engine.pipeline import PipelineConfig
    from tests.test_pipeline_ray import DigitsPipe

    def run(name: str, *, gpus: int, epochs: int, store: str | None = None) -> dict:
        result = fit(
            DigitsPipe,
            hparams={},
            data=digits,
            config=TrainConfig(
                workers=replicas, epochs=epochs, batch_size=128, seed=5, gpus_per_worker=gpus
            ),
            pipeline=PipelineConfig(stages=stages, micro_batches=4, balance="params"),
            checkpoint_uri=str(tmp_path / name),
            store_url=store,
            run_key="gpu-pipe" if store else None,
        )
        assert {"train_loss", "val_loss", "val_accuracy"} <= set(result.metrics)
        return _cpu(result.state_dict)

    store = (tmp_path / "store").as_uri()
    gpu = run("gpu", gpus=1, epochs=3)
    assert relative_difference(gpu, run("cpu", gpus=0, epochs=3)) < 1e-4
    run("first-two", gpus=1, epochs=2, store=store)  # as if preempted after epoch 2
    resumed = run("resumed", gpus=1, epochs=3, store=store)
    assert all(torch.equal(resumed[k], gpu[k]) for k in gpu)
    assert relative_difference(gpu, DigitsPipe().state_dict()) > 1e-2
