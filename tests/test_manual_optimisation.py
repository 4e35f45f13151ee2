"""Manual optimisation (``automatic_optimization = False``) as under ``lightning.Trainer``:
several optimizers stepped by the module, ``self.manual_backward`` reducing the gradients
over the workers before the module's ``opt.step()``, ``toggle_optimizer``, the module's own
clipping and schedulers, and every optimizer's state in commits and checkpoints.

The module is Lightning's own GAN example (``examples/pytorch/domain_templates/
generative_adversarial_net.py``), its images replaced by synthetic tensors of a small shape
and its TensorBoard image grid left out. Trainer, the oracle, draws its noise from the same
per-step seed ringflow reseeds with (``engine.worker.step_seed``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ringflow.engine import ModelError, TensorData, TrainConfig, fit
from ringflow.engine.module import check_manual_optimisation
from ringflow.engine.worker import step_seed
from ringflow.storage import CheckpointStore
from tests.lightning_examples import generative_adversarial_net as example
from tests.support.fitting import KILLED_PEER_DEADLINE_S, die_once, one_thread
from tests.support.fitting import relative_difference as _relative

SHAPE, LATENT, BATCH, EPOCHS, SEED = (1, 28, 28), 100, 16, 2, 3  # MNIST's, the example's
SAMPLES = 96  # 6 batches an epoch, every one whole


def relative_difference(a: dict, b: dict) -> float:
    """As ``tests.support.fitting``'s, BatchNorm's counts of batches included."""
    return _relative({k: v.double() for k, v in a.items()}, {k: v.double() for k, v in b.items()})


# ---------------------------------------------------------------- Lightning's example


class GAN(example.GAN):
    """Lightning's GAN as it is; its epoch end draws an image grid for TensorBoard with
    torchvision, which ringflow does not install: left out."""

    def on_train_epoch_end(self):
        pass


class NoiseFromData(GAN):
    """The GAN with its noise taken from the batch and no BatchNorm in its generator: its
    gradients are then a function of the global batch alone, so any number of workers
    trains alike (BatchNorm's statistics are each worker's, as under DDP)."""

    def __init__(self, **hparams):
        super().__init__(**hparams)
        layers = self.generator.model
        for i, layer in enumerate(layers):
            if isinstance(layer, nn.BatchNorm1d):
                layers[i] = nn.Identity()

    def training_step(self, batch):  # the example's, its noise from the batch
        imgs, z = batch
        opt_g, opt_d = self.optimizers()
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})


class ClippedAndScheduled(NoiseFromData):
    """The module's own clipping (``self.clip_gradients``) and schedulers it steps itself;
    ``training_step`` with ``batch_idx``, returning the loss."""

    def training_step(self, batch, batch_idx):
        imgs, z = batch
        opt_g, opt_d = self.optimizers()
        sched_g, sched_d = self.lr_schedulers()
        valid = torch.ones(imgs.size(0), 1)
        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        fake = torch.zeros(imgs.size(0), 1)
        d_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (d_loss + self.adversarial_loss(self.discriminator(imgs), valid)) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.01, gradient_clip_algorithm="value")
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        sched_g.step()
        if self.trainer.is_last_batch:
            sched_d.step()
        return d_loss

    def configure_optimizers(self):
        opt_g, opt_d = super().configure_optimizers()
        return [opt_g, opt_d], [
            torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.5),
            torch.optim.lr_scheduler.ExponentialLR(opt_d, gamma=0.9),
        ]


class Preempted(NoiseFromData):
    """Dies (an exception, here) at its ``dies_at``-th batch."""

    dies_at: int | None = None

    def training_step(self, batch):
        self.batches = getattr(self, "batches", 0) + 1
        if self.batches == type(self).dies_at:
            raise RuntimeError("preempted")
        return super().training_step(batch)


# ---------------------------------------------------------------- the oracle


def images(samples: int = SAMPLES) -> TensorData:
    g = torch.Generator().manual_seed(0)
    x = torch.rand((samples + 16, *SHAPE), generator=g) * 2 - 1
    z = torch.randn(samples + 16, LATENT, generator=g)
    return TensorData(
        splits={"train": (x[:samples], z[:samples]), "validation": (x[-16:], z[-16:])}
    )


class Reseeded(L.Callback):
    """Trainer's generator reseeded before each batch as ringflow reseeds it."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        steps = SAMPLES // BATCH
        torch.default_generator.manual_seed(
            step_seed(SEED, trainer.current_epoch * steps + batch_idx, 0)
        )


def under_trainer(cls, hparams: dict, data: TensorData, **options) -> tuple[dict, L.Trainer]:
    torch.manual_seed(SEED)
    module = cls(**hparams)
    trainer = L.Trainer(
        **{
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": EPOCHS,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [Reseeded()],
            **options,
        }
    )
    # ringflow's batch order: ``engine.data.EpochOrder`` over one block of samples
    from ringflow.engine.data import EpochOrder, Layout

    class Order(torch.utils.data.Sampler):
        def __init__(self):
            self.epoch = 0

        def __iter__(self):
            order = EpochOrder(Layout((SAMPLES,)), seed=SEED, epoch=self.epoch, batch_size=BATCH)
            self.epoch += 1
            return iter(torch.cat([order.batch(s) for s in range(order.steps)]).tolist())

        def __len__(self):
            return SAMPLES

    loader = DataLoader(TensorDataset(*data.splits["train"]), batch_size=BATCH, sampler=Order())
    with one_thread():  # as ringflow's worker (cpus_per_worker=1): the same rounding
        trainer.fit(module, loader)
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}, trainer


def under_ringflow(cls, hparams: dict, data, tmp_path, *, workers: int = 1, **config):
    return fit(
        cls,
        hparams=hparams,
        data=data,
        config=TrainConfig(
            **{"workers": workers, "epochs": EPOCHS, "batch_size": BATCH, "seed": SEED, **config}
        ),
        checkpoint_uri=str(tmp_path / f"model-{workers}"),
        in_process=workers == 1,
    )


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("cls", [GAN, NoiseFromData, ClippedAndScheduled])
def test_one_worker_ends_with_the_weights_trainer_ends_with(cls, tmp_path):
    data = images()
    expected, trainer = under_trainer(cls, {}, data)
    got = under_ringflow(cls, {}, data, tmp_path)
    assert relative_difference(got.state_dict, expected) < 1e-6
    torch.manual_seed(SEED)
    assert relative_difference(got.state_dict, cls().state_dict()) > 1e-3  # it trained
    # two optimizer steps a batch: Trainer's global_step counts both
    assert trainer.global_step == 2 * EPOCHS * SAMPLES // BATCH


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_in_16_mixed_on_a_gpu_the_gan_ends_with_trainers_weights(tmp_path):
    """Manual optimisation with the gradient scaler: scaled backward, unscaled before the
    module's step, one scale update per optimizer step, as Trainer's precision does."""
    data = images()
    expected, _ = under_trainer(NoiseFromData, {}, data, accelerator="gpu", precision="16-mixed")
    got = under_ringflow(NoiseFromData, {}, data, tmp_path, precision="16-mixed", gpus_per_worker=1)
    assert relative_difference(got.state_dict, expected) < 1e-5
    torch.manual_seed(SEED)
    assert relative_difference(got.state_dict, NoiseFromData().state_dict()) > 1e-3


@pytest.mark.ray
def test_two_workers_end_with_one_workers_weights(tmp_path, ray_session):
    data = images()
    one = under_ringflow(NoiseFromData, {}, data, tmp_path)
    two = under_ringflow(NoiseFromData, {}, data, tmp_path, workers=2, cpus_per_worker=0.5)
    assert relative_difference(two.state_dict, one.state_dict) < 1e-6


class KilledInEpochOne(NoiseFromData):
    """Rank 1's process SIGKILLs itself as its first step of epoch 1 begins, once (a marker
    file): the kill lands in the run, however fast or busy the machine."""

    def __init__(self, marker: str = "", **hparams):
        super().__init__(**hparams)
        self.marker = marker

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.current_epoch == 1 and batch_idx == 0:
            die_once(self.marker)
        return super().training_step(batch)


@pytest.mark.ray
def test_a_worker_killed_and_replaced_at_once_ends_bit_for_bit(tmp_path, ray_session):
    """Both optimizers' states roll back with the weights to the last in-memory commit."""
    config = {
        "workers": 2,
        "epochs": 4,
        "cpus_per_worker": 0.5,
        "collective_timeout_s": KILLED_PEER_DEADLINE_S,
    }
    reference = under_ringflow(NoiseFromData, {}, images(), tmp_path / "reference", **config)
    marker = tmp_path / "killed"
    result = fit(
        KilledInEpochOne,
        hparams={"marker": str(marker)},
        data=images(),
        config=TrainConfig(batch_size=BATCH, seed=SEED, **config),
        checkpoint_uri=str(tmp_path / "replaced"),
    )
    assert marker.exists()
    assert [e.kind for e in result.events] == ["lost", "rollback", "joined", "recovered"]
    for name, tensor in reference.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name


def test_a_run_resumed_mid_epoch_ends_bit_for_bit_both_optimizers_included(tmp_path):
    def run(run_key: str):
        return fit(
            Preempted,
            hparams={},
            data=images(),
            config=TrainConfig(
                workers=1, epochs=EPOCHS, batch_size=BATCH, seed=SEED, checkpoint_every=2
            ),
            checkpoint_uri=str(tmp_path / run_key),
            in_process=True,
            store_url=str(tmp_path / "store"),
            run_key=run_key,
        )

    whole = run("whole")
    Preempted.dies_at = 9  # after 8 steps, checkpointed: in the second epoch (of 6 steps)
    try:
        with pytest.raises(RuntimeError, match="preempted"):
            run("cut")
    finally:
        Preempted.dies_at = None
    assert CheckpointStore(str(tmp_path / "store")).latest("cut").step == 8
    again = run("cut")
    assert again.resumed_from == 8
    for name, tensor in whole.state_dict.items():
        assert torch.equal(again.state_dict[name], tensor), name


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches=2 is refused"),
        ({"gradient_clip_val": 0.5}, r"call self.clip_gradients\(optimizer"),
    ],
)
def test_what_manual_optimisation_cannot_take_is_refused_by_name(config, message):
    config = TrainConfig(workers=1, batch_size=BATCH, **config)
    with pytest.raises(ModelError, match=message):
        check_manual_optimisation(GAN(), config, pipeline=False)


def test_a_pipeline_refuses_manual_optimisation():
    with pytest.raises(ModelError, match="manual optimisation trains data-parallel only"):
        check_manual_optimisation(GAN(), TrainConfig(workers=1), pipeline=True)


@pytest.mark.ray
def test_a_last_batch_that_leaves_a_worker_nothing_is_refused_before_training(
    tmp_path, ray_session
):
    with pytest.raises(ModelError, match="leaves some of the 2 workers nothing") as refused:
        under_ringflow(GAN, {}, images(SAMPLES + 1), tmp_path, workers=2, cpus_per_worker=0.5)
    assert "\n" not in str(refused.value)
