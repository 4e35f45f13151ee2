"""A user's own error fails the run once, at once, naming the hook; only a lost worker is
retried (``engine.failures``).

Each module below raises in its own code on 2 Ray workers: the run must end on its first
attempt as one line of ``ModelError`` naming the hook and the original exception, within
seconds of the raise, with no worker counted lost and no new start of the group. The
elastic tests (tests/test_elastic.py) keep what a lost worker gets: recovery.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringflow.engine import ModelError, TrainConfig, fit
from ringflow.models.digits import DigitsClassifier

ROOT = Path(__file__).resolve().parents[1]


class RaisesAtTheThirdStep(DigitsClassifier):
    """Rank 1's ``training_step`` raises ``ValueError`` at its third call, writing when."""

    def __init__(self, marker: str = "", **hparams) -> None:
        super().__init__(**hparams)
        self.marker, self.calls = marker, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.global_rank == 1 and self.calls == 3:
            Path(self.marker).write_text(repr(time.time()))
            raise ValueError("the third batch is not what I expected")
        return super().training_step(batch, batch_idx)


class RefusesItsHparams(DigitsClassifier):
    def __init__(self, hidden: int = 32, **hparams) -> None:
        if hidden > 64:
            raise ValueError(f"hidden={hidden} is more than this model takes (64)")
        super().__init__(hidden=hidden, **hparams)


class StepsByHand(DigitsClassifier):
    """Manual optimisation, refused with gradient accumulation (as Lightning refuses it)."""

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.automatic_optimization = False


class SkipsThroughAHelper(DigitsClassifier):
    """Returns what a helper returns, ``None`` for rank 1's share of the third batch: its own
    ``training_step`` has no ``return None``, so the workers do not agree on skipping."""

    def training_step(self, batch, batch_idx):
        return self.loss_or_skip(batch, batch_idx)

    def loss_or_skip(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 1:
            return None
        return super().training_step(batch, batch_idx)


def _fit(digits, tmp_path, module, config=None, **hparams):
    return fit(
        module,
        hparams={"hidden": 16, **hparams},
        data=digits,
        config=TrainConfig(
            workers=2, epochs=1, batch_size=64, seed=0, cpus_per_worker=0.5, **(config or {})
        ),
        checkpoint_uri=str(tmp_path / "model"),
    )


@pytest.fixture
def engine_log(caplog):
    caplog.set_level(logging.INFO, logger="ringflow.engine")
    return caplog


def _assert_no_worker_lost(engine_log) -> None:
    said = [r.getMessage() for r in engine_log.records]
    assert not [m for m in said if "lost" in m or "starting again" in m], said


@pytest.mark.ray
def test_a_step_that_raises_ends_the_run_at_once_naming_the_hook(
    ray_session, digits, tmp_path, engine_log
):
    marker = tmp_path / "raised"
    with pytest.raises(ModelError) as failed:
        _fit(digits, tmp_path, RaisesAtTheThirdStep, marker=str(marker))
    ended = time.time()
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(
        "RaisesAtTheThirdStep.training_step raised ValueError: the third batch is not what I "
        "expected (worker rank 1"
    ), message
    assert ended - float(marker.read_text()) < 5.0
    _assert_no_worker_lost(engine_log)


@pytest.mark.ray
def test_none_from_a_helper_on_one_worker_ends_the_run_at_once_saying_what_to_do(
    ray_session, digits, tmp_path, engine_log
):
    """Not a lost worker, and not the other worker hung in the next all-reduce: one line
    naming the step and how to skip a batch on every worker."""
    with pytest.raises(ModelError) as failed:
        _fit(digits, tmp_path, SkipsThroughAHelper)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(
        "SkipsThroughAHelper.training_step returned None at step 2 of epoch 0, where its own "
        "code has no 'return None': return None from training_step itself"
    ), message
    _assert_no_worker_lost(engine_log)


@pytest.mark.ray
@pytest.mark.parametrize(
    ("module", "hparams", "config", "named"),
    [
        (
            RefusesItsHparams,
            {"hidden": 128},
            {},
            "RefusesItsHparams(hidden=128) refused its hparams: hidden=128 is more than this "
            "model takes (64)",
        ),
        (
            StepsByHand,
            {},
            {"accumulate_grad_batches": 2},
            "StepsByHand optimises manually, so accumulate_grad_batches=2 is refused",
        ),
    ],
    ids=["a constructor refusing its hparams", "manual optimisation with accumulation"],
)
def test_what_fails_as_the_workers_start_ends_the_run_on_the_first_start(
    ray_session, digits, tmp_path, engine_log, module, hparams, config, named
):
    with pytest.raises(ModelError) as failed:
        _fit(digits, tmp_path, module, config, **hparams)
    assert named in str(failed.value)
    assert "\n" not in str(failed.value)
    assert "worker rank" not in str(failed.value)  # refused by the driver, before any worker
    _assert_no_worker_lost(engine_log)  # one start of the group, not four


@pytest.mark.integration  # a private Ray and Prefect of its own
def test_through_the_command_line_the_run_fails_once_without_a_retry(tmp_path, prefect_api):
    done = subprocess.run(
        [sys.executable, "-m", "ringflow.flows.train_pipeline"]
        + ["--model", "tests.test_failures:RaisesAtTheThirdStep", "--workers", "2"]
        + ["--tune-trials", "0", "--epochs", "1", "--no-serve"]
        + ["--hparams", f'{{"marker": "{tmp_path / "raised"}"}}']
        + ["--storage-url", str(tmp_path / "storage")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
            "COLUMNS": "250",
            "PREFECT_API_URL": prefect_api,
        },
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert "ModelError: RaisesAtTheThirdStep.training_step raised ValueError" in error, error
    assert "AwaitingRetry" not in out, out[-3000:]  # no flow retry
    assert "lost" not in out, out[-3000:]
    assert (tmp_path / "raised").exists(), out[-3000:]
    # Its log says why once, at ERROR, with no traceback (--debug shows them).
    errors = [line for line in out.splitlines() if "| ERROR" in line]
    assert len(errors) == 1, errors
    assert "RaisesAtTheThirdStep.training_step raised ValueError" in errors[0], errors
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.unit
def test_the_driver_decides_each_failure_once_by_what_it_is_and_when_it_struck():
    """``engine.failures.decide``: a lost worker starts the group again while it starts (within
    ``max_failures``, then one line saying how often it tried) and is recovered from while it
    runs; ringflow's own errors and the module's stay as they are; Ray's own exception never
    reaches the caller as Ray's."""
    import ray

    from ringflow.engine.errors import EngineError, MembershipLost
    from ringflow.engine.failures import Decision, decide

    lost = MembershipLost({"worker-1": "its process died (ActorDiedError)"}, during="connect")
    assert decide(lost, while_="starting", attempt=0, max_failures=1).action is Decision.RESTART
    spent = decide(lost, while_="starting", attempt=1, max_failures=1)
    assert spent.action is Decision.FAIL
    assert isinstance(spent.error, EngineError)
    assert str(spent.error) == (
        "the workers did not start: worker-1 lost during connect: its process died "
        "(ActorDiedError) (after 2 attempts; max_failures=1)"
    )
    assert decide(lost, while_="running").action is Decision.RECOVER
    model = ModelError("DigitsClassifier.training_step raised ValueError: no (worker rank 0)")
    kept = decide(model, while_="running")
    assert kept.action is Decision.FAIL
    assert kept.error is model
    raw = ray.exceptions.ActorDiedError()
    ended = decide(raw, while_="finishing")
    assert ended.action is Decision.FAIL
    assert type(ended.error) is EngineError
    assert str(ended.error).startswith("the run failed while finishing: ActorDiedError: ")
    assert "\n" not in str(ended.error)
