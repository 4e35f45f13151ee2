"""Data-parallel training through our ring ends where training through the native one does."""

from __future__ import annotations

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import relative_difference


def _train(digits, tmp_path, **config) -> dict[str, torch.Tensor]:
    result = fit(
        DigitsClassifier,
        hparams={"hidden": 32, "lr": 0.01},
        data=digits,
        config=TrainConfig(workers=2, epochs=1, batch_size=64, seed=3, **config),
        checkpoint_uri=str(tmp_path / "_".join(f"{k}-{v}" for k, v in config.items())),
    )
    return result.state_dict


@pytest.mark.ray
def test_ring_training_ends_with_the_weights_of_native_training(ray_session, digits, tmp_path):
    assert TrainConfig().collective == "ring"
    native = _train(digits, tmp_path, collective="native")
    # Small buckets: several all-reduces per step, started from inside backward.
    ring = _train(digits, tmp_path, collective="ring", bucket_mb=0.004)
    assert relative_difference(ring, native) < 1e-5
    initial = DigitsClassifier(hidden=32).state_dict()
    assert relative_difference(native, initial) > 1e-2  # training really moved the weights


class _HookedDigits(DigitsClassifier):
    """Reads every gradient before the step (as a user's clipping or logging would): its
    workers step the optimizer once, after every bucket is reduced."""

    def on_after_backward(self) -> None:
        return None


@pytest.mark.ray
def test_stepping_while_the_last_bucket_reduces_ends_bit_for_bit_as_one_step(
    ray_session, digits, tmp_path
):
    """With several buckets, the parameters whose sums are in step while the last bucket's
    all-reduce runs, then the rest: the same weights, bit for bit, as one step after all."""
    # 1 KiB buckets: the output layer's, then the hidden layer's (reduced last).
    config = TrainConfig(workers=2, epochs=1, batch_size=64, seed=3, bucket_mb=0.001)
    runs = {
        module.__name__: fit(
            module,
            hparams={"hidden": 32, "lr": 0.01},
            data=digits,
            config=config,
            checkpoint_uri=str(tmp_path / module.__name__),
        ).state_dict
        for module in (DigitsClassifier, _HookedDigits)
    }
    two, one = runs["DigitsClassifier"], runs["_HookedDigits"]
    assert all(torch.equal(two[k], one[k]) for k in one)
