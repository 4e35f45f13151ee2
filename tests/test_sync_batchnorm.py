"""``sync_batchnorm=True``, as Lightning's Trainer takes it: BatchNorm layers normalise with the
statistics of the whole global batch, summed over the workers, so several workers end at the
weights (running statistics included) of Trainer on one process with the whole batch; without
it each worker's part has its own statistics, and they do not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringflow.engine import ModelError, TrainConfig, fit
from ringflow.engine.pipeline.config import PipelineConfig
from ringflow.engine.trainer import check_layout
from tests.support.fitting import relative_difference
from tests.test_lightning_contract import (
    BATCH,
    CLASSES,
    EPOCHS,
    FEATURES,
    SEED,
    STEPS,
    OneCycle,
    deterministic_off,  # noqa: F401 (a fixture)
    table,
    under_ringflow,
    under_trainer,
)


class Normalised(OneCycle):
    """A hidden layer normalised by ``BatchNorm1d`` (running statistics, an affine map); no
    bias before it, which BatchNorm would cancel (its gradient only rounding noise that Adam
    would turn into steps)."""

    def __init__(self, *, total_steps: int, max_lr: float = 0.05) -> None:
        super().__init__(total_steps=total_steps, max_lr=max_lr)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 32, bias=False),
            nn.BatchNorm1d(32),
            nn.Tanh(),
            nn.Linear(32, CLASSES),
        )


@pytest.fixture(scope="module")
def data():
    return table()


@pytest.mark.ray
@pytest.mark.usefixtures("deterministic_off")
@pytest.mark.parametrize("workers", [2, 3])  # 3: parts of 6, 5 and 5 samples
def test_workers_with_sync_batchnorm_end_with_trainers_weights_on_the_whole_batch(
    workers, data, tmp_path, ray_session
):
    hparams = {"total_steps": STEPS}
    expected = under_trainer(Normalised, hparams, data)
    options = {"workers": workers, "cpus_per_worker": 0.5}
    synced = under_ringflow(
        Normalised, hparams, data, tmp_path / "synced", sync_batchnorm=True, **options
    )
    assert relative_difference(synced, expected) < 1e-5
    apart = under_ringflow(Normalised, hparams, data, tmp_path / "apart", **options)
    assert relative_difference(apart, expected) > 1e-3  # each part's own statistics


@pytest.mark.ray
def test_a_last_batch_that_leaves_a_synchronised_worker_nothing_is_refused(
    data, tmp_path, ray_session
):
    with pytest.raises(ModelError, match=r"sync_batchnorm.*last batch \(1 samples\)"):
        fit(
            Normalised,
            hparams={"total_steps": STEPS},
            data=data,
            config=TrainConfig(
                workers=2, epochs=EPOCHS, batch_size=17, seed=SEED, sync_batchnorm=True
            ),
            checkpoint_uri=str(tmp_path / "model"),
        )


def test_one_worker_with_sync_batchnorm_trains_as_without(data, tmp_path):
    hparams = {"total_steps": STEPS}
    plain = under_ringflow(Normalised, hparams, data, tmp_path / "plain")
    synced = under_ringflow(Normalised, hparams, data, tmp_path / "synced", sync_batchnorm=True)
    assert relative_difference(synced, plain) == 0


def test_pipeline_stages_refuse_sync_batchnorm_before_anything_starts():
    config = TrainConfig(workers=2, batch_size=BATCH, sync_batchnorm=True)
    with pytest.raises(ValueError, match=r"sync_batchnorm=True \(a stage's BatchNorm"):
        check_layout(config, PipelineConfig(stages=2))


def test_sync_batchnorm_takes_only_true_or_false():
    with pytest.raises(ValueError, match="sync_batchnorm must be True or False, got 'yes'"):
        TrainConfig(sync_batchnorm="yes")


def test_a_converted_layer_keeps_its_parameters_and_buffers():
    """The optimizer's parameters and the checkpoint's names are the BatchNorm's own."""
    from ringflow.engine.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

    module = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.BatchNorm2d(3)))
    before = dict(module.named_parameters()), module.state_dict(keep_vars=True)
    converted = convert_sync_batchnorm(module)
    assert isinstance(converted[1][0], SyncBatchNorm)
    assert all(p is before[0][n] for n, p in converted.named_parameters())
    assert all(t is before[1][n] for n, t in converted.state_dict(keep_vars=True).items())
    with torch.no_grad():  # no collective: plain BatchNorm
        out = converted[1](torch.randn(4, 3, 2, 2))
    assert out.shape == (4, 3, 2, 2)
