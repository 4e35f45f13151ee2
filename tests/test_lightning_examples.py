"""Lightning's own basic examples, as they are in its repository (``tests/lightning_examples``:
the autoencoder and the backbone image classifier), their MNIST replaced by synthetic
tensors of its shape: ringflow ends with Trainer's weights and writes Trainer's CSV files
(``hparams.yaml`` and ``metrics.csv``, the classifier's ``valid_loss_step`` and
``valid_loss_epoch`` included), and 2 workers end with 1 worker's weights."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from ringflow.engine import TensorData, TrainConfig, fit
from tests.lightning_examples.autoencoder import LitAutoEncoder
from tests.lightning_examples.backbone_image_classifier import LitClassifier
from tests.support.fitting import one_thread, relative_difference
from tests.test_lightning_contract import EpochOrder
from tests.test_lightning_logging import rows, same_rows

BATCH, EPOCHS, SEED = 32, 2, 5
EXAMPLES = {"autoencoder": LitAutoEncoder, "image classifier": LitClassifier}


@pytest.fixture(scope="module")
def mnist_shaped() -> TensorData:
    """256 training and 64 validation images of MNIST's shape, with labels."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(320, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (320,), generator=g)
    return TensorData(splits={"train": (x[:256], y[:256]), "validation": (x[256:], y[256:])})


def by_trainer(cls, data: TensorData, root) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    module = cls()
    x, y = data.splits["train"]
    with one_thread():  # as ringflow's worker: the same rounding
        L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=EPOCHS,
            logger=CSVLogger(str(root), name="run", version=0),
            log_every_n_steps=2,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        ).fit(
            module,
            DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=EpochOrder(len(y), SEED)),
            DataLoader(TensorDataset(*data.splits["validation"]), batch_size=BATCH),
        )
    return module.state_dict()


def by_ringflow(cls, data: TensorData, root, *, workers: int = 1) -> dict[str, torch.Tensor]:
    return fit(
        cls,
        hparams={},
        data=data,
        config=TrainConfig(
            workers=workers,
            epochs=EPOCHS,
            batch_size=BATCH,
            seed=SEED,
            log_every_n_steps=2,
            cpus_per_worker=1 if workers == 1 else 0.5,
        ),
        checkpoint_uri=str(root / "model"),
        in_process=workers == 1,
        loggers=[CSVLogger(str(root), name="run", version=0)],
    ).state_dict


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_one_worker_ends_with_trainers_weights_and_files(example, mnist_shaped, tmp_path):
    cls = EXAMPLES[example]
    expected = by_trainer(cls, mnist_shaped, tmp_path / "trainer")
    got = by_ringflow(cls, mnist_shaped, tmp_path / "ringflow")
    assert relative_difference(got, expected) < 1e-7
    theirs, ours = tmp_path / "trainer/run/version_0", tmp_path / "ringflow/run/version_0"
    assert (ours / "hparams.yaml").read_text() == (theirs / "hparams.yaml").read_text()
    same_rows(rows(ours / "metrics.csv"), rows(theirs / "metrics.csv"), 1e-6)
    if cls is LitClassifier:
        names = set().union(*rows(ours / "metrics.csv"))
        assert {"valid_loss_step", "valid_loss_epoch", "train_loss_epoch"} <= names


def by_halves(cls, data: TensorData, workers: int = 2) -> dict[str, torch.Tensor]:
    """The module trained on ringflow's global batches, each step's gradient the sum of its
    ``workers`` contiguous shares' gradients, each weighted by its part of the batch: what
    ringflow's (and DDP's) workers compute together, here in one process."""
    import warnings

    torch.manual_seed(SEED)
    module = cls()
    optimizer = module.configure_optimizers()
    x, y = data.splits["train"]
    share = BATCH // workers
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log with no Trainer
        for epoch in range(EPOCHS):
            order = EpochOrder(len(y), SEED)
            order.set_epoch(epoch)
            batches = torch.tensor(list(order)).split(BATCH)
            for index, batch in enumerate(batches):
                summed = [torch.zeros_like(p) for p in module.parameters()]
                for worker in range(workers):
                    part = batch[worker * share : (worker + 1) * share]
                    module.zero_grad()
                    module.training_step((x[part], y[part]), index).backward()
                    for total, p in zip(summed, module.parameters(), strict=True):
                        total += p.grad * (len(part) / len(batch))
                for p, total in zip(module.parameters(), summed, strict=True):
                    p.grad = total
                optimizer.step()
    return module.state_dict()


@pytest.mark.ray
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_two_workers_end_with_one_workers_weights(example, mnist_shaped, tmp_path, ray_session):
    """2 workers end bit for bit with the two halves' gradients summed in one process (what
    DDP computes too); that sum's float32 rounding is all that parts them from 1 worker, and
    the autoencoder's Adam amplifies it (3.5e-6 measured; the classifier 1.3e-8)."""
    cls = EXAMPLES[example]
    one = by_ringflow(cls, mnist_shaped, tmp_path / "one")
    two = by_ringflow(cls, mnist_shaped, tmp_path / "two", workers=2)
    assert relative_difference(two, by_halves(cls, mnist_shaped)) == 0.0
    assert relative_difference(one, by_halves(cls, mnist_shaped, workers=1)) == 0.0
    assert relative_difference(two, one) < 1e-5
    theirs, ours = tmp_path / "one/run/version_0", tmp_path / "two/run/version_0"
    same_rows(rows(ours / "metrics.csv"), rows(theirs / "metrics.csv"), 1e-5)
