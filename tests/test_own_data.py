"""A module that makes its own data trains under ringflow as under ``lightning.Trainer``: its
``train_dataloader()`` is called on the module that trains (a DQN's replay buffer grown by its
``training_step``, a PPO's rollouts of its current policy), a stream runs to its end every
epoch, there is no validation without a ``validation_step`` or validation data, and what a
module draws from numpy and ``random`` is seeded in every worker as torch is."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from ringflow.engine import DatasetData, TrainConfig, fit
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import one_thread, relative_difference
from tests.support.stack import clean_env
from tests.test_lightning_contract import (
    BATCH,
    FEATURES,
    SEED,
    EpochOrder,
    OneCycle,
    Preempted,
    ReseededEachBatch,
    deterministic_off,  # noqa: F401 (a fixture)
    table,
    trained_by_trainer,
    under_ringflow,
)

STATES = 6
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("deterministic_off")  # Trainer(deterministic=True)


class Chain:
    """A deterministic chain of states: right moves on, left moves back; the last state pays
    1 and starts the chain again."""

    def __init__(self) -> None:
        self.at = 0

    def step(self, action: int) -> tuple[int, float]:
        self.at = max(0, self.at - 1) if action == 0 else self.at + 1
        if self.at == STATES - 1:
            self.at = 0
            return self.at, 1.0
        return self.at, 0.0


def one_hot(state: int) -> torch.Tensor:
    return F.one_hot(torch.tensor(state), STATES).float()


def trained(cls, hparams: dict, tmp_path, **config) -> tuple[dict, dict]:
    """``cls`` trained on its own data by Trainer and by one ringflow worker: both weights.
    ``config``: options both take by the same name."""
    with one_thread():  # as ringflow's worker: the same rounding
        module, _ = trained_by_trainer(cls, hparams, None, **config)
    expected = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return expected, under_ringflow(cls, hparams, None, tmp_path, **config)


def assert_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


class Replay(IterableDataset):
    """Samples of a replay buffer, drawn when a pass starts (Lightning's DQN ``RLDataset``)."""

    def __init__(self, buffer: list, size: int) -> None:
        self.buffer, self.size = buffer, size

    def __iter__(self):
        g = torch.Generator().manual_seed(len(self.buffer))
        for i in torch.randint(len(self.buffer), (self.size,), generator=g).tolist():
            yield self.buffer[i]


class Agent(L.LightningModule):
    """Two actions' values (or preferences) for each state of the chain."""

    def __init__(self, **hparams) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(STATES, 16), nn.Tanh(), nn.Linear(16, 2))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class DQN(Agent):
    """Fills its replay buffer with one move of its agent in every ``training_step`` and
    serves samples of it through its own ``train_dataloader()``."""

    def __init__(self, *, warm_start: int = 24, sample_size: int = 48) -> None:
        super().__init__(warm_start=warm_start, sample_size=sample_size)
        self.register_buffer("new_seen", torch.zeros((), dtype=torch.long))
        self.env, self.buffer = Chain(), []
        for _ in range(warm_start):
            self.play()

    def play(self) -> None:
        state = self.env.at
        with torch.no_grad():
            greedy = int(self.net(one_hot(state)).argmax())
        action = len(self.buffer) % 2 if len(self.buffer) % 3 == 0 else greedy  # explores
        after, reward = self.env.step(action)
        self.buffer.append((one_hot(state), action, reward, one_hot(after), len(self.buffer)))

    def training_step(self, batch, batch_idx):
        state, action, reward, after, born = batch
        q = self.net(state).gather(1, action[:, None]).squeeze(1)
        with torch.no_grad():
            target = reward.float() + 0.9 * self.net(after).max(1).values
        self.new_seen += (born >= self.hparams.warm_start).sum()
        self.play()
        return F.mse_loss(q, target)

    def train_dataloader(self):
        return DataLoader(Replay(self.buffer, self.hparams.sample_size), batch_size=BATCH)


def test_a_dqn_trains_on_the_replay_buffer_its_training_steps_fill(tmp_path):
    expected, got = trained(DQN, {}, tmp_path)
    assert_equal(got, expected)
    assert got["new_seen"] > 0  # the buffer the loader samples grew as the module trained


class Snapshot(DQN):
    """A map-style copy of its newest experiences, taken again every epoch
    (``reload_dataloaders_every_n_epochs=1``), in ringflow's order."""

    def train_dataloader(self):
        newest = self.buffer[-self.hparams.warm_start :]
        columns = [torch.stack([torch.as_tensor(item[i]) for item in newest]) for i in range(5)]
        dataset = TensorDataset(*columns)
        return DataLoader(dataset, batch_size=BATCH, sampler=EpochOrder(len(dataset), SEED))


def test_a_loader_reloaded_every_epoch_serves_what_training_added(tmp_path):
    expected, got = trained(Snapshot, {}, tmp_path, reload_dataloaders_every_n_epochs=1)
    assert_equal(got, expected)
    assert got["new_seen"] > 0  # the reloads served experiences gathered since the start
    assert under_ringflow(Snapshot, {}, None, tmp_path / "once")["new_seen"] == 0


class Rollouts(IterableDataset):
    """What a generator of the module yields (Lightning's PPO ``ExperienceSourceDataset``)."""

    def __init__(self, generate) -> None:
        self.generate = generate

    def __iter__(self):
        return self.generate()


class PPO(Agent):
    """Plays a rollout of its current policy when a pass over its stream starts, yields it,
    and clears it after the last item, as Lightning's PPO example does."""

    def __init__(self, *, steps: int = 48) -> None:
        super().__init__(steps=steps)
        self.register_buffer("stale", torch.zeros((), dtype=torch.long))
        self.states, self.actions, self.rewards = [], [], []

    def generate(self):
        self.stale += len(self.states)  # a rollout left over from the last pass
        g = torch.Generator().manual_seed(self.current_epoch)
        env = Chain()
        with torch.no_grad():
            for _ in range(self.hparams.steps):
                self.states.append(one_hot(env.at))
                probs = self.net(self.states[-1]).softmax(-1)
                self.actions.append(int(torch.multinomial(probs, 1, generator=g)))
                self.rewards.append(env.step(self.actions[-1])[1])
        returns, ahead = [], 0.0
        for reward in reversed(self.rewards):
            ahead = reward + 0.9 * ahead
            returns.insert(0, ahead)
        yield from zip(self.states, self.actions, returns, strict=True)
        self.states.clear()
        self.actions.clear()
        self.rewards.clear()

    def training_step(self, batch, batch_idx):
        state, action, ret = batch
        log_p = self.net(state).log_softmax(-1).gather(1, action[:, None]).squeeze(1)
        return -(log_p * (ret.float() - 0.5)).mean()

    def train_dataloader(self):
        return DataLoader(Rollouts(self.generate), batch_size=BATCH)


def test_a_ppo_stream_runs_to_its_end_every_epoch(tmp_path):
    expected, got = trained(PPO, {}, tmp_path)
    assert_equal(got, expected)
    assert got["stale"] == 0  # every pass found the last one's rollout cleared


# Two workers are compared with one (which ends bit for bit at Trainer's weights, above), not
# with Trainer under DDP: Lightning does not split an IterableDataset among DDP's ranks, so
# each rank would train on the whole stream, where ringflow splits every global batch.
@pytest.mark.ray
@pytest.mark.parametrize(("cls", "own"), [(DQN, "new_seen"), (PPO, None)])
def test_two_workers_train_a_module_on_its_own_data_as_one_does(cls, own, tmp_path, ray_session):
    """Each worker's module plays alike (the same weights, environment and seeds), so each
    worker's loader serves the batches one worker's does, and each trains on its part."""
    one = under_ringflow(cls, {}, None, tmp_path / "one")
    two = under_ringflow(cls, {}, None, tmp_path / "two", workers=2)
    if own is not None:  # counts what rank 0's part held: its own, not the batch's
        assert 0 < two.pop(own) < one.pop(own)
    assert relative_difference(two, one) < 1e-5


@pytest.mark.ray
def test_model_checkpoint_save_last_on_two_workers_writes_what_load_from_checkpoint_reads(
    tmp_path, ray_session
):
    from lightning.pytorch.callbacks import ModelCheckpoint

    saved = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss", save_last=True)
    result = fit(
        OneCycle,
        hparams={"total_steps": 30},
        data=table(),
        config=TrainConfig(workers=2, epochs=2, batch_size=BATCH, seed=SEED),
        checkpoint_uri=str(tmp_path / "model"),
        callbacks=[saved],
    )
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    last = OneCycle.load_from_checkpoint(saved.last_model_path)
    assert_equal(last.state_dict(), result.state_dict)  # the last epoch's: the run's end
    best = OneCycle.load_from_checkpoint(saved.best_model_path)
    assert best.hparams == {"total_steps": 30, "max_lr": 0.05}


class ItsOwnTable(OneCycle):
    """A table of its own: train, validation and test loaders, and a ``test_step``."""

    def train_dataloader(self):
        return DataLoader(TensorDataset(*table().splits["train"]), batch_size=BATCH)

    def val_dataloader(self):
        return DataLoader(TensorDataset(*table().splits["validation"]), batch_size=BATCH)

    def test_dataloader(self):
        return self.val_dataloader()

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))


class ValidatesOnly(ItsOwnTable):
    test_dataloader = L.LightningModule.test_dataloader  # Lightning's own: none


@pytest.mark.parametrize(
    ("cls", "hparams", "metrics"),
    [
        (ItsOwnTable, {"total_steps": 30}, {"test_loss"}),
        (ValidatesOnly, {"total_steps": 30}, {"val_loss"}),
        (DQN, {}, set()),
    ],
    ids=["its test loader", "its validation loader", "none"],
)
def test_a_model_trained_on_its_own_data_is_evaluated_on_its_own_loaders(
    cls, hparams, metrics, tmp_path
):
    from ringflow.engine import evaluate

    fit(
        cls,
        hparams=hparams,
        data=None,
        config=TrainConfig(workers=1, epochs=1, batch_size=BATCH, seed=SEED),
        checkpoint_uri=str(tmp_path / "model"),
        in_process=True,
    )
    assert set(evaluate(str(tmp_path / "model"), None, model=cls)) == metrics


@pytest.mark.integration  # a private Ray of its own
def test_the_flow_trains_a_model_on_its_own_data_given_no_data_file(tmp_path, prefect_api):
    """No data_url, no preprocessing: trained on two workers with the module's loaders,
    evaluated on its own test loader, registered and promoted."""
    summary, _ = _flow(
        prefect_api,
        tmp_path,
        *("--model", f"{__name__}:ItsOwnTable", "--hparams", '{"total_steps": 16}'),
        *("--workers", "2", "--epochs", "2"),
    )
    assert summary["dataset_url"] is None
    assert summary["test_loss"] > 0
    assert summary["promoted"] is True
    assert not list((tmp_path / "storage").rglob("_manifest.json"))  # nothing preprocessed


class Counted(OneCycle):
    """Counts the validation epochs it sees."""

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.register_buffer("validated", torch.zeros((), dtype=torch.long))

    def on_validation_epoch_start(self):
        self.validated += 1


class NoValidationStep(Counted):
    validation_step = L.LightningModule.validation_step  # Lightning's own: none


def train_only() -> DatasetData:
    return DatasetData(train=TensorDataset(*table().splits["train"]))


@pytest.mark.parametrize(
    ("cls", "data"),
    [(Counted, train_only), (NoValidationStep, table)],
    ids=["no validation data", "no validation_step"],
)
def test_there_is_no_validation_without_a_step_or_data_for_it(cls, data, tmp_path):
    got = under_ringflow(cls, {"total_steps": 30}, data(), tmp_path)
    assert got["validated"] == 0


class Noisy(OneCycle):
    """Adds noise from numpy and ``random`` to its inputs."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = torch.from_numpy(np.random.normal(size=tuple(x.shape))).float()
        return super().training_step((x + 0.3 * noise * random.random(), y), batch_idx)


def test_numpy_and_random_are_seeded_at_every_step_as_torch_is(tmp_path):
    hparams = {"total_steps": 30}
    with one_thread():
        module, _ = trained_by_trainer(Noisy, hparams, table(), callbacks=[ReseededEachBatch()])
    got = under_ringflow(Noisy, hparams, table(), tmp_path)
    assert relative_difference(got, module.state_dict()) < 1e-6


class NoisyPreempted(Preempted, Noisy):
    """``Noisy``, whose process dies at its ``dies_at``-th batch."""


def test_a_run_drawing_from_numpy_and_random_resumed_mid_epoch_ends_bit_for_bit(tmp_path):
    def run(run_key: str):
        return fit(
            NoisyPreempted,
            hparams={"total_steps": 30},
            data=table(),
            config=TrainConfig(
                workers=1, epochs=2, batch_size=BATCH, seed=SEED, checkpoint_every=2
            ),
            checkpoint_uri=str(tmp_path / run_key),
            in_process=True,
            store_url=str(tmp_path / "store"),
            run_key=run_key,
        )

    whole = run("whole")
    NoisyPreempted.dies_at = 12  # after 11 steps (8 an epoch), checkpointed at 10
    try:
        with pytest.raises(RuntimeError, match="preempted"):
            run("cut")
    finally:
        NoisyPreempted.dies_at = None
    again = run("cut")
    assert again.resumed_from == 10
    assert_equal(again.state_dict, whole.state_dict)


@pytest.mark.ray
def test_two_runs_of_two_workers_drawing_from_numpy_and_random_end_alike(tmp_path, ray_session):
    runs = [
        under_ringflow(Noisy, {"total_steps": 30}, table(), tmp_path / name, workers=2)
        for name in ("a", "b")
    ]
    assert_equal(*runs)


class WithGenerator(Dataset):
    """A map-style dataset that holds the numpy ``Generator`` it was made with."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(SEED)
        self.x = torch.from_numpy(self.rng.normal(size=(96, FEATURES))).float()
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


@pytest.mark.ray
def test_a_dataset_holding_a_numpy_generator_trains_on_two_workers(tmp_path, ray_session):
    data = DatasetData(train=WithGenerator())
    two = under_ringflow(OneCycle, {"total_steps": 30}, data, tmp_path, workers=2)
    one = under_ringflow(OneCycle, {"total_steps": 30}, data, tmp_path)
    assert relative_difference(two, one) < 1e-5


def test_a_module_given_no_data_and_no_train_dataloader_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="OneCycle has no train_dataloader") as refused:
        under_ringflow(OneCycle, {"total_steps": 30}, None, tmp_path)
    assert "\n" not in str(refused.value)


def test_a_negative_reload_interval_is_refused_by_name():
    with pytest.raises(ValueError, match="reload_dataloaders_every_n_epochs"):
        TrainConfig(reload_dataloaders_every_n_epochs=-1)


class LazyDigits(DigitsClassifier):
    """The demo model with its first layer lazy: sized from the data by its first forward."""

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.net[0] = nn.LazyLinear(self.hparams.hidden)


@pytest.mark.integration  # a private Ray of its own
def test_a_module_with_lazy_layers_warm_starts_from_its_production_version_through_the_flow(
    tmp_path, prefect_api
):
    def run(*extra: str) -> tuple[dict, str]:
        lazy = ("--model", f"{__name__}:LazyDigits", "--workers", "1", "--epochs", "1")
        return _flow(prefect_api, tmp_path, *lazy, *extra)

    first, _ = run()
    assert first["promoted"] is True
    warm, said = run("--warm-start")  # from the production version: its lazy layer sized
    assert "warm start from" in said, said[-3000:]
    assert warm["model_version"] != first["model_version"]
    assert warm["test_accuracy"] > 0.5


def _flow(api: str, tmp_path, *args: str) -> tuple[dict, str]:
    """A run of the flow's command line with ``args`` (no tuning, no serving), its storage
    under ``tmp_path``, reporting to the Prefect server at ``api``: its result and all it
    printed."""
    done = subprocess.run(
        [sys.executable, "-m", "ringflow.flows.train_pipeline", *args]
        + ["--tune-trials", "0", "--no-serve", "--storage-url", str(tmp_path / "storage")],
        cwd=ROOT,
        env=clean_env(PREFECT_API_URL=api),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout + done.stderr
