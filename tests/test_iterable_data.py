"""An ``IterableDataset`` (a stream: WebDataset, a Hugging Face streaming dataset, litdata)
trains as under ``lightning.Trainer``: global batches are the stream's consecutive samples,
each worker takes its part of every batch, N workers train on the batches 1 worker sees,
and a run resumed mid-epoch reads the stream again up to where it stopped, bit for bit."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ringflow.engine import DatasetData, TrainConfig, fit
from ringflow.storage import CheckpointStore
from tests.support.fitting import KILLED_PEER_DEADLINE_S, one_thread, relative_difference
from tests.test_lightning_contract import FEATURES, OneCycle

BATCH, EPOCHS, SEED, SAMPLES = 16, 3, 7, 120
STEPS = EPOCHS * SAMPLES // BATCH + EPOCHS


def tensors(samples: int = SAMPLES, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


class Stream(IterableDataset):
    """Samples one at a time, as a streaming source gives them, with no ``__len__``."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self.x, self.y = tensors(samples)

    def order(self) -> torch.Tensor:
        return torch.arange(len(self.y))

    def __iter__(self):
        for i in self.order().tolist():
            yield self.x[i], self.y[i]


class ShuffledStream(Stream):
    """A stream in an order it draws from torch's generator at each pass, changed by
    ``set_epoch`` (as Hugging Face's and litdata's streams are)."""

    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        return torch.randperm(len(self.y)).roll(self.epoch)


class OneShot(IterableDataset):
    """A stream that can be read once: its ``__iter__`` returns itself."""

    def __init__(self) -> None:
        self.left = iter(range(SAMPLES))

    def __iter__(self):
        return self

    def __next__(self):
        i = next(self.left)
        return torch.zeros(FEATURES), torch.tensor(i % 3)


def data(stream: IterableDataset) -> DatasetData:
    return DatasetData(train=stream, validation=TensorDataset(*tensors(30, seed=1)))


def trained(stream, tmp_path, name: str, *, workers: int = 1, **config):
    return fit(
        OneCycle,
        hparams={"total_steps": STEPS},
        data=data(stream),
        config=TrainConfig(
            **{"workers": workers, "epochs": EPOCHS, "batch_size": BATCH, "seed": SEED, **config}
        ),
        checkpoint_uri=str(tmp_path / name),
        in_process=workers == 1,
    ).state_dict


def test_a_stream_trains_on_the_batches_trainer_takes_from_it(tmp_path):
    torch.manual_seed(SEED)
    module = OneCycle(total_steps=STEPS)
    with one_thread():  # as ringflow's worker: the same rounding
        L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=EPOCHS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        ).fit(module, DataLoader(Stream(), batch_size=BATCH))
    got = trained(Stream(), tmp_path, "stream")
    assert relative_difference(got, module.state_dict()) < 1e-6


@pytest.mark.ray
def test_two_workers_train_on_a_stream_as_one_does(tmp_path, ray_session):
    one = trained(ShuffledStream(), tmp_path, "one")
    two = trained(ShuffledStream(), tmp_path, "two", workers=2, cpus_per_worker=0.5)
    assert relative_difference(two, one) < 1e-5


@pytest.mark.ray
def test_a_worker_lost_mid_epoch_on_a_stream_rolls_back_by_position_bit_for_bit(
    tmp_path, ray_session
):
    """A worker SIGKILLed after the first epoch: the survivor rolls back to the last commit
    and reads the stream again up to that position, the replacement joins there, and the run
    ends with the uninterrupted run's weights, bit for bit."""
    import signal

    from tests.test_elastic import _strike

    config = {"workers": 2, "cpus_per_worker": 0.5, "collective_timeout_s": KILLED_PEER_DEADLINE_S}
    reference = trained(ShuffledStream(), tmp_path, "reference", **config)
    on_epoch, struck = _strike(signal.SIGKILL, after_epoch=0, delay_s=0.0)
    result = fit(
        OneCycle,
        hparams={"total_steps": STEPS},
        data=data(ShuffledStream()),
        config=TrainConfig(epochs=EPOCHS, batch_size=BATCH, seed=SEED, commit_every=2, **config),
        checkpoint_uri=str(tmp_path / "replaced"),
        on_epoch=on_epoch,
    )
    assert struck
    assert [e.kind for e in result.events] == ["lost", "rollback", "joined", "recovered"]
    for name, tensor in reference.items():
        assert torch.equal(result.state_dict[name], tensor), name


class Preempted(OneCycle):
    dies_at: int | None = None

    def training_step(self, batch, batch_idx):
        self.batches = getattr(self, "batches", 0) + 1
        if self.batches == type(self).dies_at:
            raise RuntimeError("preempted")
        return super().training_step(batch, batch_idx)


def test_a_run_on_a_stream_resumed_mid_epoch_ends_bit_for_bit(tmp_path):
    def run(run_key: str):
        return fit(
            Preempted,
            hparams={"total_steps": STEPS},
            data=data(ShuffledStream()),
            config=TrainConfig(
                workers=1, epochs=EPOCHS, batch_size=BATCH, seed=SEED, checkpoint_every=3
            ),
            checkpoint_uri=str(tmp_path / run_key),
            in_process=True,
            store_url=str(tmp_path / "store"),
            run_key=run_key,
        )

    whole = run("whole")
    Preempted.dies_at = 13  # after 12 steps, checkpointed: in the second epoch (of 8 steps)
    try:
        with pytest.raises(RuntimeError, match="preempted"):
            run("cut")
    finally:
        Preempted.dies_at = None
    assert CheckpointStore(str(tmp_path / "store")).latest("cut").step == 12
    again = run("cut")
    assert again.resumed_from == 12
    for name, tensor in whole.state_dict.items():
        assert torch.equal(again.state_dict[name], tensor), name


def test_the_stream_draws_from_a_generator_of_its_own(tmp_path):
    """Shuffled with torch's generator, the stream's order is a function of the run's seed
    and the epoch, so the training's own random numbers are not consumed by it."""
    first = trained(ShuffledStream(), tmp_path, "a")
    torch.manual_seed(1234)  # the caller's generator does not matter
    assert relative_difference(trained(ShuffledStream(), tmp_path, "b"), first) == 0
    shuffled_differently = trained(ShuffledStream(), tmp_path, "c", seed=SEED + 1)
    assert relative_difference(shuffled_differently, first) > 0


def test_a_stream_that_cannot_be_read_again_is_refused_before_training():
    with pytest.raises(ValueError, match="cannot be read again") as refused:
        data(OneShot())
    assert "\n" not in str(refused.value)


class StreamingData(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Stream(), batch_size=BATCH)

    def val_dataloader(self):
        return DataLoader(TensorDataset(*tensors(30, seed=1)), batch_size=BATCH)


def test_a_datamodules_streaming_loader_trains_as_the_stream_does(tmp_path):
    weights = fit(
        OneCycle,
        hparams={"total_steps": STEPS},
        data=StreamingData(),
        config=TrainConfig(workers=1, epochs=EPOCHS, batch_size=BATCH, seed=SEED),
        checkpoint_uri=str(tmp_path / "datamodule"),
        in_process=True,
    ).state_dict
    assert relative_difference(weights, trained(Stream(), tmp_path, "stream")) == 0
