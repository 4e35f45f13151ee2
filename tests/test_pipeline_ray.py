"""Pipeline stages as Ray actors: real gloo point-to-point between processes, DP x PP."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ringflow.engine import EngineError, TrainConfig, fit
from ringflow.engine.pipeline import PipelineConfig, TensorData
from ringflow.storage.checkpoint import load_model
from ringflow.storage.dataset import read_split
from tests import test_pipeline
from tests.support.fitting import (
    KILLED_PEER_DEADLINE_S,
    relative_difference,
    shipped_by_value,
)
from tests.test_pipeline import ToyNet, toy_data

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _models_by_value(ray_session):
    with shipped_by_value(ray_session, sys.modules[__name__], test_pipeline):
        yield


class DigitsPipe(nn.Module):
    """An MLP over the digits' 64 pixels as a three-layer sequence."""

    def __init__(self, *, hidden: int = 32, lr: float = 0.005) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target)

    def pipeline_metrics(self, out: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"accuracy": (out.argmax(dim=1) == target).float().mean()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class DiesInStageOne(ToyNet):
    """Its last layer ends its process at the third training step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        if self.steps == 3:
            os._exit(1)
        return super().pipeline_loss(out, target)


def unsplit_training(model: nn.Module, x, y, config: TrainConfig) -> dict[str, torch.Tensor]:
    """What ``fit`` on one worker computes: the optimizer on each global batch's mean loss."""
    optimizer = model.configure_optimizers()
    for epoch in range(config.epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(config.seed + epoch))
        for start in range(0, len(y), config.batch_size):
            batch = order[start : start + config.batch_size]
            optimizer.zero_grad()
            model.pipeline_loss(model(x[batch]), y[batch]).backward()
            optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_two_stage_actors_train_the_digits_to_the_unsplit_weights(digits, tmp_path):
    config = TrainConfig(workers=1, epochs=2, batch_size=128, seed=5, cpus_per_worker=0.5)
    result = fit(
        DigitsPipe,
        hparams={},
        data=digits,
        config=config,
        pipeline=PipelineConfig(stages=2, micro_batches=4, schedule="1f1b", balance=(2,)),
        checkpoint_uri=str(tmp_path / "model"),
    )
    x, y = (torch.from_numpy(a) for a in read_split(digits.dataset_url, "train", digits.schema))
    torch.manual_seed(config.seed)
    expected = unsplit_training(DigitsPipe(), x, y, config)
    assert relative_difference(result.state_dict, expected) < 1e-5
    assert set(result.metrics) == {"train_loss", "val_loss", "val_accuracy"}
    module, checkpoint = load_model(result.checkpoint, allowed=DigitsPipe)  # the whole model
    assert relative_difference(module.state_dict(), expected) < 1e-5
    assert checkpoint.meta["partition"] == [["net.0", "net.1"], ["net.2"]]


def test_two_replicas_of_two_stages_match_the_unsplit_model(tmp_path):
    data = toy_data(samples=70)  # batches of 24: the last global batch (22) splits 11 + 11
    config = TrainConfig(workers=2, epochs=2, batch_size=24, seed=2, cpus_per_worker=0.5)
    result = fit(
        ToyNet,
        hparams={},
        data=data,
        config=config,
        pipeline=PipelineConfig(stages=2, micro_batches=3, schedule="gpipe"),
        checkpoint_uri=str(tmp_path / "model"),
    )
    torch.manual_seed(config.seed)
    expected = unsplit_training(ToyNet(), *data.splits["train"], config)
    assert relative_difference(result.state_dict, expected) < 1e-5


def test_a_stage_that_dies_beyond_the_failure_budget_fails_the_run_naming_it(tmp_path):
    config = TrainConfig(
        workers=1,
        epochs=1,
        batch_size=8,
        cpus_per_worker=0.5,
        collective_timeout_s=5,
        max_failures=0,
    )
    died = "max_failures=0; last: replica-0-stage-1 lost during train_steps: its process died"
    with pytest.raises(EngineError, match=died):
        fit(
            DiesInStageOne,
            hparams={},
            data=TensorData(splits=toy_data(samples=40).splits),
            config=config,
            pipeline=PipelineConfig(stages=2, micro_batches=2),
            checkpoint_uri=str(tmp_path / "model"),
        )


def test_two_replicas_of_two_stages_in_bf16_accumulating_and_clipping_match_data_parallel(
    tmp_path,
):
    """2 replicas x 2 stages in bf16-mixed, stepping every second batch and clipping by the
    whole model's norm, end where 2 data-parallel workers do on the same global batches
    (each replica's part of a batch is the part a worker holds: autocast rounds each part's
    weight gradient alike; docs/pipeline.md)."""
    options = {"precision": "bf16-mixed", "workers": 2, "cpus_per_worker": 0.5}
    replicas = test_pipeline._fit_toy(
        tmp_path, "replicas", pipeline=PipelineConfig(stages=2, micro_batches=1), **options
    )
    workers = test_pipeline._fit_toy(tmp_path, "workers", **options)
    assert relative_difference(replicas.state_dict, workers.state_dict) < 1e-5
    one = test_pipeline._fit_toy(tmp_path, "one", precision="bf16-mixed")
    assert relative_difference(workers.state_dict, one.state_dict) < 1e-3  # bf16's rounding


class PacedToyNet(ToyNet):
    """Steps that wait as if on an accelerator, leaving the CPUs free: on this 2-core
    machine a replacement replica can only start while the others wait."""

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return super().pipeline_loss(out, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Steps small enough that the rounding of other splits of a batch (2 replicas'
        # parts, or 1 replica's) stays rounding over 480 steps: with Adam, or a larger
        # momentum, the toy model amplifies it (1e-4 and more, whichever the layout).
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.5)


def test_a_replica_that_loses_a_stage_leaves_the_other_going_on_and_a_new_one_joins(tmp_path):
    """One stage worker of 2 replicas x 2 stages killed mid-epoch: its replica leaves, the
    other rolls back to the last commit and goes on alone (min_workers=1), a new replica
    joins at a later commit, and the run ends where the uninterrupted one does."""
    from tests.test_elastic import _strike

    def run(name: str, **options):
        return fit(
            PacedToyNet,
            hparams={},
            data=toy_data(samples=96),
            config=TrainConfig(
                workers=2,
                epochs=120,
                batch_size=24,
                seed=2,
                cpus_per_worker=0.5,
                collective_timeout_s=KILLED_PEER_DEADLINE_S,
                commit_every=2,
                min_workers=1,
            ),
            pipeline=PipelineConfig(stages=2, micro_batches=2),
            checkpoint_uri=str(tmp_path / name),
            **options,
        )

    reference = run("reference")
    on_epoch, struck = _strike(signal.SIGKILL, after_epoch=1, delay_s=0.05)
    result = run("elastic", on_epoch=on_epoch)
    assert struck, "no worker was killed"
    kinds = [e.kind for e in result.events]
    assert kinds[:2] == ["lost", "rollback"], result.events
    assert "recovered" in kinds
    assert "joined" in kinds, result.events
    assert result.events[kinds.index("joined")].workers == 2  # replicas
    assert relative_difference(result.state_dict, reference.state_dict) < 1e-5


class _LateOnce(nn.Module):
    """A layer whose sixth call takes longer than the collective deadline, once per marker."""

    def __init__(self, layer: nn.Module, marker: str) -> None:
        super().__init__()
        self.layer, self.marker, self.calls = layer, marker, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 6 and not os.path.exists(self.marker):
            with open(self.marker, "w") as late:
                late.write(str(time.time()))
            time.sleep(4.0)  # past the 3 s deadline, back before the margin after it ends
        return self.layer(x)


class LateFirstStage(ToyNet):
    def __init__(self, *, marker: str, **hparams) -> None:
        super().__init__(**hparams)
        self.inp = _LateOnce(self.inp, marker)


def test_two_stages_that_blame_each_other_for_a_deadline_both_go_on(tmp_path):
    """Stage 1 gives up waiting for stage 0's activation; stage 0, late but alive, then finds
    the link closed: each blames the other and both answer. Nobody is lost (before, both
    were, and the run ended "every worker was lost"): the replica rolls back to its commit
    and ends where a run on time does."""
    marker = tmp_path / "late"

    def run(name: str):
        return fit(
            LateFirstStage,
            hparams={"marker": str(marker)},
            data=toy_data(samples=96),
            config=TrainConfig(
                workers=1,
                epochs=3,
                batch_size=24,
                seed=2,
                collective_timeout_s=3.0,
                commit_every=2,
            ),
            pipeline=PipelineConfig(stages=2, micro_batches=2),
            checkpoint_uri=str(tmp_path / name),
        )

    marker.touch()  # on time
    reference = run("reference")
    marker.unlink()
    result = run("stalled")
    assert marker.exists(), "stage 0 was never late"
    kinds = [e.kind for e in result.events]
    assert kinds[:3] == ["stalled", "rollback", "recovered"], result.events
    assert "was late during train_steps" in result.events[0].cause
    for name, tensor in reference.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name
