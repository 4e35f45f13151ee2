"""The module's hooks run where Trainer runs them, in Trainer's order; what a module adds to
a checkpoint in ``on_save_checkpoint`` comes back to ``on_load_checkpoint`` when a run
resumes; a hook or callback ringflow does not call is named, not dropped in silence."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from ringflow.engine import ModelError, TrainConfig, fit
from tests.test_lightning_contract import BATCH, SEED, OneCycle, table, trained_by_trainer

HOOKS = (
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
)


def recording(name: str):
    def hook(self, *args, **kwargs):
        type(self).calls.append((name, self.current_epoch, self.global_step))
        return getattr(OneCycle, name)(self, *args, **kwargs)

    return hook


Recorded = type("Recorded", (OneCycle,), {"calls": [], **{name: recording(name) for name in HOOKS}})


def by_trainer_then_ringflow(cls, tmp_path, *, theirs=(), ours=()) -> None:
    """``cls`` trained for 2 epochs of 8 batches in windows of 2 by Trainer, then by ringflow
    on 1 worker, with the callbacks ``theirs`` and ``ours`` each."""
    data, hparams = table(), {"total_steps": 2 * 8}
    try:
        trained_by_trainer(
            cls, hparams, data, epochs=2, accumulate_grad_batches=2, callbacks=list(theirs)
        )
    finally:
        torch.use_deterministic_algorithms(False)
    trained = getattr(cls, "calls", None)
    if trained is not None:  # a Recorded module's: Trainer's calls, then ringflow's
        cls.trainers, cls.calls = trained, []
    fit(
        cls,
        hparams=hparams,
        data=data,
        config=TrainConfig(
            workers=1,
            epochs=2,
            batch_size=BATCH,
            seed=SEED,
            accumulate_grad_batches=2,
            commit_every=2,
        ),
        checkpoint_uri=str(tmp_path / "model"),
        in_process=True,
        callbacks=list(ours),
    )


def test_the_module_hooks_run_in_trainers_order_at_trainers_steps(tmp_path):
    by_trainer_then_ringflow(Recorded, tmp_path)
    assert Recorded.calls == Recorded.trainers


class Counting(OneCycle):
    """Counts the batches it saw; the count lives in the checkpoint, as JSON."""

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.seen, self.loaded = 0, None

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen += 1
        if self.seen == Counting.dies_after:
            raise RuntimeError("preempted")

    def on_save_checkpoint(self, checkpoint):
        checkpoint["seen"] = self.seen

    def on_load_checkpoint(self, checkpoint):
        self.loaded = checkpoint["seen"]
        self.seen = checkpoint["seen"]

    def on_train_end(self):
        Counting.ended_with = (self.loaded, self.seen)

    dies_after: int | None = None
    ended_with: tuple | None = None


def test_what_on_save_checkpoint_adds_comes_back_on_resume(tmp_path):
    def run():
        return fit(
            Counting,
            hparams={"total_steps": 2 * 8},
            data=table(),
            config=TrainConfig(
                workers=1, epochs=2, batch_size=BATCH, seed=SEED, checkpoint_every=4
            ),
            checkpoint_uri=str(tmp_path / "model"),
            in_process=True,
            store_url=str(tmp_path / "store"),
            run_key="counting",
        )

    Counting.dies_after = 6
    try:
        with pytest.raises(RuntimeError, match="preempted"):
            run()
    finally:
        Counting.dies_after = None
    assert run().resumed_from == 4
    assert Counting.ended_with == (4, 16)  # restored at 4 batches, then the 12 left


class Tensorish(OneCycle):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["cache"] = object()


def test_what_cannot_be_checkpointed_as_json_is_refused_by_name(tmp_path):
    with pytest.raises(ModelError, match="Tensorish.on_save_checkpoint adds is not JSON"):
        fit(
            Tensorish,
            hparams={"total_steps": 8},
            data=table(),
            config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED),
            checkpoint_uri=str(tmp_path / "model"),
            in_process=True,
            store_url=str(tmp_path / "store"),
            run_key="tensorish",
        )


class PerBatch(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


def test_a_callback_hook_ringflow_does_not_call_is_named(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ringflow.engine"):
        fit(
            OneCycle,
            hparams={"total_steps": 8},
            data=table(),
            config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED),
            checkpoint_uri=str(tmp_path / "model"),
            in_process=True,
            callbacks=[PerBatch()],
        )
    assert "callback PerBatch overrides on_train_batch_end, which ringflow does not call" in (
        caplog.text
    )


class OwnStep(OneCycle):
    def backward(self, loss, *args, **kwargs):
        super().backward(loss, *args, **kwargs)

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        pass


def test_a_module_hook_ringflow_does_not_call_is_named(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ringflow.engine"):
        fit(
            OwnStep,
            hparams={"total_steps": 8},
            data=table(),
            config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED),
            checkpoint_uri=str(tmp_path / "model"),
            in_process=True,
        )
    assert (
        "OwnStep overrides backward, on_validation_batch_end, which ringflow does not call"
        in caplog.text
    )


class Reads(L.Callback):
    """Reads at every epoch's end what callbacks commonly read of Trainer."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen.append(
            (
                trainer.current_epoch,
                trainer.global_step,
                trainer.num_training_batches,
                trainer.estimated_stepping_batches,
                trainer.accumulate_grad_batches,
                trainer.max_epochs,
                trainer.is_global_zero,
                trainer.state.fn.value,
                trainer.lightning_module is pl_module,
                trainer.should_stop,
            )
        )


def test_a_callback_reads_of_trainer_what_trainer_gives_it(tmp_path):
    """The driver's callbacks read the same view of Trainer a module reads in a worker: step
    counts, the run's length and state, the module."""
    theirs, ours = Reads(), Reads()
    by_trainer_then_ringflow(OneCycle, tmp_path, theirs=[theirs], ours=[ours])
    assert len(theirs.seen) == 2
    assert ours.seen == theirs.seen


def test_a_model_checkpoint_saving_within_epochs_is_refused_before_training(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    with pytest.raises(ModelError, match=r"ModelCheckpoint\(every_n_train_steps=4\) is not "):
        fit(
            OneCycle,
            hparams={"total_steps": 8},
            data=table(),
            config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED),
            checkpoint_uri=str(tmp_path / "model"),
            in_process=True,
            callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4)],
        )
    assert not (tmp_path / "ckpt").exists()
