"""``fit`` resumes a killed run from its newest committed checkpoint, bit for bit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.models.digits import DigitsClassifier
from ringflow.storage import CheckpointStorageError, CheckpointStore
from tests.support.fitting import relative_difference

HPARAMS = {"hidden": 64, "lr": 0.01}


def _fit(digits, tmp_path, *, store=None, run_key=None, name="model", **config):
    return fit(
        DigitsClassifier,
        hparams=HPARAMS,
        data=digits,
        config=TrainConfig(**{"workers": 1, "epochs": 2, "batch_size": 64, "seed": 5, **config}),
        checkpoint_uri=str(tmp_path / name),
        in_process=config.get("workers", 1) == 1,
        store_url=store,
        run_key=run_key,
    )


def _assert_same_run(resumed, reference):
    assert resumed.state_dict.keys() == reference.state_dict.keys()
    for name, tensor in reference.state_dict.items():
        assert torch.equal(resumed.state_dict[name], tensor), name
    assert [m.metrics for m in resumed.history] == [m.metrics for m in reference.history]


_CHILD = textwrap.dedent(
    """
    import sys
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.models.digits import SCHEMA, DigitsClassifier

    dataset, store, out = sys.argv[1:4]
    fit(
        DigitsClassifier,
        hparams={hparams!r},
        data=DataSpec(dataset_url=dataset, schema=SCHEMA),
        config=TrainConfig(workers=1, epochs={epochs}, batch_size=64, seed=5, checkpoint_every=4),
        checkpoint_uri=out,
        in_process=True,
        store_url=store,
        run_key="killed",
    )
    """
)


def test_a_run_killed_at_random_resumes_to_the_uninterrupted_weights(digits, tmp_path):
    epochs = 30
    reference = _fit(digits, tmp_path, name="reference", epochs=epochs, checkpoint_every=4)
    store = CheckpointStore(str(tmp_path / "store"))
    steps_per_epoch = -(-1438 // 64)
    rng = random.Random(11)
    for attempt in range(3):  # the kill must land mid-training; retry if the child outran it
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CHILD.format(hparams=HPARAMS, epochs=epochs),
                digits.dataset_url,
                store.url,
                str(tmp_path / f"killed-{attempt}"),
            ],
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        deadline = time.monotonic() + 120
        while not store.checkpoints("killed") and time.monotonic() < deadline:
            assert child.poll() is None, "the training child exited before its first checkpoint"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        child.wait()
        latest = store.latest("killed")
        if latest is not None and latest.step < epochs * steps_per_epoch:
            break
    else:
        pytest.fail("three children finished before they could be killed")

    resumed = _fit(
        digits, tmp_path, store=store.url, run_key="killed", epochs=epochs, checkpoint_every=4
    )
    assert resumed.resumed_from == latest.step
    _assert_same_run(resumed, reference)


def test_a_finished_run_called_again_trains_nothing(digits, tmp_path):
    store = str(tmp_path / "store")
    first = _fit(digits, tmp_path, store=store, run_key="done", checkpoint_every=5)
    again = _fit(digits, tmp_path, store=store, run_key="done", name="again", checkpoint_every=5)
    assert again.resumed_from == 2 * 23
    _assert_same_run(again, first)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(digits, tmp_path, caplog):
    store = CheckpointStore(str(tmp_path / "store"))
    reference = _fit(digits, tmp_path, name="reference", epochs=3)
    _fit(digits, tmp_path, store=store.url, run_key="r", epochs=2)  # commits steps 23 and 46
    newest = store.checkpoints("r")[-1]
    shard = next(iter(newest.shards.values()))
    path = f"{newest.url}/{shard.file}"
    with open(path, "r+b") as f:
        f.seek(shard.size // 2)
        byte = f.read(1)
        f.seek(shard.size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = _fit(digits, tmp_path, store=store.url, run_key="r", epochs=3, name="resumed")
    assert resumed.resumed_from == 23
    assert shard.file in caplog.text
    _assert_same_run(resumed, reference)


def test_a_checkpoint_of_other_hyperparameters_is_refused(digits, tmp_path):
    store = str(tmp_path / "store")
    _fit(digits, tmp_path, store=store, run_key="r", epochs=1)
    with pytest.raises(ValueError, match="differs from this run"):
        fit(
            DigitsClassifier,
            hparams={**HPARAMS, "lr": 0.02},
            data=digits,
            config=TrainConfig(workers=1, epochs=1, batch_size=64, seed=5),
            checkpoint_uri=str(tmp_path / "other"),
            in_process=True,
            store_url=store,
            run_key="r",
        )


def test_bad_store_arguments_fail_before_training(digits, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    started = time.monotonic()
    with pytest.raises(CheckpointStorageError, match="file"):
        _fit(digits, tmp_path, store=str(blocker / "store"), run_key="r")
    assert time.monotonic() - started < 30
    with pytest.raises(ValueError, match="run_key"):
        _fit(digits, tmp_path, store=str(tmp_path / "store"))
    with pytest.raises(ValueError, match="checkpoint_every"):
        TrainConfig(checkpoint_every=-1)


@pytest.mark.ray
def test_ray_workers_resume_bitwise_and_reshard_to_another_count(ray_session, digits, tmp_path):
    store = str(tmp_path / "store")
    every = {"workers": 2, "checkpoint_every": 10}
    reference = _fit(digits, tmp_path, name="reference", epochs=3, **every)
    # The same run key run for 2 epochs, then extended to 3: it resumes at step 46.
    _fit(digits, tmp_path, store=store, run_key="r", epochs=2, **every)
    resumed = _fit(digits, tmp_path, store=store, run_key="r", epochs=3, name="b", **every)
    assert resumed.resumed_from == 46
    _assert_same_run(resumed, reference)
    # One worker picks up the two workers' checkpoint: same math, another summation order.
    one = _fit(digits, tmp_path, store=store, run_key="r", workers=1, epochs=4, name="c")
    two = _fit(digits, tmp_path, name="d", workers=2, epochs=4)
    assert one.resumed_from == 69
    assert relative_difference(one.state_dict, two.state_dict) < 1e-5
