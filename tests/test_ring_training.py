"""Data-parallel training through our ring ends where training through the native one does."""

from __future__ import annotations

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.models.digits import DigitsClassifier
from tests.conftest import relative_difference


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
