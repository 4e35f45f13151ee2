"""Weak scaling: a batch per worker, and learning rates that follow the global batch
(``TrainConfig.per_worker_batch_size``, ``lr_scaling``, ``lr_warmup_steps``)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.engine.module import LrScale
from ringflow.models.digits import DigitsClassifier
from tests.test_elastic import _strike

LR = 0.01


class RecordsItsSteps(DigitsClassifier):
    """Writes, at every optimizer step, the learning rates its optimizer holds during the step
    (``on_before_optimizer_step``) and between steps, and the size of its part of the batch;
    two param groups and a step schedule, so the scale is seen on top of both."""

    def __init__(self, out: str, **hparams):
        super().__init__(**hparams)
        self.out = out

    def configure_optimizers(self):
        first, *rest = self.parameters()
        optimizer = torch.optim.SGD([{"params": [first]}, {"params": rest, "lr": LR / 2}], lr=LR)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_batch_start(self, batch, batch_idx):
        self._between = [g["lr"] for g in self.optimizers().optimizer.param_groups]
        self._part = len(batch[1])

    def on_before_optimizer_step(self, optimizer):
        row = {
            "step": self.trainer.global_step,
            "during": [g["lr"] for g in optimizer.param_groups],
            "between": self._between,
            "part": self._part,
        }
        with open(Path(self.out) / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def _rows(out: Path) -> list[list[dict]]:
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in out.iterdir()]


# ---------------------------------------------------------------------------- the rule


def test_the_global_batch_is_the_per_worker_batch_times_the_workers():
    config = TrainConfig(workers=3, per_worker_batch_size=16)
    assert config.batch_size == 48
    assert TrainConfig().batch_size == 64  # neither given: as before
    assert TrainConfig(workers=2, per_worker_batch_size=16, batch_size=32).batch_size == 32
    # Another worker count follows the rule; a fixed global batch stays.
    assert config.with_workers(1).batch_size == 16
    assert TrainConfig(batch_size=48, workers=3).with_workers(1).batch_size == 48
    assert config.with_changes(per_worker_batch_size=8).batch_size == 24


def test_a_search_under_weak_scaling_varies_the_batch_per_worker():
    from ringflow.engine.spec import ModelRef
    from ringflow.tasks.tune import default_space

    model = ModelRef(path="ringflow.models.digits:DigitsClassifier")
    weak = TrainConfig(workers=2, per_worker_batch_size=16)
    space = default_space(model, weak)
    assert space["per_worker_batch_size"] == [8, 16, 32]
    assert "batch_size" not in space
    assert default_space(model, TrainConfig(batch_size=64))["batch_size"] == [32, 64, 128]


def test_the_learning_rate_factor_follows_the_rule_and_its_reference():
    weak = {"workers": 4, "per_worker_batch_size": 16}
    assert TrainConfig(**weak).lr_factor() == 1.0  # lr_scaling none
    assert TrainConfig(**weak, lr_scaling="linear").lr_factor() == 4.0  # as lr * hvd.size()
    assert TrainConfig(**weak, lr_scaling="sqrt").lr_factor() == 2.0
    fixed = TrainConfig(batch_size=256, lr_scaling="linear", lr_reference_batch=64)
    assert fixed.lr_factor() == 4.0
    assert TrainConfig(**weak, lr_scaling="linear", lr_reference_batch=128).lr_factor() == 0.5


def test_the_warm_up_ramps_linearly_from_the_modules_rate_to_the_factor():
    scale = LrScale(factor=4.0, warmup_steps=3)
    assert [scale.at(step) for step in range(5)] == [1.0, 2.0, 3.0, 4.0, 4.0]
    assert LrScale(factor=0.5).at(0) == 0.5


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"workers": 2, "per_worker_batch_size": 16, "batch_size": 64}, "give one of them"),
        ({"workers": 2, "per_worker_batch_size": 16, "min_workers": 1}, "min_workers"),
        ({"per_worker_batch_size": 0}, "per_worker_batch_size"),
        ({"lr_scaling": "linear"}, "lr_reference_batch"),
        ({"lr_scaling": "cubic", "per_worker_batch_size": 8}, "lr_scaling"),
        ({"per_worker_batch_size": 8, "lr_warmup_steps": -1}, "lr_warmup_steps"),
    ],
)
def test_bad_scaling_settings_fail_before_training(fields, named):
    with pytest.raises(ValueError, match=named):
        TrainConfig(**fields)


# ---------------------------------------------------------------------------- in training


def _expected(step: int, *, factor: float, warmup: int) -> list[float]:
    schedule = [LR * 0.5 ** (step // 5), LR / 2 * 0.5 ** (step // 5)]
    scale = LrScale(factor, warmup).at(step)
    return [lr * scale for lr in schedule], schedule


def _weak(workers: int, digits, tmp_path, **config):
    out = tmp_path / f"steps-{workers}"
    out.mkdir()
    fit(
        RecordsItsSteps,
        hparams={"out": str(out), "hidden": 32, "lr": LR},
        data=digits,
        config=TrainConfig(
            workers=workers,
            per_worker_batch_size=32,
            lr_scaling="linear",
            lr_warmup_steps=8,
            epochs=1,
            seed=3,
            cpus_per_worker=0.5 if workers > 1 else 1.0,
            **config,
        ),
        checkpoint_uri=str(tmp_path / f"model-{workers}"),
        in_process=workers == 1,
    )
    return _rows(out)


def _check(ranks: list[list[dict]], *, workers: int, samples: int) -> None:
    assert len(ranks) == workers
    steps = -(-samples // (32 * workers))
    for rows in ranks:
        assert [r["step"] for r in rows] == list(range(steps))
        for row in rows:
            during, between = _expected(row["step"], factor=workers, warmup=8)
            assert row["during"] == pytest.approx(during, rel=1e-12), row
            assert row["between"] == pytest.approx(between, rel=1e-12), row  # its own schedule
        assert {r["part"] for r in rows[:-1]} == {32}  # every full batch: 32 per worker


def test_one_worker_trains_on_its_own_batch_at_the_modules_learning_rate(digits, tmp_path):
    samples = len(digits.read("train")[1])
    _check(_weak(1, digits, tmp_path), workers=1, samples=samples)


@pytest.mark.ray
def test_two_workers_double_the_global_batch_and_the_learning_rate(ray_session, digits, tmp_path):
    samples = len(digits.read("train")[1])
    _check(_weak(2, digits, tmp_path), workers=2, samples=samples)


# ---------------------------------------------------------------------------- exactness

WEAK = {"per_worker_batch_size": 32, "lr_scaling": "linear", "lr_warmup_steps": 60, "seed": 4}


def _digits_fit(digits, tmp_path, name, *, workers=2, epochs=3, on_epoch=None, **kw):
    return fit(
        DigitsClassifier,
        hparams={"hidden": 32, "lr": LR},
        data=digits,
        config=TrainConfig(
            workers=workers,
            epochs=epochs,
            cpus_per_worker=0.5,
            collective_timeout_s=3.0,
            checkpoint_every=6,
            **WEAK,
        ),
        checkpoint_uri=str(tmp_path / name),
        in_process=workers == 1,
        on_epoch=on_epoch,
        **kw,
    )


def _assert_equal(result, reference):
    for name, tensor in reference.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name


@pytest.mark.ray
def test_a_replaced_worker_and_a_resumed_run_end_as_the_uninterrupted_one(
    ray_session, digits, tmp_path
):
    reference = _digits_fit(digits, tmp_path, "reference")
    # A worker killed mid-run is replaced; the survivors roll back and redo the warm-up's
    # steps at the scale of each step.
    on_epoch, struck = _strike(signal.SIGKILL, after_epoch=0, delay_s=0.0)
    replaced = _digits_fit(digits, tmp_path, "replaced", on_epoch=on_epoch)
    assert struck
    assert [e.kind for e in replaced.events] == ["lost", "rollback", "joined", "recovered"]
    _assert_equal(replaced, reference)
    # The same run key trained 2 epochs, then asked for 3, resumes inside the warm-up.
    store = str(tmp_path / "store")
    _digits_fit(digits, tmp_path, "first", epochs=2, store_url=store, run_key="weak")
    resumed = _digits_fit(digits, tmp_path, "resumed", store_url=store, run_key="weak")
    assert resumed.resumed_from == 46
    _assert_equal(resumed, reference)
    # Another worker count is another global batch: refused, not resumed into.
    with pytest.raises(ValueError, match="batch_size"):
        _digits_fit(digits, tmp_path, "one", workers=1, epochs=4, store_url=store, run_key="weak")
