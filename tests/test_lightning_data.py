"""A module fed by a ``LightningDataModule`` of sequences (not a table) trains under ringflow
as under ``lightning.Trainer``: ``prepare_data`` once, ``setup`` in every worker, the loaders'
datasets and collate functions; N workers see the global batches 1 worker sees, and a run
resumed mid-epoch continues on the same sample."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from ringflow.engine import DatasetData, TrainConfig, fit
from ringflow.storage import CheckpointStore
from tests.support.fitting import relative_difference
from tests.test_lightning_contract import EpochOrder, under_trainer

BATCH, EPOCHS, SEED, VOCAB, CLASSES = 12, 2, 3, 20, 3


class Sequences(Dataset):
    """Token sequences of 3 to 11 tokens; the class is the most frequent token's residue."""

    def __init__(self, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 12, (count,), generator=g)
        self.items = [torch.randint(0, VOCAB, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        tokens = self.items[index]
        return {"tokens": tokens, "label": int(torch.bincount(tokens).argmax()) % CLASSES}


def pad(items: list[dict]) -> dict:
    """Pads a batch of sequences to its longest; keeps the lengths."""
    lengths = torch.tensor([len(item["tokens"]) for item in items])
    tokens = torch.zeros(len(items), int(lengths.max()), dtype=torch.long)
    for row, item in enumerate(items):
        tokens[row, : len(item["tokens"])] = item["tokens"]
    return {
        "tokens": tokens,
        "lengths": lengths,
        "label": torch.tensor([i["label"] for i in items]),
    }


class SequenceData(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.prepared = 0

    def prepare_data(self) -> None:
        self.prepared += 1

    def setup(self, stage: str) -> None:
        self.train, self.val = Sequences(90, seed=1), Sequences(30, seed=2)

    def train_dataloader(self):  # ringflow's order, so Trainer sees ringflow's batches
        sampler = EpochOrder(len(self.train), SEED)
        return DataLoader(self.train, batch_size=BATCH, sampler=sampler, collate_fn=pad)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=BATCH, collate_fn=pad)


class Recurrent(L.LightningModule):
    """Embedding, GRU, the hidden state at each sequence's last token, a linear head."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.gru = nn.GRU(8, hidden, batch_first=True)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, batch: dict) -> torch.Tensor:
        states, _ = self.gru(self.embed(batch["tokens"]))
        last = states[torch.arange(len(states)), batch["lengths"] - 1]
        return self.head(last)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch), batch["label"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch), batch["label"]))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02)


def config(workers: int, **options) -> TrainConfig:
    return TrainConfig(workers=workers, epochs=EPOCHS, batch_size=BATCH, seed=SEED, **options)


def trained(tmp_path, data, *, workers: int = 1, **options) -> dict[str, torch.Tensor]:
    return fit(
        Recurrent,
        hparams={},
        data=data,
        config=config(workers, **options),
        checkpoint_uri=str(tmp_path / f"model-{workers}"),
        in_process=workers == 1,
    ).state_dict


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory) -> dict[str, torch.Tensor]:
    return trained(tmp_path_factory.mktemp("one"), SequenceData())


def test_a_datamodule_of_sequences_trains_as_under_trainer(one_worker):
    datamodule = SequenceData()
    oracle = under_trainer(Recurrent, {}, datamodule, seed=SEED, epochs=EPOCHS)
    assert relative_difference(one_worker, oracle) < 1e-5


def test_prepare_data_runs_once_in_the_driver(tmp_path):
    datamodule = SequenceData()
    trained(tmp_path, datamodule)
    assert datamodule.prepared == 1


@pytest.mark.parametrize("workers", [2, 3])
def test_n_workers_end_with_one_workers_weights(workers, one_worker, tmp_path, ray_session):
    weights = trained(tmp_path, SequenceData(), workers=workers, cpus_per_worker=0.5)
    assert relative_difference(weights, one_worker) < 1e-5


def test_map_style_datasets_train_as_the_datamodule_does(one_worker, tmp_path):
    data = DatasetData(
        train=Sequences(90, seed=1), validation=Sequences(30, seed=2), collate_fn=pad
    )
    assert relative_difference(trained(tmp_path, data), one_worker) == 0


class Preempted(Recurrent):
    dies_at: int | None = None  # the global step a run is killed at

    def training_step(self, batch, batch_idx):
        if self.global_step == Preempted.dies_at:
            raise RuntimeError("preempted")
        return super().training_step(batch, batch_idx)


def test_a_run_resumed_mid_epoch_continues_on_the_same_sample(one_worker, tmp_path):
    """Killed after the checkpoint of step 4 of 8 (mid-epoch 0), resumed: bit for bit."""

    def run():
        return fit(
            Preempted,
            hparams={},
            data=SequenceData(),
            config=config(1, checkpoint_every=4),
            checkpoint_uri=str(tmp_path / "model"),
            in_process=True,
            store_url=str(tmp_path / "store"),
            run_key="sequences",
        )

    Preempted.dies_at = 6
    try:
        with pytest.raises(RuntimeError, match="preempted"):
            run()
    finally:
        Preempted.dies_at = None
    assert CheckpointStore(str(tmp_path / "store")).latest("sequences").step == 4
    resumed = run()
    assert resumed.resumed_from == 4
    assert relative_difference(resumed.state_dict, one_worker) == 0
