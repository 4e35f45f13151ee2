"""PowerSGD (``compression="powersgd"``): rank-r factors on the wire, error feedback, and its
state kept by commits and checkpoints, so rollback and resume stay exact."""

from __future__ import annotations

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.engine.collective import GradientBuckets
from ringflow.engine.collective.powersgd import PowerSGDState, powersgd_hook
from ringflow.models.digits import DigitsClassifier
from tests.test_collective_buckets import _RecordingCollective

HPARAMS = {"hidden": 64, "lr": 0.01}
POWERSGD = {"compression": "powersgd", "powersgd_rank": 2, "powersgd_warmup_steps": 3}


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40))


def _gradients(model, buckets, seed):
    model.zero_grad(set_to_none=True)
    buckets.start(average=True)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    exact = [p.grad.clone() for p in model.parameters()]  # the bucket views, before the sums
    buckets.finish()
    return exact, [p.grad.clone() for p in model.parameters()]


def test_after_the_warm_up_matrices_travel_as_rank_r_factors_and_the_error_is_kept():
    model = _mlp()
    state = PowerSGDState(0, 1, matrix_rank=2, warmup_steps=1)
    collective = _RecordingCollective(model)
    buckets = GradientBuckets(
        list(model.parameters()), collective, comm_hook=(powersgd_hook, state, "powersgd")
    )
    exact, reduced = _gradients(model, buckets, seed=1)  # the warm-up step: whole
    assert all(torch.equal(a, b) for a, b in zip(exact, reduced, strict=True))
    whole = sum(p.numel() for p in model.parameters())
    assert collective.calls[-1][0] == whole
    exact, reduced = _gradients(model, buckets, seed=2)
    # One bucket: P factors and the biases in one all-reduce, then the Q factors.
    p_and_biases = 48 * 2 + 40 * 2 + 48 + 40
    assert [n for n, _ in collective.calls[1:]] == [p_and_biases, 32 * 2 + 48 * 2]
    weight_in, bias_in, weight_out, bias_out = reduced
    assert torch.linalg.matrix_rank(weight_in).item() <= 2
    assert torch.linalg.matrix_rank(weight_out).item() <= 2
    assert torch.equal(bias_in, exact[1])  # vectors travel whole
    assert torch.equal(bias_out, exact[3])
    # What the approximation left out waits in the error, to be added to the next gradient.
    pairs = reversed(list(zip(exact, reduced, strict=True)))  # the bucket: last layer first
    flat = torch.cat([(e - r).flatten() for e, r in pairs])
    error = state.errors[0]
    assert torch.allclose(error, flat, atol=1e-6)
    assert error.abs().sum() > 0
    assert state.steps == 2
    assert state.sent_bytes < 2 * whole * 4


def test_its_state_round_trips_through_state_dict():
    model = _mlp()
    state = PowerSGDState(0, 1, matrix_rank=2, warmup_steps=0)
    buckets = GradientBuckets(
        list(model.parameters()), _RecordingCollective(model), comm_hook=(powersgd_hook, state, "p")
    )
    _gradients(model, buckets, seed=3)
    saved = state.state_dict()
    again = PowerSGDState(0, 1, matrix_rank=2, warmup_steps=0)
    again.load_state_dict(saved)
    assert again.state_dict().keys() == saved.keys()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in saved.items())
    again.reset_errors()
    assert not any(k.startswith("error/") for k in again.state_dict())


def test_bad_powersgd_settings_fail_before_training():
    with pytest.raises(ValueError, match="powersgd_rank"):
        TrainConfig(compression="powersgd", powersgd_rank=0)
    with pytest.raises(ValueError, match="powersgd_warmup_steps"):
        TrainConfig(compression="powersgd", powersgd_warmup_steps=-1)


def test_a_rollback_restores_the_error_and_factors_bit_for_bit(digits):
    from ringflow.engine.data_parallel import WholeModel
    from ringflow.engine.worker import Worker

    config = TrainConfig(workers=1, epochs=1, batch_size=64, seed=0, **POWERSGD)
    worker = Worker(
        DigitsClassifier, hparams=HPARAMS, data=digits, config=config, rank=0, plan=WholeModel()
    )
    worker.connect()

    def state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        weights = {k: v.detach().clone() for k, v in worker.module.state_dict().items()}
        return weights, worker.comm_state()

    def same(a, b) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    worker.train_steps(0, 0, 5, 5)  # past the warm-up: the error and factors are in use
    at_5 = state()
    assert any(k.startswith("error/") for k in at_5[1])
    worker.train_steps(0, 5, 4, 9)
    at_9 = state()
    assert not same(at_5[1], at_9[1])
    worker.rollback(5)
    assert same(state()[0], at_5[0])
    assert same(state()[1], at_5[1])
    worker.train_steps(0, 5, 4, 9)
    assert same(state()[0], at_9[0])
    assert same(state()[1], at_9[1])
    worker.close()


def _fit(digits, tmp_path, name, *, workers, epochs, **kw):
    return fit(
        DigitsClassifier,
        hparams=HPARAMS,
        data=digits,
        config=TrainConfig(
            workers=workers,
            epochs=epochs,
            batch_size=64,
            seed=2,
            cpus_per_worker=0.5,
            checkpoint_every=10,
            **POWERSGD,
        ),
        checkpoint_uri=str(tmp_path / name),
        in_process=workers == 1,
        **kw,
    )


def _assert_equal(result, reference):
    for name, tensor in reference.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name


def test_a_resumed_run_goes_on_with_its_error_and_factors(digits, tmp_path):
    reference = _fit(digits, tmp_path, "reference", workers=1, epochs=3)
    store = str(tmp_path / "store")
    _fit(digits, tmp_path, "first", workers=1, epochs=2, store_url=store, run_key="p")
    resumed = _fit(digits, tmp_path, "resumed", workers=1, epochs=3, store_url=store, run_key="p")
    assert resumed.resumed_from == 46
    _assert_equal(resumed, reference)
    assert reference.metrics["val_accuracy"] > 0.85  # it trains


@pytest.mark.ray
def test_each_ray_worker_resumes_with_its_own_error(ray_session, digits, tmp_path):
    reference = _fit(digits, tmp_path, "reference", workers=2, epochs=3)
    store = str(tmp_path / "store")
    _fit(digits, tmp_path, "first", workers=2, epochs=2, store_url=store, run_key="p")
    resumed = _fit(digits, tmp_path, "resumed", workers=2, epochs=3, store_url=store, run_key="p")
    assert resumed.resumed_from == 46
    _assert_equal(resumed, reference)
    # On one worker the errors of two do not apply: it goes on without, and trains.
    one = _fit(digits, tmp_path, "one", workers=1, epochs=4, store_url=store, run_key="p")
    assert one.resumed_from == 69
    assert one.metrics["val_accuracy"] > 0.85
