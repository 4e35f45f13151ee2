"""DP x PP with the data-parallel dimension sharded: ZeRO-1 (``TrainConfig.shard="optimizer"``)
over each stage's replicas, as Ray actors with real gloo rings and links."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.engine.pipeline import PipelineConfig
from ringflow.storage import CheckpointStore
from tests import test_pipeline
from tests.support.fitting import (
    KILLED_PEER_DEADLINE_S,
    relative_difference,
    shipped_by_value,
)
from tests.test_pipeline import EVERY_OPTION, LightningToyNet, toy_data

pytestmark = pytest.mark.ray

STAGES = PipelineConfig(stages=2, micro_batches=2)


@pytest.fixture(scope="module", autouse=True)
def _models_by_value(ray_session):
    with shipped_by_value(ray_session, sys.modules[__name__], test_pipeline):
        yield


class RecordsState(LightningToyNet):
    """Adam (``momentum``: SGD with it); at every loss the last stage writes the bytes of its
    replica's optimizer state (sharded, its shard's: the optimizer ``configure_optimizers``
    made steps the pieces)."""

    def __init__(
        self, *, record: str = "", pace_s: float = 0.0, momentum: float = 0.0, **hparams
    ) -> None:
        super().__init__(**hparams)
        self.record, self.pace_s, self.momentum = record, pace_s, momentum

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.momentum:
            self.made = torch.optim.SGD(self.parameters(), lr=0.02, momentum=self.momentum)
        else:
            self.made = torch.optim.Adam(self.parameters(), lr=0.01)
        return self.made

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(self.pace_s)  # as if on an accelerator: the CPUs stay free
        if self.record and hasattr(self, "made"):
            size = sum(
                value.numel() * value.element_size()
                for entry in self.made.state.values()
                for value in entry.values()
                if isinstance(value, torch.Tensor)
            )
            Path(self.record, str(self.trainer.global_rank)).write_text(str(size))
        return super().pipeline_loss(out, target)


def _fit(
    tmp_path,
    name: str,
    *,
    record: bool = False,
    hparams=None,
    store_url=None,
    run_key=None,
    on_epoch=None,
    **config,
):
    folder = tmp_path / f"state-{name}"
    folder.mkdir(exist_ok=True)
    settings = {
        "workers": 2,
        "epochs": 3,
        "batch_size": 24,
        "seed": 2,
        "cpus_per_worker": 0.5,
        **EVERY_OPTION,
        **config,
    }
    result = fit(
        RecordsState,
        hparams={"width": 32, "record": str(folder) if record else "", **(hparams or {})},
        data=toy_data(samples=96),
        config=TrainConfig(**settings),
        pipeline=STAGES,
        checkpoint_uri=str(tmp_path / name),
        store_url=store_url,
        run_key=run_key,
        on_epoch=on_epoch,
    )
    held = [int((folder / str(r)).read_text()) for r in range(2)] if record else []
    return result, held


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_zero1_over_two_replicas_of_two_stages_ends_where_unsharded_ends_with_half_the_state(
    tmp_path, precision
):
    """2 replicas x 2 stages, Adam, stepping every second batch and clipping by the whole
    model's norm (every step clips): with each replica stepping its shard of its stage's
    parameters the run ends within 1e-6 of ``shard="none"``, and each replica of the last
    stage holds about half of that stage's optimizer state."""
    none, whole = _fit(tmp_path, "none", record=True, precision=precision)
    assert relative_difference(none.state_dict, LightningToyNet(width=32).state_dict()) > 1e-2
    assert whole[0] == whole[1] > 0
    options = {"precision": precision, "shard": "optimizer", "bucket_mb": 0.001}  # cut inside
    sharded, parts = _fit(tmp_path, "sharded", record=True, **options)
    assert relative_difference(sharded.state_dict, none.state_dict) < 1e-6
    assert all(part <= 0.55 * whole[0] for part in parts), (parts, whole)
    assert sum(parts) >= whole[0]  # between them, the whole state (a step count each)
    unclipped, _ = _fit(tmp_path, "unclipped", gradient_clip_val=None, **options)
    assert relative_difference(unclipped.state_dict, sharded.state_dict) > 1e-3
    # A bound the norm never reaches: the shards' norm summed decides, no clip happens.
    loose, _ = _fit(tmp_path, "loose", gradient_clip_val=1e3, **options)
    assert relative_difference(loose.state_dict, unclipped.state_dict) < 1e-6


def test_a_zero1_pipeline_resumes_bitwise_and_its_checkpoint_loads_unsharded(tmp_path):
    """A checkpoint of ZeRO-1 stages holds each stage's whole state, as ``shard="none"``
    writes it (the replicas gather it, replica 0 writes it): the sharded run resumed ends
    bit for bit as the uninterrupted one, and the same checkpoint resumes unsharded to where
    an unsharded run ends."""
    store = str(tmp_path / "store")
    every = {"shard": "optimizer", "checkpoint_every": 2}
    reference, _ = _fit(tmp_path, "reference", **every)
    _fit(tmp_path, "first", store_url=store, run_key="r", **{**every, "epochs": 2})
    assert sorted(CheckpointStore(store).checkpoints("r")[-1].shards) == [
        "stage-00000",
        "stage-00001",
    ]
    resumed, _ = _fit(tmp_path, "resumed", store_url=store, run_key="r", **every)
    assert resumed.resumed_from == 8  # two epochs of 4 batches
    for name, tensor in reference.state_dict.items():
        assert torch.equal(resumed.state_dict[name], tensor), name
    unsharded, _ = _fit(tmp_path, "unsharded", store_url=store, run_key="r", epochs=4)
    assert unsharded.resumed_from == 12
    plain, _ = _fit(tmp_path, "plain", epochs=4)
    assert relative_difference(unsharded.state_dict, plain.state_dict) < 1e-6


def test_a_zero1_replica_lost_goes_on_from_its_neighbours_shard_and_a_new_one_takes_one_back(
    tmp_path,
):
    """One stage worker of 2 ZeRO-1 replicas x 2 stages killed mid-run: the other replica
    rolls back to the last commit, rebuilding the lost replica's shard of the optimizer state
    from the copy its own commit kept (nothing read from storage), goes on alone, a new
    replica joins and takes its shard back, and the run ends where the uninterrupted one
    does."""
    from tests.test_elastic import _strike

    elastic = {
        "shard": "optimizer",
        "epochs": 120,  # long enough for a new replica to start on a busy machine
        "commit_every": 2,
        "min_workers": 1,
        "collective_timeout_s": KILLED_PEER_DEADLINE_S,
        # SGD: Adam amplifies the rounding of another split of a batch (one replica's, for
        # a while) to 1e-4 and more over these steps, sharded or not (test_pipeline_ray's).
        "hparams": {"pace_s": 0.01, "momentum": 0.5},
    }
    reference, _ = _fit(tmp_path, "reference", **elastic)
    on_epoch, struck = _strike(signal.SIGKILL, after_epoch=1, delay_s=0.05)
    result, _ = _fit(tmp_path, "elastic", on_epoch=on_epoch, **elastic)
    assert struck, "no worker was killed"
    kinds = [e.kind for e in result.events]
    assert kinds[:2] == ["lost", "rollback"], result.events
    assert "joined" in kinds, result.events
    assert "recovered" in kinds, result.events
    assert result.resumed_from is None  # from memory, not from a checkpoint
    assert relative_difference(result.state_dict, reference.state_dict) < 1e-5


@pytest.mark.parametrize(
    ("shard", "why"),
    [
        ("gradients", "a stage sums its gradients once a batch, after all its micro-batches"),
        ("parameters", "a stage would gather its weights again at every micro-batch"),
    ],
)
def test_zero2_and_zero3_over_pipeline_stages_are_refused_in_one_line_naming_zero1(
    tmp_path, shard, why
):
    with pytest.raises(ValueError, match=why) as refused:
        _fit(tmp_path, shard, shard=shard)
    assert "shard='optimizer' shards the optimizer state over a stage's replicas" in str(
        refused.value
    )
    assert "\n" not in str(refused.value)
