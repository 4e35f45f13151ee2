"""Workers stream their part of every batch from the row groups: the same batches, and the same
weights, as reading whole splits, also across a mid-epoch resume and a lost worker."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from bench.make_parquet import write_dataset
from ringflow.engine import DataSpec, TrainConfig, fit
from ringflow.engine.data import EpochOrder, Layout
from ringflow.engine.worker import epoch_batches
from ringflow.models.digits import SCHEMA, DigitsClassifier, write_digits_csv
from ringflow.storage import CheckpointStore
from ringflow.storage.dataset import DataError, preprocess
from tests.support.fitting import KILLED_PEER_DEADLINE_S

HPARAMS = {"hidden": 32, "lr": 0.01}


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    """Shards of several row groups of uneven sizes (the last of each split is short)."""
    root = str(tmp_path_factory.mktemp("layered"))
    return write_dataset(root, rows=2000, features=6, classes=3, rows_per_group=70)


@pytest.fixture(scope="module")
def sharded_digits(tmp_path_factory):
    """The digits preprocessed in shards of 100 rows: 15 row groups in the training split."""
    root = str(tmp_path_factory.mktemp("sharded-digits"))
    write_digits_csv(f"{root}/raw/digits.csv")
    return preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0, rows_per_shard=100)


def _digits(result, stream):
    return DataSpec(dataset_url=result.dataset_url, schema=SCHEMA, stream=stream)


def test_one_block_is_shuffled_by_the_seeded_permutation_of_the_split():
    order = EpochOrder(Layout((300,)), seed=5, epoch=3, batch_size=64)
    expected = torch.randperm(300, generator=torch.Generator().manual_seed(8))
    assert torch.equal(torch.cat([order.batch(s) for s in range(order.steps)]), expected)


def test_blocks_are_shuffled_then_rows_within_windows_and_batches_grouped_by_block():
    blocks = (100, 37, 100, 0, 64, 5, 90)
    ends = torch.cumsum(torch.tensor(blocks), 0)
    order = EpochOrder(Layout(blocks, 2), seed=1, epoch=0, batch_size=32)
    batches = [order.batch(s) for s in range(order.steps)]
    rows = torch.cat(batches)
    assert torch.equal(rows.sort().values, torch.arange(sum(blocks)))
    assert not torch.equal(rows, torch.arange(sum(blocks)))
    block_of = torch.searchsorted(ends, rows, right=True)
    window_of = {b: w for w, pair in enumerate(order._windows) for b in pair.tolist()}
    windows = [{window_of[b] for b in blocks.tolist()} for blocks in block_of.split(32)]
    for this, following in zip(windows, windows[1:], strict=False):  # windows follow each other
        assert max(this) <= min(following)
    for batch in batches:  # each block's rows are together in a batch
        changes = (torch.diff(torch.searchsorted(ends, batch, right=True)) != 0).sum()
        assert changes + 1 == len(torch.unique(torch.searchsorted(ends, batch, right=True)))
    again = EpochOrder(Layout(blocks, 2), seed=1, epoch=1, batch_size=32)
    assert not torch.equal(torch.cat([again.batch(s) for s in range(again.steps)]), rows)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_stream_gives_each_rank_the_rows_of_the_whole_split(layered, world_size):
    config = TrainConfig(workers=world_size, batch_size=50, seed=3)
    whole = DataSpec(dataset_url=layered, stream=False, shuffle_window=3).samples("train")
    assert len(whole.layout.blocks) > 20
    for rank in range(world_size):
        stream = DataSpec(dataset_url=layered, stream=True, shuffle_window=3).samples("train")
        assert stream.layout == whole.layout
        steps = -(-len(stream) // config.batch_size)
        # In chunks, as the group calls workers, with a rollback to step 7 in epoch 1.
        for epoch, first, count in [(0, 0, 10), (0, 10, steps - 10), (1, 0, 12), (1, 7, 9)]:
            for _, mine, _ in epoch_batches(
                stream,
                config,
                epoch=epoch,
                first=first,
                count=count,
                rank=rank,
                world_size=world_size,
                device=torch.device("cpu"),
            ):
                streamed, read = stream.batch(mine), whole.batch(mine)
                assert torch.equal(streamed[0], read[0])
                assert torch.equal(streamed[1], read[1])
                # Bounded memory: the row groups of about two windows, never the split.
                assert len(stream._cache) <= 2 * 3 + 2
        stream.close()


def test_a_row_group_whose_bytes_changed_is_refused_when_streamed(tmp_path):
    url = write_dataset(str(tmp_path), rows=600, features=3, classes=2, rows_per_group=50)
    with open(f"{url}/_manifest.json") as f:
        entry = next(e for e in json.load(f)["files"] if e["path"] == "train/part-00000.parquet")
    group = entry["row_groups"][1]
    with open(f"{url}/train/part-00000.parquet", "r+b") as f:  # same size, one byte flipped
        f.seek(group["offset"] + group["size"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    stream = DataSpec(dataset_url=url, stream=True).samples("train")
    assert len(stream.batch(torch.arange(50))[1]) == 50  # row group 0 is intact
    with pytest.raises(DataError, match=r"row group 1 of shard .*train/part-00000.parquet"):
        stream.batch(torch.arange(50, 100))


def test_streamed_training_ends_with_the_weights_of_whole_split_training(sharded_digits, tmp_path):
    runs = {
        stream: fit(
            DigitsClassifier,
            hparams=HPARAMS,
            data=_digits(sharded_digits, stream),
            config=TrainConfig(workers=1, epochs=2, batch_size=64, seed=5),
            checkpoint_uri=str(tmp_path / f"model-{stream}"),
            in_process=True,
        )
        for stream in (True, False)
    }
    for name, tensor in runs[False].state_dict.items():
        assert torch.equal(runs[True].state_dict[name], tensor), name
    assert [m.metrics for m in runs[True].history] == [m.metrics for m in runs[False].history]


class CrashingDigits(DigitsClassifier):
    """Raises at global step ``crash_at`` (the process dying mid-epoch), when it is set."""

    crash_at: int | None = None

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.crash_at:
            raise RuntimeError("crashed mid-epoch")
        return super().training_step(batch, batch_idx)


def test_a_streamed_run_resumed_mid_epoch_ends_as_the_whole_split_run(sharded_digits, tmp_path):
    config = TrainConfig(workers=1, epochs=3, batch_size=64, seed=5, checkpoint_every=4)
    reference = fit(
        CrashingDigits,
        hparams=HPARAMS,
        data=_digits(sharded_digits, False),
        config=config,
        checkpoint_uri=str(tmp_path / "reference"),
        in_process=True,
    )
    store = CheckpointStore(str(tmp_path / "store"))
    CrashingDigits.crash_at = 23 + 15  # epoch 1, step 15 of 23
    try:
        with pytest.raises(Exception, match="crashed mid-epoch"):
            fit(
                CrashingDigits,
                hparams=HPARAMS,
                data=_digits(sharded_digits, True),
                config=config,
                checkpoint_uri=str(tmp_path / "crashed"),
                in_process=True,
                store_url=store.url,
                run_key="r",
            )
    finally:
        CrashingDigits.crash_at = None
    latest = store.latest("r")
    assert latest is not None
    assert 23 < latest.step < 2 * 23  # mid-epoch 1
    resumed = fit(
        CrashingDigits,
        hparams=HPARAMS,
        data=_digits(sharded_digits, True),
        config=config,
        checkpoint_uri=str(tmp_path / "resumed"),
        in_process=True,
        store_url=store.url,
        run_key="r",
    )
    assert resumed.resumed_from == latest.step
    for name, tensor in reference.state_dict.items():
        assert torch.equal(resumed.state_dict[name], tensor), name


@pytest.mark.ray
def test_a_streamed_run_that_loses_a_worker_ends_as_the_whole_split_run(
    ray_session, sharded_digits, tmp_path
):
    from tests.test_elastic import _strike

    def run(stream, on_epoch=None):
        return fit(
            DigitsClassifier,
            hparams=HPARAMS,
            data=_digits(sharded_digits, stream),
            config=TrainConfig(
                workers=2,
                epochs=4,
                batch_size=64,
                seed=2,
                cpus_per_worker=0.5,
                collective_timeout_s=KILLED_PEER_DEADLINE_S,
            ),
            checkpoint_uri=str(tmp_path / f"model-{stream}"),
            on_epoch=on_epoch,
        )

    reference = run(False)
    on_epoch, struck = _strike(signal.SIGKILL, after_epoch=1, delay_s=0.0)
    result = run(True, on_epoch)
    assert struck, "no worker was killed"
    assert [e.kind for e in result.events] == ["lost", "rollback", "joined", "recovered"]
    for name, tensor in reference.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name
