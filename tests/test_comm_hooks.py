"""Communication hooks: a user's own function reduces each gradient bucket
(``engine.collective.register_comm_hook``, chosen by ``TrainConfig.compression``)."""

from __future__ import annotations

import pytest
import torch

from ringflow.engine import EngineError, ModelError, TrainConfig, fit
from ringflow.engine.collective import GradientBuckets, allreduce_hook, register_comm_hook
from ringflow.engine.pipeline import PipelineConfig
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import relative_difference
from tests.test_collective_buckets import _backward, _model, _RecordingCollective


class _HalfState:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


@register_comm_hook("test_halved", state=_HalfState)
def halved(state: _HalfState, bucket):
    """Each rank's share halved before it is reduced: the mean is halved only where every
    rank's hook ran (one rank's alone would leave 3/4 of it)."""
    collective = bucket.collective
    if (state.rank, state.world_size) != (collective.rank, collective.world_size):
        raise RuntimeError(f"state of rank {state.rank} of {state.world_size} on {collective}")
    bucket.buffer.mul_(0.5)
    return collective.allreduce_async_(bucket.buffer, op=bucket.op)


@register_comm_hook("test_wrong_shape")
def wrong_shape(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer[:1].clone())
    return future


class SGDDigits(DigitsClassifier):
    """SGD: a halved gradient is the same step as a halved learning rate."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


# ---------------------------------------------------------------------------- the interface


def test_a_hook_is_called_per_bucket_in_order_and_its_result_lands_in_the_gradients():
    model = _model()
    collective = _RecordingCollective(model)
    seen = []

    def hook(state, bucket):
        seen.append(
            (
                state,
                bucket.index,
                bucket.buffer.numel(),
                [tuple(g.shape) for g in bucket.gradients()],
            )
        )
        future = torch.futures.Future()
        future.set_result(torch.full_like(bucket.buffer, float(bucket.index + 1)))
        return future

    params = list(model.parameters())
    buckets = GradientBuckets(
        params, collective, bucket_bytes=300 * 4, comm_hook=(hook, "s", "mine")
    )
    _backward(model, buckets)
    assert [(s, i, n) for s, i, n, _ in seen] == [("s", 0, 340), ("s", 1, 144)]
    assert seen[0][3] == [(4,), (4, 16), (16,), (16, 16)]  # last layers first, as reduced
    assert collective.calls == []  # the hook reduced them, not the engine
    assert all(torch.equal(p.grad, torch.full_like(p, 1.0)) for p in params[2:])
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in params[:2])


def test_the_built_in_all_reduce_is_a_hook_of_the_same_interface():
    def run(comm_hook):
        model = _model()
        buckets = GradientBuckets(
            list(model.parameters()), _RecordingCollective(model, copies=3), comm_hook=comm_hook
        )
        _backward(model, buckets)
        return [p.grad.clone() for p in model.parameters()]

    plain, hooked = run(None), run((allreduce_hook, None, "allreduce"))
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked, strict=True))


def test_an_unknown_or_reserved_hook_name_fails_before_training():
    with pytest.raises(ValueError, match="'powersgd' or a registered communication hook"):
        TrainConfig(compression="powerful")
    with pytest.raises(ValueError, match="built-in"):
        register_comm_hook("bf16")(halved)
    with pytest.raises(ValueError, match="already registered"):
        register_comm_hook("test_halved")(wrong_shape)
    assert TrainConfig(compression="test_halved").compression == "test_halved"


# ---------------------------------------------------------------------------- in training


def _fit(digits, tmp_path, name, *, workers=1, lr=0.1, **config):
    return fit(
        SGDDigits,
        hparams={"hidden": 32, "lr": lr},
        data=digits,
        config=TrainConfig(
            workers=workers, epochs=2, batch_size=64, seed=1, cpus_per_worker=0.5, **config
        ),
        checkpoint_uri=str(tmp_path / name),
        in_process=workers == 1,
    )


def test_a_users_hook_trains_with_the_bucket_it_returns(digits, tmp_path):
    halved_run = _fit(digits, tmp_path, "halved", compression="test_halved")
    half_lr = _fit(digits, tmp_path, "half-lr", lr=0.05)
    plain = _fit(digits, tmp_path, "plain")
    assert relative_difference(halved_run.state_dict, half_lr.state_dict) < 1e-5
    assert relative_difference(halved_run.state_dict, plain.state_dict) > 1e-2


def test_a_hook_that_returns_another_shape_fails_the_run_naming_it(digits, tmp_path):
    with pytest.raises((ModelError, EngineError), match="test_wrong_shape"):
        _fit(digits, tmp_path, "wrong", compression="test_wrong_shape")


def test_pipeline_stages_refuse_a_hook_before_training(digits, tmp_path):
    with pytest.raises(ValueError, match="communication hook"):
        fit(
            SGDDigits,
            hparams={"hidden": 32, "lr": 0.1},
            data=digits,
            config=TrainConfig(workers=1, epochs=1, compression="test_halved"),
            checkpoint_uri=str(tmp_path / "p"),
            in_process=True,
            pipeline=PipelineConfig(stages=2),
        )


@pytest.mark.ray
def test_every_ray_worker_calls_the_hook_its_model_module_registers(ray_session, digits, tmp_path):
    # The workers import this module with the model: the hook is registered there too.
    result = _fit(digits, tmp_path, "two", workers=2, compression="test_halved")
    reference = _fit(digits, tmp_path, "two-half-lr", workers=2, lr=0.05)
    assert relative_difference(result.state_dict, reference.state_dict) < 1e-5
