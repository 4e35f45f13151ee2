"""What a module logs reaches Lightning's loggers as under ``lightning.Trainer``: the same
names (``loss_step``, ``loss_epoch``), steps and values, reduced over the batches of an epoch
and the workers of a global batch as one process reduces them; the module's hooks run where
Trainer runs them."""

from __future__ import annotations

import csv

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from ringflow.engine import TrainConfig, fit
from tests.test_lightning_contract import (
    BATCH,
    CLASSES,
    EPOCHS,
    SEED,
    STEPS,
    OneCycle,
    table,
    trained_by_trainer,
)

EVERY = 5  # log_every_n_steps: step rows at global steps 4, 9, 14 and 19


class Logs(OneCycle):
    """Logs with every option Trainer reduces differently, from a step and from hooks, and
    torchmetrics objects."""

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.train_acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.val_f1 = MulticlassF1Score(num_classes=CLASSES, average="macro")
        self.train_loss = MeanMetric()  # updated with the loss itself, its graph included

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.train_loss(loss)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True)
        self.log("correct", (logits.argmax(1) == y).sum().float(), on_epoch=True, reduce_fx="sum")
        worst = F.cross_entropy(logits, y, reduction="none").max()
        self.log_dict({"worst": worst}, on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean())
        self.log("val_both", F.cross_entropy(logits, y), on_step=True, on_epoch=True)
        confidence = logits.softmax(1).max(1).values.mean()  # a mean over the samples
        self.log("val_each", confidence, on_step=True, on_epoch=False)
        self.val_f1.update(logits, y)
        self.log("val_f1", self.val_f1)

    def on_train_epoch_start(self):
        self.log("epoch_seen", float(self.current_epoch))

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.stack(grads).norm(), on_epoch=True)

    def on_train_epoch_end(self):
        self.log("global_step_seen", float(self.global_step))

    def on_validation_epoch_end(self):
        self.log("val_seen", float(self.current_epoch) + 0.5)


@pytest.fixture(scope="module")
def data():
    return table()


def rows(path) -> list[dict[str, float]]:
    """metrics.csv as Lightning's CSVLogger wrote it: one dict per row, empty cells dropped."""
    with open(path, newline="") as file:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(file)]


def same_rows(ours: list[dict], theirs: list[dict], tolerance: float) -> None:
    assert [sorted(row) for row in ours] == [sorted(row) for row in theirs]
    for mine, oracle in zip(ours, theirs, strict=True):
        for name, value in oracle.items():
            assert mine[name] == pytest.approx(value, rel=tolerance, abs=tolerance), name


def logged_by_ringflow(data, tmp_path, *, workers: int) -> list[dict]:
    logger = CSVLogger(str(tmp_path / f"ringflow-{workers}"), name="run", version=0)
    fit(
        Logs,
        hparams={"total_steps": STEPS},
        data=data,
        config=TrainConfig(
            workers=workers,
            epochs=EPOCHS,
            batch_size=BATCH,
            seed=SEED,
            gradient_clip_val=0.5,
            log_every_n_steps=EVERY,
        ),
        checkpoint_uri=str(tmp_path / f"model-{workers}"),
        in_process=workers == 1,
        loggers=[logger],
        callbacks=[LearningRateMonitor(log_momentum=True)],
    )
    return rows(tmp_path / f"ringflow-{workers}" / "run" / "version_0" / "metrics.csv")


@pytest.fixture(scope="module")
def trainers_run(data, tmp_path_factory):
    """Where Trainer's CSVLogger wrote (``run/version_0``)."""
    root = tmp_path_factory.mktemp("trainer")
    logger = CSVLogger(str(root), name="run", version=0)
    try:
        trained_by_trainer(
            Logs,
            {"total_steps": STEPS},
            data,
            logger=logger,
            log_every_n_steps=EVERY,
            gradient_clip_val=0.5,
            callbacks=[LearningRateMonitor(log_momentum=True)],
        )
    finally:
        torch.use_deterministic_algorithms(False)
    return root / "run" / "version_0"


@pytest.fixture(scope="module")
def trainers_rows(trainers_run) -> list[dict]:
    return rows(trainers_run / "metrics.csv")


def test_the_csv_logger_gets_trainers_names_steps_and_values(
    data, trainers_run, trainers_rows, tmp_path
):
    names = set().union(*trainers_rows)
    assert {"loss_step", "loss_epoch", "correct_epoch", "worst", "grad_norm_step"} <= names
    assert {"val_loss", "val_acc", "epoch_seen", "global_step_seen", "val_seen"} <= names
    assert {"val_both_step", "val_both_epoch", "val_each"} <= names
    assert {"train_acc_step", "train_acc_epoch", "val_f1", "lr-AdamW", "lr-AdamW-momentum"} <= names
    assert {"train/loss_step", "train/loss_epoch"} <= names
    same_rows(logged_by_ringflow(data, tmp_path, workers=1), trainers_rows, 1e-6)
    # the hyperparameters the module saved, as Trainer writes them
    ours = (tmp_path / "ringflow-1" / "run" / "version_0" / "hparams.yaml").read_text()
    assert ours == (trainers_run / "hparams.yaml").read_text()
    assert "max_lr: 0.05" in ours  # a default the module saved, not given to fit


def test_two_workers_log_what_one_process_logs(data, trainers_rows, tmp_path, ray_session):
    same_rows(logged_by_ringflow(data, tmp_path, workers=2), trainers_rows, 1e-5)


def scalars(directory) -> dict[tuple[str, int], float]:
    """Every scalar in a TensorBoard event file: (tag, step) to value."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    found = {}
    for path in directory.rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):  # TFRecord: length, its CRC, the record, its CRC
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 16 + length
            for value in event.summary.value:
                found[(value.tag, event.step)] = value.simple_value
    return found


def test_the_tensorboard_logger_gets_what_trainer_gives_it(data, trainers_rows, tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    fit(
        Logs,
        hparams={"total_steps": STEPS},
        data=data,
        config=TrainConfig(
            workers=1,
            epochs=EPOCHS,
            batch_size=BATCH,
            seed=SEED,
            gradient_clip_val=0.5,
            log_every_n_steps=EVERY,
        ),
        checkpoint_uri=str(tmp_path / "model"),
        in_process=True,
        loggers=[TensorBoardLogger(str(tmp_path / "tb"), name="run", version=0)],
    )
    wanted = {
        (name, int(row["step"])): value
        for row in trainers_rows
        for name, value in row.items()
        if name != "step" and not name.startswith("lr-")
    }
    got = scalars(tmp_path / "tb")
    hparams = {key for key in got if key[0] == "hp_metric" or key[0].startswith("_hparams_")}
    assert hparams  # log_hyperparams, as Trainer calls it
    got = {key: value for key, value in got.items() if key not in hparams}
    assert got.keys() == wanted.keys()
    for key, value in wanted.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def test_a_metric_state_taken_mid_epoch_survives_the_checkpoint_as_json():
    import json

    from ringflow.engine.metrics import Logged

    def accuracy(preds, target) -> MulticlassAccuracy:
        metric = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        metric.update(torch.tensor(preds), torch.tensor(target))
        return metric

    options = {"acc": {"on_step": False, "on_epoch": True}}
    before = Logged(metrics={"acc": accuracy([0, 1, 2], [0, 1, 1])}, options=options)
    stored = json.loads(json.dumps(before.to_json()))  # what the checkpoint's metadata holds
    after = Logged(metrics={"acc": accuracy([2, 0], [2, 1])}, options=options)
    resumed = Logged.from_json(stored).merge(after)
    whole = accuracy([0, 1, 2, 2, 0], [0, 1, 1, 2, 1]).compute()
    assert resumed.results()["acc"] == pytest.approx(float(whole))  # 3 of 5
