"""A module behaves under ringflow as under ``lightning.Trainer``: its optimizer and schedulers
(step- and epoch-interval, ``ReduceLROnPlateau`` on a validation metric) and gradient
clipping. The oracle is Trainer itself, on the same module, seed and batch order."""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Sampler, TensorDataset

from ringflow.engine import ModelError, TensorData, TrainConfig, fit
from ringflow.engine.module import Optimization
from ringflow.storage import CheckpointStore
from tests.support.fitting import one_thread, relative_difference

FEATURES, CLASSES, BATCH, EPOCHS, SEED = 8, 3, 16, 3, 7


class OneCycle(L.LightningModule):
    """AdamW with a OneCycleLR stepped every batch (Lightning's ``interval="step"``)."""

    def __init__(self, *, total_steps: int, max_lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.max_lr)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.max_lr, total_steps=self.hparams.total_steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Plateau(OneCycle):
    """SGD halved by ReduceLROnPlateau whenever the validation loss does not improve enough."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, factor=0.5, patience=0, threshold=0.05
        )
        return {"optimizer": optimizer, "lr_scheduler": plateau, "monitor": "val_loss"}


class WithoutIndex(OneCycle):
    """``training_step(self, batch)``, as in Lightning's GAN example."""

    def training_step(self, batch):
        return super().training_step(batch, 0)


class SkipsEveryThird(OneCycle):
    """Returns ``None`` at every third batch: Trainer skips its backward and its update."""

    def training_step(self, batch, batch_idx):
        if batch_idx % 3 == 2:
            return None
        return super().training_step(batch, batch_idx)


class SkipsOutliers(OneCycle):
    """Returns ``None`` where its batch holds an outlier: with several workers, only some
    workers' shares do, and the batch is skipped on every worker."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        if (x[:, 0] > 1.8).any():
            return None
        return super().training_step(batch, batch_idx)


class WarmsUp(OneCycle):
    """A learning-rate warm-up in its own ``optimizer_step`` (Lightning's documented pattern),
    and its own ``optimizer_zero_grad``."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        scale = min(1.0, (self.trainer.global_step + 1) / 10)
        for group in optimizer.param_groups:
            group["lr"] = scale * self.hparams.max_lr

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.max_lr / 10)


PREPARED = Path(tempfile.gettempdir()) / "ringflow-test-prepared-scale"


class PreparesItsData(OneCycle):
    """Its own ``prepare_data`` (a download, say) writes what ``setup`` reads."""

    def prepare_data(self):
        PREPARED.write_text("0.5")

    def setup(self, stage):
        self.scale = float(PREPARED.read_text())
        PREPARED.unlink()

    def forward(self, x):
        return super().forward(x * self.scale)


class EpochOrder(Sampler):
    """ringflow's order: a permutation seeded by the run's seed plus the epoch."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:  # Trainer calls it at every epoch start
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


@pytest.fixture(scope="module")
def data() -> TensorData:
    return table()


def table() -> TensorData:
    """150 samples of 8 features in 3 classes: 120 to train on, 30 to validate on."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, FEATURES, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return TensorData(splits={"train": (x[:120], y[:120]), "validation": (x[120:], y[120:])})


@pytest.fixture
def deterministic_off():
    """Trainer(deterministic=True) switches torch's deterministic mode on for the process."""
    yield
    torch.use_deterministic_algorithms(False)


def trained_by_trainer(
    cls, hparams: dict, data, *, epochs: int = EPOCHS, seed: int = SEED, **options
) -> tuple[L.LightningModule, L.Trainer]:
    """``cls`` trained by ``lightning.Trainer`` on ringflow's batch order; module and trainer.
    ``data``: ``TensorData``, a ``LightningDataModule`` whose train loader has that order, or
    ``None`` for the module's own loaders."""
    torch.manual_seed(seed)
    module = cls(**hparams)
    trainer = L.Trainer(
        **{
            "accelerator": "cpu",
            "devices": 1,
            "deterministic": True,
            "max_epochs": epochs,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            **options,
        }
    )
    if data is None:  # the module's own loaders
        trainer.fit(module)
        return module, trainer
    if isinstance(data, L.LightningDataModule):
        trainer.fit(module, datamodule=data)
        return module, trainer
    x, y = data.splits["train"]
    train = DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=EpochOrder(len(y), seed))
    val = DataLoader(TensorDataset(*data.splits["validation"]), batch_size=BATCH)
    trainer.fit(module, train, val)
    return module, trainer


def under_trainer(cls, hparams: dict, data: TensorData, **options) -> dict[str, torch.Tensor]:
    module, _ = trained_by_trainer(cls, hparams, data, **options)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def under_ringflow(cls, hparams: dict, data, tmp_path, *, workers=1, **config) -> dict:
    result = fit(
        cls,
        hparams=hparams,
        data=data,
        config=TrainConfig(workers=workers, epochs=EPOCHS, batch_size=BATCH, seed=SEED, **config),
        checkpoint_uri=str(tmp_path / f"model-{workers}"),
        in_process=workers == 1,
    )
    return result.state_dict


STEPS = EPOCHS * 120 // BATCH + EPOCHS  # 8 batches an epoch (the last one short)


def test_the_outliers_skip_some_batches_whole_and_some_shares_only(data):
    """``SkipsOutliers`` means something: of the batches it skips, some have an outlier in
    one worker's share only, when two workers split them."""
    from ringflow.engine.worker import epoch_batches, split_global_batch

    x = data.splits["train"][0]
    config = TrainConfig(workers=1, epochs=EPOCHS, batch_size=BATCH, seed=SEED)
    skipped = halves = 0
    for epoch in range(EPOCHS):
        for _, mine, _ in epoch_batches(
            120,
            config,
            epoch=epoch,
            first=0,
            count=8,
            rank=0,
            world_size=1,
            device=torch.device("cpu"),
        ):
            outlier = x[mine, 0] > 1.8
            if outlier.any():
                skipped += 1
                shares = [
                    outlier[split_global_batch(torch.arange(len(mine)), rank=r, world_size=2)].any()
                    for r in (0, 1)
                ]
                halves += not all(shares)
    assert skipped >= 3
    assert halves >= 2


CASES = {
    "one-cycle, clipped by norm": (OneCycle, {"gradient_clip_val": 0.5}),
    "one-cycle, clipped by norm, accumulating 2 batches": (
        OneCycle,
        {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2},
    ),
    "one-cycle, accumulating 3 batches (a short window ends each epoch)": (
        OneCycle,
        {"accumulate_grad_batches": 3, "commit_every": 9},
    ),
    "plateau on val_loss, clipped by value": (
        Plateau,
        {"gradient_clip_val": 0.2, "gradient_clip_algorithm": "value"},
    ),
}
STEP_FORMS = {  # what training_step may take and return
    "training_step(batch), without batch_idx": (WithoutIndex, {}),
    "None every third batch": (SkipsEveryThird, {"gradient_clip_val": 0.5}),
    "None every third batch, accumulating 2": (SkipsEveryThird, {"accumulate_grad_batches": 2}),
    "None where a worker's share holds an outlier": (SkipsOutliers, {}),
    "a warm-up in its own optimizer_step, clipped": (WarmsUp, {"gradient_clip_val": 0.5}),
    "its own prepare_data": (PreparesItsData, {}),
}


@pytest.mark.parametrize("case", list(CASES | STEP_FORMS))
def test_one_worker_ends_with_the_weights_trainer_ends_with(
    case, data, tmp_path, deterministic_off
):
    cls, clipping = (CASES | STEP_FORMS)[case]
    hparams = {"total_steps": STEPS}
    trainer = {k: v for k, v in clipping.items() if k != "commit_every"}  # Trainer's names
    expected = under_trainer(cls, hparams, data, **trainer)
    got = under_ringflow(cls, hparams, data, tmp_path, **clipping)
    assert relative_difference(got, expected) < 1e-5
    torch.manual_seed(SEED)
    assert relative_difference(got, cls(**hparams).state_dict()) > 1e-2  # it trained


@pytest.mark.parametrize(("precision", "tolerance"), [("bf16-mixed", 1e-5), ("bf16-true", 1e-5)])
def test_in_bfloat16_one_worker_ends_near_trainers_weights(
    precision, tolerance, data, tmp_path, deterministic_off
):
    hparams = {"total_steps": STEPS}
    expected = under_trainer(OneCycle, hparams, data, precision=precision)
    got = under_ringflow(OneCycle, hparams, data, tmp_path, precision=precision)
    assert {v.dtype for v in got.values()} == {v.dtype for v in expected.values()}
    assert relative_difference(got, expected) < tolerance
    full = under_ringflow(OneCycle, hparams, data, tmp_path / "f32")
    assert relative_difference(got, full) > relative_difference(got, expected)  # it was bf16


@pytest.mark.ray
@pytest.mark.parametrize("case", list(CASES))
def test_two_and_three_workers_end_with_one_workers_weights(case, data, tmp_path, ray_session):
    cls, clipping = CASES[case]
    hparams = {"total_steps": STEPS}
    one = under_ringflow(cls, hparams, data, tmp_path, **clipping)
    for workers in (2, 3):
        many = under_ringflow(
            cls, hparams, data, tmp_path, workers=workers, cpus_per_worker=0.5, **clipping
        )
        assert relative_difference(many, one) < 1e-5, workers


@pytest.mark.ray
@pytest.mark.parametrize(
    "case", ["None every third batch", "None where a worker's share holds an outlier"]
)
def test_a_batch_skipped_by_any_worker_is_skipped_by_every_worker(
    case, data, tmp_path, ray_session
):
    cls, clipping = STEP_FORMS[case]
    hparams = {"total_steps": STEPS}
    one = under_ringflow(cls, hparams, data, tmp_path, **clipping)
    two = under_ringflow(cls, hparams, data, tmp_path, workers=2, cpus_per_worker=0.5, **clipping)
    assert relative_difference(two, one) < 1e-5


class Preempted(OneCycle):
    """OneCycle whose process dies (an exception, here) at its ``dies_at``-th batch."""

    dies_at: int | None = None

    def training_step(self, batch, batch_idx):
        self.batches = getattr(self, "batches", 0) + 1
        if self.batches == type(self).dies_at:
            raise RuntimeError("preempted")
        return super().training_step(batch, batch_idx)


def test_a_run_resumed_mid_epoch_ends_bit_for_bit_scheduler_included(data, tmp_path):
    def run(run_key: str):
        return fit(
            Preempted,
            hparams={"total_steps": STEPS},
            data=data,
            config=TrainConfig(
                workers=1,
                epochs=EPOCHS,
                batch_size=BATCH,
                seed=SEED,
                checkpoint_every=2,
                accumulate_grad_batches=2,
                gradient_clip_val=0.5,
            ),
            checkpoint_uri=str(tmp_path / run_key),
            in_process=True,
            store_url=str(tmp_path / "store"),
            run_key=run_key,
        )

    whole = run("whole")
    Preempted.dies_at = 21  # after 20 steps, checkpointed: half-way through epoch 3 (of 8 steps)
    try:
        with pytest.raises(RuntimeError, match="preempted"):
            run("cut")
    finally:
        Preempted.dies_at = None
    assert CheckpointStore(str(tmp_path / "store")).latest("cut").step == 20
    again = run("cut")
    assert again.resumed_from == 20
    for name, tensor in whole.state_dict.items():
        assert torch.equal(again.state_dict[name], tensor), name


class TwoOptimizers(OneCycle):
    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net[0].parameters()),
            torch.optim.Adam(self.net[2].parameters()),
        ]


class PlateauEveryStep(OneCycle):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": plateau, "interval": "step", "monitor": "train_loss"},
        }


class PlateauWithoutMonitor(OneCycle):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer),
        }


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (TwoOptimizers, r"returned 2 optimizers \(SGD, Adam\).*need manual optimisation"),
        (PlateauEveryStep, "ReduceLROnPlateau stepped every batch"),
        (PlateauWithoutMonitor, "must include a monitor"),
    ],
)
def test_what_ringflow_does_not_honour_is_refused_by_name(cls, message):
    with pytest.raises(ModelError, match=message):
        Optimization(cls(total_steps=10))


class Stopping(OneCycle):
    """Plain SGD that soon stops improving its validation loss, watched by EarlyStopping."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)

    def configure_callbacks(self):
        from lightning.pytorch.callbacks import EarlyStopping

        return [EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02)]


def test_early_stopping_stops_at_the_epoch_trainer_stops_at(data, tmp_path, deterministic_off):
    hparams = {"total_steps": STEPS}
    epochs = 12
    module, trainer = trained_by_trainer(Stopping, hparams, data, epochs=epochs)
    assert trainer.current_epoch < epochs, "the oracle never stopped: the test proves nothing"

    def run(run_key: str):
        return fit(
            Stopping,
            hparams=hparams,
            data=data,
            config=TrainConfig(workers=1, epochs=epochs, batch_size=BATCH, seed=SEED),
            checkpoint_uri=str(tmp_path / run_key),
            in_process=True,
            store_url=str(tmp_path / "store"),
            run_key=run_key,
        )

    result = run("stops")
    assert len(result.history) == trainer.current_epoch  # the epochs Trainer ran
    assert relative_difference(result.state_dict, module.state_dict()) < 1e-5
    again = run("stops")  # a stopped run started again stays stopped
    assert len(again.history) == len(result.history)
    for name, tensor in result.state_dict.items():
        assert torch.equal(again.state_dict[name], tensor), name


class _Forms:
    def returns(self, batch, batch_idx):
        return batch

    def branches(self, batch, batch_idx):
        if batch_idx:
            return batch
        else:
            raise ValueError(batch)

    def skips(self, batch, batch_idx):
        if batch_idx:
            return None
        return batch

    def bare(self, batch, batch_idx):
        if batch_idx:
            return
        return batch

    def falls_through(self, batch, batch_idx):
        if batch_idx:
            return batch

    def returns_nothing(self, batch, batch_idx):
        self.log("x", batch)


@pytest.mark.parametrize(
    ("form", "may"),
    [
        ("returns", False),
        ("branches", False),
        ("skips", True),
        ("bare", True),
        ("falls_through", True),
        ("returns_nothing", True),
    ],
)
def test_the_workers_agree_on_a_skipped_batch_only_where_the_step_can_skip(form, may):
    """Only a training_step whose code can return None pays for the workers' agreement."""
    from ringflow.engine.module import may_return_none

    assert may_return_none(getattr(_Forms, form)) is may


class Lazy(OneCycle):
    """Lazy layers, sized by the first forward: a LazyBatchNorm1d, a LazyLinear."""

    def __init__(self, **hparams):
        super().__init__(**hparams)
        self.net = nn.Sequential(
            nn.LazyBatchNorm1d(), nn.LazyLinear(32), nn.Tanh(), nn.Linear(32, CLASSES)
        )


class ReseededEachBatch(L.Callback):
    """Trainer's generators (torch's, numpy's, ``random``) reseeded before each batch as
    ringflow reseeds them (``engine.worker.step_seed``): a lazy layer draws its initial
    weights there."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        from ringflow.engine.worker import seed_generators, step_seed

        step = trainer.current_epoch * trainer.num_training_batches + batch_idx
        seed_generators(step_seed(SEED, step, 0), torch.device("cpu"))


def test_lazy_layers_end_with_trainers_weights(data, tmp_path, deterministic_off):
    hparams = {"total_steps": STEPS}
    expected = under_trainer(Lazy, hparams, data, callbacks=[ReseededEachBatch()])
    got = under_ringflow(Lazy, hparams, data, tmp_path)
    assert (
        relative_difference(
            {k: v.double() for k, v in got.items()}, {k: v.double() for k, v in expected.items()}
        )
        < 1e-5
    )
    assert got["net.1.weight"].shape == (32, FEATURES)


class LazyLinears(OneCycle):
    def __init__(self, **hparams):
        super().__init__(**hparams)
        self.net = nn.Sequential(nn.LazyLinear(32), nn.Tanh(), nn.LazyLinear(CLASSES))


@pytest.mark.ray
def test_lazy_layers_train_alike_on_every_worker(data, tmp_path, ray_session):
    hparams = {"total_steps": STEPS}
    one = under_ringflow(LazyLinears, hparams, data, tmp_path)
    two = under_ringflow(LazyLinears, hparams, data, tmp_path, workers=2, cpus_per_worker=0.5)
    assert relative_difference(two, one) < 1e-5


class ReadsItsTrainer(OneCycle):
    """Its optimizer over ``self.trainer.model``'s parameters, its schedule as long as
    ``self.trainer.estimated_stepping_batches``, as Lightning's examples configure them (a
    OneCycleLR stepped once too often raises)."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.trainer.model.parameters(), lr=self.hparams.max_lr)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=self.hparams.max_lr,
            total_steps=self.trainer.estimated_stepping_batches,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_configure_optimizers_reads_the_model_and_the_steps_of_trainer(
    data, tmp_path, deterministic_off
):
    hparams = {"total_steps": 0}  # unused: the schedule's length comes from the trainer
    with one_thread():
        expected = under_trainer(ReadsItsTrainer, hparams, data, accumulate_grad_batches=2)
        got = under_ringflow(ReadsItsTrainer, hparams, data, tmp_path, accumulate_grad_batches=2)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


class ReadsWhatIsNotOffered(OneCycle):
    def configure_optimizers(self):
        self.trainer.barebones  # noqa: B018
        return super().configure_optimizers()


def test_what_self_trainer_does_not_offer_is_named_with_the_hook_that_read_it(data, tmp_path):
    with pytest.raises(ModelError) as raised:
        under_ringflow(ReadsWhatIsNotOffered, {"total_steps": STEPS}, data, tmp_path)
    message = str(raised.value)
    assert "self.trainer.barebones (read in ReadsWhatIsNotOffered.configure_optimizers) is " in (
        message
    )
    assert "not offered by ringflow" in message
    assert "\n" not in message


def test_hparams_that_are_not_json_are_refused_by_name_before_training(data, tmp_path):
    import functools

    with pytest.raises(ModelError, match="hparams 'make' is a partial, which is not JSON"):
        fit(
            OneCycle,
            hparams={"total_steps": STEPS, "make": functools.partial(nn.Linear, 2)},
            data=data,
            config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED),
            checkpoint_uri=str(tmp_path / "model"),
            in_process=True,
        )


def test_model_checkpoint_keeps_the_files_trainer_keeps_and_stops_where_it_stops(
    data, tmp_path, deterministic_off
):
    """``ModelCheckpoint(monitor="val_loss", save_top_k=2)`` beside the module's
    ``EarlyStopping``: the same ``.ckpt`` files kept, the same best one and score, the run
    stopped at the same epoch; ``load_from_checkpoint`` reads ringflow's file."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def checkpoints(where: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=str(tmp_path / where), monitor="val_loss", save_top_k=2)

    hparams, epochs = {"total_steps": STEPS}, 12
    theirs, ours = checkpoints("theirs"), checkpoints("ours")
    _, trainer = trained_by_trainer(
        Stopping, hparams, data, epochs=epochs, callbacks=[theirs], enable_checkpointing=True
    )
    assert trainer.current_epoch < epochs, "the oracle never stopped: the test proves nothing"
    result = fit(
        Stopping,
        hparams=hparams,
        data=data,
        config=TrainConfig(workers=1, epochs=epochs, batch_size=BATCH, seed=SEED),
        checkpoint_uri=str(tmp_path / "model"),
        in_process=True,
        callbacks=[ours],
    )
    assert len(result.history) == trainer.current_epoch
    kept = sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert len(kept) == 2
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == kept
    assert Path(ours.best_model_path).name == Path(theirs.best_model_path).name
    assert float(ours.best_model_score) == pytest.approx(float(theirs.best_model_score), rel=1e-6)
    loaded = Stopping.load_from_checkpoint(ours.best_model_path)
    oracle = Stopping.load_from_checkpoint(theirs.best_model_path)
    assert relative_difference(loaded.state_dict(), oracle.state_dict()) < 1e-5
    assert loaded.hparams == oracle.hparams


def test_a_module_with_lazy_layers_warm_starts_from_a_committed_model(data, tmp_path):
    """Its lazy layers take their shapes from the data before the committed weights load:
    trained on at a learning rate of 0, it keeps them exactly."""
    trained = fit(
        Lazy,
        hparams={"total_steps": STEPS},
        data=data,
        config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED),
        checkpoint_uri=str(tmp_path / "trained"),
        in_process=True,
    )
    kept = fit(
        Lazy,
        hparams={"total_steps": STEPS, "max_lr": 0.0},
        data=data,
        config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED + 1),
        checkpoint_uri=str(tmp_path / "kept"),
        in_process=True,
        init_from=trained.checkpoint,
    )
    for name in ("net.1.weight", "net.1.bias", "net.3.weight"):
        assert torch.equal(kept.state_dict[name], trained.state_dict[name]), name


def test_a_lazy_layer_shaped_unlike_the_committed_model_is_refused_by_name(data, tmp_path):
    """Trained on one more feature, the committed model's lazy layers are wider: the worker,
    which sizes them from this run's data, names them."""
    x, y = data.splits["train"]
    wider = TensorData(splits={"train": (torch.cat([x, x[:, :1]], 1), y)})
    trained = fit(
        Lazy,
        hparams={"total_steps": STEPS},
        data=wider,
        config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED),
        checkpoint_uri=str(tmp_path / "trained"),
        in_process=True,
    )
    with pytest.raises(ModelError, match=r"cannot warm-start Lazy from .*'net.1.weight'"):
        fit(
            Lazy,
            hparams={"total_steps": STEPS},
            data=data,
            config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED),
            checkpoint_uri=str(tmp_path / "narrower"),
            in_process=True,
            init_from=trained.checkpoint,
        )
