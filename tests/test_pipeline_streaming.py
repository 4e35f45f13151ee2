"""Pipeline stages stream their rows of every batch: the first and last stages read them from
the row groups (the stages between read none), and training ends with the weights of reading
whole splits, bit for bit, also across a mid-epoch resume."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ringflow.engine import DataSpec, TrainConfig, fit
from ringflow.engine.data import layout_of
from ringflow.engine.pipeline import PipelineConfig, StagePlan, check_pipeline
from ringflow.engine.pipeline.data import SplitShape, first_rows, stage_split
from ringflow.engine.worker import Worker, epoch_batches
from ringflow.models.digits import SCHEMA, write_digits_csv
from ringflow.storage import CheckpointStore, dataset
from ringflow.storage.dataset import preprocess
from ringflow.storage.stream import SplitStream

# Three stages, so that one (the middle) reads no rows; windows of 3 of the 15 row groups.
PIPELINE = PipelineConfig(stages=3, micro_batches=4, schedule="1f1b", balance=(2, 4))
WINDOW = 3


class DigitsPipe(nn.Module):
    """An MLP over the digits' 64 pixels as a five-layer sequence."""

    def __init__(self, *, hidden: int = 32, lr: float = 0.005) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(64, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, 10),
        )

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target)

    def pipeline_metrics(self, out: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"accuracy": (out.argmax(dim=1) == target).float().mean()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return CrashingAdam(self.parameters(), lr=self.lr)


class CrashingAdam(torch.optim.Adam):
    """Adam that raises at its step ``crash_at`` (counted from 0), when that is set: every
    stage's optimizer raises at the same step, as a run whose processes all die there."""

    crash_at: int | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def step(self, closure=None):
        if self.steps == CrashingAdam.crash_at:
            raise RuntimeError("crashed mid-epoch")
        self.steps += 1
        return super().step(closure)


@pytest.fixture(scope="module")
def sharded_digits(tmp_path_factory):
    """The digits preprocessed in shards of 100 rows: 15 row groups in the training split."""
    root = str(tmp_path_factory.mktemp("sharded-digits"))
    write_digits_csv(f"{root}/raw/digits.csv")
    return preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0, rows_per_shard=100)


def _digits(result, stream: bool) -> DataSpec:
    return DataSpec(
        dataset_url=result.dataset_url, schema=SCHEMA, stream=stream, shuffle_window=WINDOW
    )


def _fit(data: DataSpec, tmp_path, name: str, **kwargs):
    config = TrainConfig(workers=1, epochs=3, batch_size=64, seed=5, checkpoint_every=4)
    return fit(
        DigitsPipe,
        hparams={},
        data=data,
        config=config,
        pipeline=PIPELINE,
        checkpoint_uri=str(tmp_path / name),
        in_process=True,
        **kwargs,
    )


def test_reading_stages_stream_and_the_others_see_only_the_layout(sharded_digits):
    streamed = stage_split(_digits(sharded_digits, True), "train", reads_rows=True)
    whole = stage_split(_digits(sharded_digits, False), "train", reads_rows=True)
    middle = stage_split(_digits(sharded_digits, True), "train", reads_rows=False)
    assert isinstance(streamed, SplitStream)
    assert isinstance(middle, SplitShape)
    assert len(layout_of(whole).blocks) == 15
    # The three see one order: the same length and layout (row groups, window).
    assert len(streamed) == len(whole) == len(middle)
    assert layout_of(streamed) == layout_of(whole) == middle.layout
    x, y = first_rows(_digits(sharded_digits, True), 5)
    assert torch.equal(x, whole.x[:5])
    assert torch.equal(y, whole.y[:5])
    streamed.close()


def test_streaming_stages_end_with_the_weights_of_whole_split_stages(
    sharded_digits, tmp_path, monkeypatch
):
    reference = _fit(_digits(sharded_digits, False), tmp_path, "whole")
    read_whole = []
    real = dataset.read_split

    def read_split(dataset_url, split, *args, **kwargs):
        read_whole.append(split)
        return real(dataset_url, split, *args, **kwargs)

    monkeypatch.setattr(dataset, "read_split", read_split)
    streamed = _fit(_digits(sharded_digits, True), tmp_path, "streamed")
    assert read_whole == []  # no stage read a split whole
    assert streamed.state_dict.keys() == reference.state_dict.keys()
    for name, tensor in reference.state_dict.items():
        assert torch.equal(streamed.state_dict[name], tensor), name
    assert [h.metrics for h in streamed.history] == [h.metrics for h in reference.history]
    assert set(streamed.metrics) == {"train_loss", "val_loss", "val_accuracy"}


def test_a_streamed_pipeline_resumed_mid_epoch_ends_as_the_whole_split_run(
    sharded_digits, tmp_path
):
    reference = _fit(_digits(sharded_digits, False), tmp_path, "reference")
    steps = -(-len(stage_split(_digits(sharded_digits, False), "train", reads_rows=False)) // 64)
    store = CheckpointStore(str(tmp_path / "store"))
    CrashingAdam.crash_at = steps + steps // 2 + 1  # mid-epoch 1, past a checkpoint
    try:
        with pytest.raises(Exception, match="crashed mid-epoch"):
            _fit(
                _digits(sharded_digits, True),
                tmp_path,
                "crashed",
                store_url=store.url,
                run_key="r",
            )
    finally:
        CrashingAdam.crash_at = None
    latest = store.latest("r")
    assert latest is not None
    assert steps < latest.step < 2 * steps  # mid-epoch 1
    resumed = _fit(
        _digits(sharded_digits, True), tmp_path, "resumed", store_url=store.url, run_key="r"
    )
    assert resumed.resumed_from == latest.step
    for name, tensor in reference.state_dict.items():
        assert torch.equal(resumed.state_dict[name], tensor), name


@pytest.mark.parametrize("replica", [0, 1])
def test_each_replica_streams_its_part_of_every_batch_into_its_micro_batches(
    sharded_digits, replica
):
    """Replica ``replica`` of 2: its first and last stages build, streamed, the micro-batches
    they build from the whole split, in chunks of steps and after a rollback."""
    config = TrainConfig(workers=2, batch_size=64, seed=2)
    pipeline = PipelineConfig(stages=3, micro_batches=3, balance=(2, 4))
    data = _digits(sharded_digits, False)
    partition = check_pipeline(DigitsPipe, hparams={}, data=data, config=config, pipeline=pipeline)

    def worker(stream: bool, stage: int) -> Worker:
        return Worker(
            DigitsPipe,
            hparams={},
            data=_digits(sharded_digits, stream),
            config=config,
            rank=replica,
            plan=StagePlan(pipeline, partition, stage),
        )

    for stage in (0, 2):
        streamed, whole = worker(True, stage), worker(False, stage)
        assert isinstance(streamed.train, SplitStream)
        steps = streamed.epoch_steps()
        for epoch, first, count in [(0, 0, 9), (0, 9, steps - 9), (1, 0, 12), (1, 5, 4)]:
            for _, mine, size in epoch_batches(
                streamed.train,
                config,
                epoch=epoch,
                first=first,
                count=count,
                rank=replica,
                world_size=2,
                device=torch.device("cpu"),
            ):
                got = streamed.step._micro_batches(streamed.train, mine, size)
                expected = whole.step._micro_batches(whole.train, mine, size)
                assert streamed.train._plans, "read outside the reader's plan"
                assert got.sizes == expected.sizes
                assert len(got.sizes) == 3
                if stage == 0:  # the first stage's inputs, the last one's targets
                    ours, theirs = got.inputs, expected.inputs
                else:
                    ours, theirs = got.targets, expected.targets
                assert all(map(torch.equal, ours, theirs))
        streamed.close()
    middle = worker(True, 1)
    assert isinstance(middle.train, SplitShape)
    assert middle.epoch_steps() == steps


def test_a_stages_steps_fail_when_its_replicas_all_reduce_failed_after_its_wait(sharded_digits):
    """On GPUs a replica all-reduce may fail on the device after its wait returned: the steps
    then raise its error, so no checkpoint is taken of what it left."""
    from ringflow.engine.errors import PeerLostError

    config = TrainConfig(workers=2, batch_size=64, seed=2)
    data = _digits(sharded_digits, False)
    partition = check_pipeline(DigitsPipe, hparams={}, data=data, config=config, pipeline=PIPELINE)
    worker = Worker(
        DigitsPipe,
        hparams={},
        data=data,
        config=config,
        rank=0,
        plan=StagePlan(PIPELINE, partition, 2),
    )

    class FailedOnTheDevice:
        def check(self) -> None:
            raise PeerLostError("replica 1 is lost", peer=1, op="allreduce", rank=0)

    worker.step.train = lambda batch: 0  # the schedule itself ran
    worker.step.collective = FailedOnTheDevice()
    with pytest.raises(PeerLostError, match="replica 1 is lost"):
        worker.train_steps(0, 0, 2)
