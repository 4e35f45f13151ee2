"""A ``ray.data.Dataset`` as training input: each worker reads its ``streaming_split``; the
same worker count and seed give the same weights, bit for bit, also across a mid-epoch resume
from a checkpoint; the digits train as well as from Parquet."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ringflow.engine import DataSpec, TrainConfig, fit
from ringflow.engine.data import as_data
from ringflow.engine.ray_data import RayDatasetData, SplitOrder
from ringflow.models.digits import SCHEMA, DigitsClassifier
from ringflow.storage import CheckpointStore
from tests.support.fitting import KILLED_PEER_DEADLINE_S

pytestmark = pytest.mark.ray

HPARAMS = {"hidden": 32, "lr": 0.01}
CONFIG = TrainConfig(workers=2, epochs=2, batch_size=64, seed=7, cpus_per_worker=0.5)
CRASH_AT = Path(tempfile.gettempdir()) / "ringflow-test-ray-dataset-crash-step"
"""The global step :class:`CrashingDigits` raises at, while the file exists (Ray workers
import this module afresh: a class attribute set here would not reach them)."""


class CrashingDigits(DigitsClassifier):
    """The digits model, raising at the step that ``CRASH_AT`` names (a process dying)."""

    def training_step(self, batch, batch_idx):
        if CRASH_AT.exists() and self.trainer.global_step == int(CRASH_AT.read_text()):
            raise RuntimeError("crashed mid-epoch")
        return super().training_step(batch, batch_idx)


def _rows(spec: DataSpec, split: str) -> list[dict]:
    """The split as Ray rows: one column per schema column."""
    x, y = spec.read(split)
    names = [c.name for c in SCHEMA.features]
    return [
        {**dict(zip(names, map(float, row), strict=True)), "label": int(label)}
        for row, label in zip(x.numpy(), y.numpy(), strict=True)
    ]


@pytest.fixture(scope="module")
def digit_rows(digits):
    return {split: _rows(digits, split) for split in ("train", "validation")}


def _data(ray, digit_rows) -> RayDatasetData:
    return RayDatasetData(
        train=ray.data.from_items(digit_rows["train"]),
        validation=ray.data.from_items(digit_rows["validation"]),
        schema=SCHEMA,
        shuffle="blocks",
    )


def _fit(data, tmp_path, name, module=DigitsClassifier, **kwargs):
    return fit(
        module,
        hparams=HPARAMS,
        data=data,
        config=kwargs.pop("config", CONFIG),
        checkpoint_uri=str(tmp_path / name),
        **kwargs,
    )


@pytest.fixture(scope="module")
def ray_run(ray_session, digit_rows, tmp_path_factory):
    return _fit(_data(ray_session, digit_rows), tmp_path_factory.mktemp("ray-run"), "model")


@pytest.mark.parametrize("rows", [10, 1025, 1437])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_each_rank_reads_its_whole_split_in_order_in_parts_differing_by_one_row(rows, world_size):
    order = SplitOrder(rows, 4 * world_size + 1, world_size)
    taken = [0] * world_size
    for step in range(order.steps):
        batch = order.batch(step)
        assert len(batch) > 0
        parts = [order.part(batch, rank=r, world_size=world_size) for r in range(world_size)]
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        for rank, part in enumerate(parts):
            assert order.before(step, rank) == taken[rank]
            rows_read = [order.row(int(p)) for p in part]
            assert rows_read == list(range(taken[rank], taken[rank] + len(part)))
            taken[rank] += len(part)
    assert taken == [rows // world_size] * world_size  # Ray's equal split, every row of it


def test_training_from_a_ray_dataset_reaches_the_accuracy_of_parquet(ray_run, digits, tmp_path):
    # The Parquet path's weights do not depend on its worker count: one, in this process.
    one = dataclasses.replace(CONFIG, workers=1, cpus_per_worker=1.0)
    parquet = _fit(digits, tmp_path, "parquet", config=one, in_process=True)
    ours, theirs = ray_run.metrics["val_accuracy"], parquet.metrics["val_accuracy"]
    assert ours > 0.9
    assert ours >= theirs - 0.03, (ours, theirs)


def test_same_workers_and_seed_give_the_same_weights_bit_for_bit_across_a_mid_epoch_resume(
    ray_session, ray_run, digit_rows, tmp_path
):
    """A second run with the same workers and seed crashes in epoch 1 and resumes from its
    checkpoint there: it ends with the first run's weights and metrics, bit for bit."""
    config = dataclasses.replace(CONFIG, checkpoint_every=4)
    store = CheckpointStore(str(tmp_path / "store"))
    steps = -(-len(digit_rows["train"]) // CONFIG.batch_size)
    checkpoint = (steps // 4 + 1) * 4  # the first checkpoint of epoch 1, past its first step
    CRASH_AT.write_text(str(checkpoint + 2))
    try:
        with pytest.raises(Exception, match="crashed mid-epoch"):
            _fit(
                _data(ray_session, digit_rows),
                tmp_path,
                "crashed",
                CrashingDigits,
                config=config,
                store_url=store.url,
                run_key="r",
            )
    finally:
        CRASH_AT.unlink()
    latest = store.latest("r")
    assert latest is not None
    assert latest.step == checkpoint
    assert steps < checkpoint < 2 * steps - 2  # mid-epoch 1
    resumed = _fit(
        _data(ray_session, digit_rows),
        tmp_path,
        "resumed",
        CrashingDigits,
        config=config,
        store_url=store.url,
        run_key="r",
    )
    assert resumed.resumed_from == checkpoint
    for name, tensor in ray_run.state_dict.items():
        assert torch.equal(resumed.state_dict[name], tensor), name
    assert [m.metrics for m in resumed.history] == [m.metrics for m in ray_run.history]


def test_a_bare_dataset_trains_with_its_columns_as_a_dict_and_no_validation(ray_session, tmp_path):
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    dataset = ray_session.data.from_numpy(x)
    data = as_data(dataset)
    assert isinstance(data, RayDatasetData)
    data.prepare()
    seen = []
    samples = data.samples("train")
    config = TrainConfig(workers=1, batch_size=8, seed=0)
    from ringflow.engine.worker import epoch_batches

    for _, mine, _ in epoch_batches(
        samples, config, epoch=0, first=0, count=3, rank=0, world_size=1, device=torch.device("cpu")
    ):
        batch = samples.batch(mine)
        assert set(batch) == {"data"}
        seen.append(batch["data"])
    assert torch.equal(torch.cat(seen), torch.from_numpy(x))  # Ray's order, preserved
    assert len(data.samples("validation")) == 0
    one_row = RayDatasetData(train=ray_session.data.from_numpy(x[:1]))
    one_row.prepare()
    with pytest.raises(ValueError, match="has 1 rows, fewer than the 2 workers"):
        next(
            epoch_batches(
                one_row.samples("train"),
                TrainConfig(workers=2, batch_size=8),
                epoch=0,
                first=0,
                count=1,
                rank=0,
                world_size=2,
                device=torch.device("cpu"),
            )
        )


def test_what_is_not_supported_is_refused_before_training(ray_session, digit_rows, tmp_path):
    from ringflow.engine.pipeline.config import PipelineConfig

    dataset = ray_session.data.from_items(digit_rows["validation"])
    with pytest.raises(ValueError, match="not a ray.data.Dataset"):
        RayDatasetData(train=dataset, validation=[1, 2])
    with pytest.raises(ValueError, match="shuffle must be one of"):
        RayDatasetData(train=dataset, shuffle="random")
    with pytest.raises(ValueError, match="a schema .* or a collate_fn"):
        RayDatasetData(train=dataset, schema=SCHEMA, collate_fn=lambda b: b)
    with pytest.raises(ValueError, match="pipeline stages train on tables"):
        _fit(dataset, tmp_path, "pipelined", pipeline=PipelineConfig(stages=2))
    renamed = dataset.rename_columns({"p3": "pixel3"})
    with pytest.raises(ValueError, match=r"train has no column \['p3'\] of the schema"):
        _fit(RayDatasetData(train=renamed, schema=SCHEMA), tmp_path, "renamed")


class DyingDigits(DigitsClassifier):
    """Rank 1's process exits at the step that ``CRASH_AT`` names, once (it removes the file)."""

    def training_step(self, batch, batch_idx):
        dies = self.trainer.global_rank == 1 and CRASH_AT.exists()
        if dies and self.trainer.global_step == int(CRASH_AT.read_text()):
            CRASH_AT.unlink()
            os._exit(1)
        return super().training_step(batch, batch_idx)


def test_a_lost_worker_rolls_back_and_the_rest_of_the_epoch_is_split_again(
    ray_session, digit_rows, tmp_path
):
    """Not bit for bit (the survivor's split differs): a worker lost mid-epoch rolls the
    survivor back to the commit there, and the rest of the epoch is split again for one worker,
    whose reader skips what the steps before the commit took; the run goes on and learns."""
    steps = -(-len(digit_rows["train"]) // CONFIG.batch_size)
    commit = (steps // CONFIG.commit_every + 1) * CONFIG.commit_every  # mid-epoch 1
    CRASH_AT.write_text(str(commit + 2))
    config = dataclasses.replace(CONFIG, min_workers=1, collective_timeout_s=KILLED_PEER_DEADLINE_S)
    try:
        result = _fit(
            _data(ray_session, digit_rows), tmp_path, "elastic", DyingDigits, config=config
        )
    finally:
        CRASH_AT.unlink(missing_ok=True)
    kinds = [e.kind for e in result.events]
    assert kinds[:3] == ["lost", "rollback", "recovered"], result.events
    assert result.events[1].step == commit
    assert steps < commit < 2 * steps
    assert len(result.history) == CONFIG.epochs
    assert result.metrics["val_accuracy"] > 0.9


def test_a_worker_lost_mid_epoch_and_replaced_ends_with_the_weights_of_no_loss(
    ray_session, ray_run, digit_rows, tmp_path
):
    """Replaced before training goes on (``min_workers=None``), the members split the epoch
    again for the same worker count and read the rows they would have read."""
    steps = -(-len(digit_rows["train"]) // CONFIG.batch_size)
    commit = (steps // CONFIG.commit_every + 1) * CONFIG.commit_every  # mid-epoch 1
    CRASH_AT.write_text(str(commit + 2))
    config = dataclasses.replace(CONFIG, collective_timeout_s=KILLED_PEER_DEADLINE_S)
    try:
        result = _fit(
            _data(ray_session, digit_rows), tmp_path, "replaced", DyingDigits, config=config
        )
    finally:
        CRASH_AT.unlink(missing_ok=True)
    assert [e.kind for e in result.events][:2] == ["lost", "rollback"], result.events
    assert result.events[1].step == commit
    for name, tensor in ray_run.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name
