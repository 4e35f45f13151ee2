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
from ringflow.engine.epochs import Epochs
from ringflow.engine.module import LrScale
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import KILLED_PEER_DEADLINE_S
from tests.test_elastic import _strike

LR = 0.01


class RecordsItsSteps(DigitsClassifier):
    """Writes, at every optimizer step, the learning rates its optimizer holds during the step
    (``on_before_optimizer_step``) and between steps, and the size of its part of the batch;
    two param groups and a step schedule, so the scale is seen on top of both."""

    step_size, gamma = 5, 0.5  # the schedule's

    def __init__(self, out: str, **hparams):
        super().__init__(**hparams)
        self.out = out

    def configure_optimizers(self):
        first, *rest = self.parameters()
        optimizer = torch.optim.SGD([{"params": [first]}, {"params": rest, "lr": LR / 2}], lr=LR)
        schedule = torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=self.step_size, gamma=self.gamma
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_batch_start(self, batch, batch_idx):
        self._between = [g["lr"] for g in self.optimizers().optimizer.param_groups]
        self._part = len(batch[1])
        self._ranks = [*getattr(self, "_ranks", []), self.trainer.global_rank]

    def on_before_optimizer_step(self, optimizer):
        row = {
            "step": self.trainer.global_step,
            "during": [g["lr"] for g in optimizer.param_groups],
            "between": self._between,
            "part": self._part,
            "ranks": self._ranks,  # the ranks whose parts this worker trained in the step
        }
        self._ranks = []
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
        ({"per_worker_batch_size": 0}, "per_worker_batch_size"),
        ({"lr_scaling": "linear"}, "lr_reference_batch"),
        ({"lr_scaling": "cubic", "per_worker_batch_size": 8}, "lr_scaling"),
        ({"per_worker_batch_size": 8, "lr_warmup_steps": -1}, "lr_warmup_steps"),
    ],
)
def test_bad_scaling_settings_fail_before_training(fields, named):
    with pytest.raises(ValueError, match=named):
        TrainConfig(**fields)


def test_epochs_of_different_global_batches_are_counted_both_ways():
    epochs = Epochs(100, (32, 32, 16))  # 4, 4, then 7 steps an epoch
    assert [epochs.steps(e) for e in range(5)] == [4, 4, 7, 7, 7]
    assert [epochs.start(e) for e in range(5)] == [0, 4, 8, 15, 22]
    assert [epochs.locate(s) for s in (0, 3, 4, 8, 14, 15, 23)] == [
        (0, 0),
        (0, 3),
        (1, 0),
        (2, 0),
        (2, 6),
        (3, 0),
        (4, 1),
    ]
    # A later epoch decided again (a rollback to its start) forgets what followed it.
    assert epochs.decided(1, 64).batches == (32, 64)
    assert epochs.decided(4, 8).batches == (32, 32, 16, 16, 8)
    # Optimizer steps with accumulation: windows start at each epoch's start.
    accumulating = Epochs(100, (32, 16), accumulate=2)
    assert [accumulating.optimizer_start(e) for e in range(4)] == [0, 2, 6, 10]
    # One global batch: the arithmetic of epochs of equal length.
    fixed = Epochs(100, (32,))
    assert all(fixed.locate(s) == divmod(s, 4) for s in range(50))
    assert [fixed.start(e) for e in range(5)] == [0, 4, 8, 12, 16]


def test_the_batch_follows_the_workers_only_under_weak_scaling_with_elastic_workers():
    assert TrainConfig(workers=2, per_worker_batch_size=16, min_workers=1).batch_follows_workers
    assert not TrainConfig(workers=2, per_worker_batch_size=16).batch_follows_workers
    assert not TrainConfig(workers=2, batch_size=32, min_workers=1).batch_follows_workers


def test_pipeline_stages_refuse_a_batch_that_follows_the_workers():
    from ringflow.engine.pipeline import PipelineConfig
    from ringflow.engine.trainer import check_layout

    weak = TrainConfig(workers=2, per_worker_batch_size=16, min_workers=1)
    with pytest.raises(ValueError, match="per_worker_batch_size=16 with min_workers=1"):
        check_layout(weak, PipelineConfig(stages=2))


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
            collective_timeout_s=KILLED_PEER_DEADLINE_S,
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


# ---------------------------------------------------------------------------- elastic


def _dies_at(digits, tmp_path, name, *, step, store=None, **config):
    """2 workers on a fixed global batch; rank 1 dies at global step ``step``, no replacement."""
    (tmp_path / name).mkdir()
    hparams = {
        "out": str(tmp_path / name),
        "mark": str(tmp_path / f"{name}.mark"),
        "dies_at": [step],
        "hidden": 32,
        "lr": LR,
    }
    return fit(
        DiesOnce,
        hparams=hparams,
        data=digits,
        config=TrainConfig(
            workers=2,
            min_workers=1,
            batch_size=64,
            epochs=3,
            seed=5,
            cpus_per_worker=0.5,
            collective_timeout_s=KILLED_PEER_DEADLINE_S,
            **config,
        ),
        checkpoint_uri=str(tmp_path / f"{name}-model"),
        **(store or {}),
    )


def _in_a_ray_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class DiesOnce(RecordsItsSteps):
    """RecordsItsSteps whose rank 1 kills its own process at the global steps ``dies_at``,
    as a preempted node, leaving ``mark``, which keeps any replacement from starting: the
    membership history is the same in every run, whatever the timing (the driver builds
    the module too, after training: it is let through)."""

    step_size, gamma = 20, 0.9  # a slower schedule: training goes on over 5 epochs

    def __init__(self, out: str, mark: str, dies_at: list[int], **hparams):
        if Path(mark).exists() and _in_a_ray_actor():
            raise RuntimeError("no replacement in this test")
        super().__init__(out, **hparams)
        self.mark, self.dies_at = mark, set(dies_at)

    def training_step(self, batch, batch_idx):
        # Once: a survivor that trains rank 1's part after it sees rank 1 too.
        died = Path(f"{self.mark}.{self.global_step}")
        if self.trainer.global_rank == 1 and self.global_step in self.dies_at and not died.exists():
            died.touch()
            Path(self.mark).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def _elastic_weak(digits, tmp_path, name, *, hparams, epochs, **kw):
    return fit(
        DiesOnce,
        hparams=hparams,
        data=digits,
        config=TrainConfig(
            workers=2,
            min_workers=1,
            per_worker_batch_size=32,
            lr_scaling="linear",
            epochs=epochs,
            seed=5,
            commit_every=5,
            cpus_per_worker=0.5,
            collective_timeout_s=KILLED_PEER_DEADLINE_S,
        ),
        checkpoint_uri=str(tmp_path / name),
        **kw,
    )


@pytest.mark.ray
def test_a_lost_worker_halves_the_next_epochs_batch_and_learning_rate_and_resumes_exactly(
    ray_session, digits, tmp_path
):
    samples = len(digits.read("train")[1])
    two = Epochs(samples, (64,))
    # Rank 1 dies 7 steps into epoch 1: the survivor goes on from that step (the steps since
    # the last commit are kept) and finishes the epoch on the whole batch of 64; from epoch 2
    # the batch is its own 32.
    lost_at = two.start(1) + 7
    after = Epochs(samples, (64, 64, 32))
    again = after.start(3)  # a resumed run's rank 1 dies as the run resumes there
    (tmp_path / "rows-whole").mkdir()
    hparams = {
        "out": str(tmp_path / "rows-whole"),
        "mark": str(tmp_path / "whole.mark"),
        "dies_at": [lost_at, again],
        "hidden": 32,
        "lr": LR,
    }
    whole = _elastic_weak(digits, tmp_path, "whole", hparams=hparams, epochs=5)
    assert [m.batch_size for m in whole.history] == [64, 64, 32, 32, 32]
    assert [e.kind for e in whole.events] == ["lost", "went_on", "recovered"]
    assert whole.events[1].step == lost_at  # inside epoch 1: the epoch keeps its batch
    assert whole.events[0].steps_lost == 0
    epochs = Epochs(samples, (64, 64, 32))
    rows = [row for ranks in _rows(tmp_path / "rows-whole") for row in ranks]
    assert rows
    for row in rows:
        epoch, _ = epochs.locate(row["step"])
        factor = epochs.batch(epoch) / 32  # linear, relative to one worker's batch
        schedule = [LR * 0.9 ** (row["step"] // 20), LR / 2 * 0.9 ** (row["step"] // 20)]
        assert row["during"] == pytest.approx([lr * factor for lr in schedule], rel=1e-12), row
        assert row["between"] == pytest.approx(schedule, rel=1e-12), row
    # The survivor alone takes the whole batch of 64 from the step it went on from until
    # epoch 1 ends (its last batch is short), then its own 32; it ran every step once.
    (survivor,) = [r for r in _rows(tmp_path / "rows-whole") if r[-1]["step"] >= epochs.start(2)]
    assert [r["step"] for r in survivor] == list(range(epochs.start(5)))
    last = {r["step"]: r["part"] for r in survivor}
    starts = {epochs.start(e) for e in range(6)}
    assert {last[s] for s in range(two.start(1), lost_at)} == {32}
    assert {last[s] for s in range(lost_at, epochs.start(2) - 1)} == {64}
    full = [s for s in range(epochs.start(2), epochs.start(5)) if s + 1 not in starts]
    assert {last[s] for s in full} == {32}  # every epoch's last batch is short

    # The same run stopped after 3 epochs and resumed: its rank 1 dies at the first step
    # after the resume, the survivor decides that epoch again at 32 and ends as `whole`.
    (tmp_path / "rows-split").mkdir()
    split = {**hparams, "out": str(tmp_path / "rows-split"), "mark": str(tmp_path / "split.mark")}
    store = {"store_url": str(tmp_path / "store"), "run_key": "weak"}
    first = _elastic_weak(digits, tmp_path, "first", hparams=split, epochs=3, **store)
    assert [m.batch_size for m in first.history] == [64, 64, 32]
    Path(split["mark"]).unlink()  # the resumed run starts both workers again
    resumed = _elastic_weak(digits, tmp_path, "resumed", hparams=split, epochs=5, **store)
    assert resumed.resumed_from == again
    assert [e.kind for e in resumed.events] == ["resumed", "lost", "rollback", "recovered"]
    assert resumed.events[2].step == again  # back to the resume: the epoch decided anew
    assert [m.batch_size for m in resumed.history] == [64, 64, 32, 32, 32]
    _assert_equal(resumed, whole)


@pytest.mark.ray
def test_survivors_go_on_from_the_step_that_failed_and_end_as_the_uninterrupted_run(
    ray_session, digits, tmp_path
):
    lost_at = 33  # 3 steps past the commit at 30 (commits every 5 steps)
    went_on = _dies_at(digits, tmp_path, "went-on", step=lost_at, commit_every=5)
    # The survivor trains both workers' parts of each batch apart and divides their sum by
    # two, as the ring of two does: the run ends bit for bit as the one that lost nobody.
    calm = _dies_at(digits, tmp_path, "calm", step=10**6, commit_every=5)
    assert calm.events == []
    _assert_equal(went_on, calm)
    assert [e.kind for e in went_on.events] == ["lost", "went_on", "recovered"]
    lost, on, _ = went_on.events
    assert (lost.steps_lost, on.step, on.workers) == (0, lost_at, 1)
    (survivor,) = [r for r in _rows(tmp_path / "went-on") if r[-1]["step"] > lost_at]
    assert [r["step"] for r in survivor] == list(range(3 * 23))  # each step once
    # Alone, it trained both ranks' parts, the module seeing each rank in turn (the step
    # that failed began as rank 0 first).
    assert {tuple(r["ranks"]) for r in survivor[:lost_at]} == {(0,)}
    assert survivor[lost_at]["ranks"] == [0, 0, 1]
    assert {tuple(r["ranks"]) for r in survivor[lost_at + 1 :]} == {(0, 1)}
    # A commit (and a checkpoint: no step runs ahead of its call) at every step: the survivor
    # rolls back to the commit at the step that failed, nothing lost, and ends alike.
    store = {"store_url": str(tmp_path / "store"), "run_key": "each-step"}
    committed = _dies_at(
        digits, tmp_path, "committed", step=lost_at, commit_every=1, checkpoint_every=1, store=store
    )
    assert [e.kind for e in committed.events] == ["lost", "rollback", "recovered"]
    assert committed.events[1].step == lost_at
    _assert_equal(went_on, committed)
