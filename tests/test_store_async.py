"""AsyncCheckpointer: training waits only for the host copy; failures are retried, reported,
and never move the latest checkpoint. Slow and failing storage is moto behind the fault proxy.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ringflow.storage.checkpointer as checkpointer_module
from ringflow.storage import (
    AsyncCheckpointer,
    CheckpointStorageError,
    CheckpointStore,
    CommittedCheckpoint,
    RetryPolicy,
    training_state,
)
from tests.moto_s3 import Faults, S3Endpoint, s3_endpoint

RUN = "run-async"
_STORE_RETRY = RetryPolicy(deadline_s=0.3, initial_backoff_s=0.05, max_backoff_s=0.1)
# Generous against a loaded machine, where one failing PUT has taken a whole second: the
# failure test needs at least two attempts of the whole save within it.
_SAVE_RETRY = RetryPolicy(deadline_s=4.0, initial_backoff_s=0.1, max_backoff_s=0.2)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with s3_endpoint(Faults(seed=11)) as endpoint:
        yield endpoint


@pytest.fixture
def faults(s3: S3Endpoint) -> Iterator[Faults]:
    """The proxy's faults, reset to none after the test."""
    yield s3.proxy.faults
    s3.proxy.faults.error_rate = s3.proxy.faults.slow_rate = 0.0
    s3.proxy.faults.methods = Faults().methods
    s3.proxy.faults.released.set()


def s3_store(s3: S3Endpoint, *, client_attempts: int = 3, **kwargs: Any) -> CheckpointStore:
    """A store on the proxy; ``client_attempts`` is how often botocore itself tries a call."""
    options = s3.storage_options()
    options["config_kwargs"]["retries"]["max_attempts"] = client_attempts
    return CheckpointStore(
        s3.url(f"async-{uuid.uuid4().hex[:8]}"), storage_options=options, **kwargs
    )


def shards(step: int) -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(step)
    return {
        "replicated": {
            "w": torch.randn(32, 16, generator=generator),
            "step": torch.tensor(step),
        },
        "rank-00000": {"rng": torch.randint(0, 9, (4,), generator=generator)},
    }


def assert_holds(store: CheckpointStore, step: int) -> None:
    loaded = store.load_latest(RUN)
    assert loaded is not None
    assert loaded.step == step
    for name, tensors in shards(step).items():
        for key, tensor in tensors.items():
            assert torch.equal(loaded.shards[name][key], tensor)


def test_save_returns_while_its_write_is_held(s3: S3Endpoint, faults: Faults) -> None:
    store = s3_store(s3)
    faults.methods = frozenset({"PUT"})
    with AsyncCheckpointer(store) as saver:  # its writability check goes through
        faults.released.clear()  # from here every PUT waits at the proxy until the test lets go
        started = time.perf_counter()
        saver.save(RUN, step=1, shards=shards(1), metadata={"epoch": 0})
        blocked = time.perf_counter() - started
        assert not saver.wait(timeout=0.2)  # save() returned; the write is still held
        assert store.latest(RUN) is None
        faults.released.set()
        assert saver.wait(timeout=30)
    assert 0 < saver.stalled_s <= blocked
    assert saver.last_committed.step == 1
    assert_holds(store, 1)


def test_a_newer_save_replaces_the_waiting_one(
    s3: S3Endpoint, faults: Faults, monkeypatch: pytest.MonkeyPatch
) -> None:
    allocated = []
    original = checkpointer_module.host_buffer
    monkeypatch.setattr(
        checkpointer_module, "host_buffer", lambda t: allocated.append(t) or original(t)
    )
    store = s3_store(s3)
    faults.methods, faults.slow_rate, faults.slow_s = frozenset({"PUT"}), 1.0, 0.3
    committed: list[int] = []
    with AsyncCheckpointer(store, on_commit=lambda c: committed.append(c.step)) as saver:
        for step in range(1, 6):
            saver.save(RUN, step=step, shards=shards(step))
            time.sleep(0.05)
        assert saver.wait(timeout=30)
    assert committed == [1, 5]
    assert saver.replaced == 3
    # Two snapshots at most ever existed: the one being written and the one waiting.
    assert len(allocated) <= 2 * sum(len(t) for t in shards(0).values())
    assert_holds(store, 5)


def test_tensors_may_change_once_save_returns(tmp_path: Any) -> None:
    store = CheckpointStore(str(tmp_path))
    state = shards(3)
    with AsyncCheckpointer(store) as saver:
        saver.save(RUN, step=3, shards=state)
        for tensors in state.values():
            for tensor in tensors.values():
                tensor.zero_()  # the next optimizer step, racing the background write
    assert_holds(store, 3)


def _trained_once(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """Adam for ``model`` (inputs of 8 features) and a training step, already taken once so
    that the optimizer has state."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(16, 8)

    def train_step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    train_step()
    return optimizer, train_step


def test_an_overlapped_save_copies_while_training_goes_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(str(tmp_path))
    model = torch.nn.Linear(8, 4)
    optimizer, train_step = _trained_once(model)
    copy = checkpointer_module._StagingBuffers.copy
    release, copied = threading.Event(), threading.Event()

    def held_copy(*args: Any, **kwargs: Any) -> Any:
        release.wait(timeout=10)  # a large state, still being copied
        result = copy(*args, **kwargs)
        copied.set()
        return result

    monkeypatch.setattr(checkpointer_module._StagingBuffers, "copy", held_copy)
    tensors, optimizer_metadata = training_state(model, optimizer)
    expected = {name: tensor.clone() for name, tensor in tensors.items()}
    with AsyncCheckpointer(store) as saver:
        saver.guard(optimizer)
        started = time.perf_counter()
        saver.save(RUN, step=1, shards={"replicated": tensors}, overlap=True)
        assert not copied.is_set()  # save() returned while the copy was held
        threading.Timer(0.3, release.set).start()
        train_step()  # forward and backward overlap the copy; step() waits for it
        fenced = time.perf_counter() - started
    assert copied.is_set()
    assert 0.25 <= saver.stalled_s <= fenced
    loaded = store.load_latest(RUN).shards["replicated"]
    assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())
    assert not torch.equal(model.weight, expected["model/weight"])  # training went on
    assert optimizer_metadata["optimizer"] == "Adam"


def test_a_collected_save_gathers_the_state_in_the_background(tmp_path: Any) -> None:
    """``collect=`` moves even building the state off the training thread, and the saved
    state is the one before the next optimizer step, also for a module with buffers, whose
    forward pass changes them (BatchNorm's running statistics)."""
    store = CheckpointStore(str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    optimizer, train_step = _trained_once(model)
    expected = {name: t.clone() for name, t in training_state(model, optimizer)[0].items()}
    gathered_in: list[str] = []

    def collect() -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        gathered_in.append(threading.current_thread().name)
        time.sleep(0.2)  # a slow gather: the forward pass below must wait for it
        tensors, metadata = training_state(model, optimizer)
        return {"replicated": tensors}, {"optimizer": metadata}

    with AsyncCheckpointer(store) as saver:
        handle = saver.guard(optimizer, model)
        saver.save(RUN, step=1, collect=collect, overlap=True)
        train_step()
        handle.remove()
    assert gathered_in
    assert gathered_in[0] != threading.current_thread().name
    loaded = store.load_latest(RUN)
    assert loaded.metadata["optimizer"]["optimizer"] == "Adam"
    assert set(loaded.shards["replicated"]) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded.shards["replicated"][name], tensor), name
    assert not torch.equal(model[1].running_mean, expected["model/1.running_mean"])


def test_a_collected_save_reports_bad_metadata_at_the_fence(tmp_path: Any) -> None:
    store = CheckpointStore(str(tmp_path))
    tensor = torch.ones(3)
    with AsyncCheckpointer(store) as saver:
        saver.save(
            RUN, step=1, collect=lambda: ({"s": {"t": tensor}}, {"bad": object()}), overlap=True
        )
        with pytest.raises(ValueError, match="JSON-serialisable"):
            saver.fence()
        with pytest.raises(ValueError, match="exactly one of shards= and collect="):
            saver.save(RUN, step=2)
    assert store.latest(RUN) is None


def test_a_transient_outage_is_ridden_out(s3: S3Endpoint, faults: Faults) -> None:
    store = s3_store(s3, client_attempts=1, retry=_STORE_RETRY)
    before = faults.counts["500"]
    with AsyncCheckpointer(store, retry=RetryPolicy(deadline_s=60, max_backoff_s=0.3)) as saver:
        faults.error_rate = 1.0
        saver.save(RUN, step=7, shards=shards(7))
        time.sleep(1.5)
        faults.error_rate = 0.0
        assert saver.wait(timeout=60)
    assert saver.errors == ()
    assert faults.counts["500"] - before >= 3
    assert_holds(store, 7)


def test_a_failed_save_is_reported_and_never_becomes_latest(
    s3: S3Endpoint, faults: Faults, caplog: pytest.LogCaptureFixture
) -> None:
    # With botocore trying once, each failure surfaces at once and our retries do the work.
    store = s3_store(s3, client_attempts=1, retry=_STORE_RETRY)
    with AsyncCheckpointer(store, retry=_SAVE_RETRY) as saver:
        saver.save(RUN, step=1, shards=shards(1))
        assert saver.wait(timeout=30)
        faults.methods, faults.error_rate = frozenset({"PUT"}), 1.0
        with caplog.at_level(logging.ERROR, logger="ringflow.storage.checkpointer"):
            saver.save(RUN, step=2, shards=shards(2))
            assert saver.wait(timeout=60)
        assert saver.last_error is not None
        assert (saver.last_error.step, saver.last_error.run_key) == (2, RUN)
        assert saver.last_error.attempts >= 2
        assert "CheckpointStorageError" in saver.last_error.error
        assert any("step 2" in r.getMessage() for r in caplog.records)
        assert_holds(store, 1)  # latest did not move

        faults.error_rate = 0.0  # storage is back
        saver.save(RUN, step=3, shards=shards(3))
    assert [f.step for f in saver.errors] == [2]
    assert_holds(store, 3)


def test_close_finishes_queued_saves_then_refuses_new_ones(tmp_path: Any) -> None:
    store = CheckpointStore(f"file://{tmp_path}")
    seen: list[CommittedCheckpoint] = []
    saver = AsyncCheckpointer(store, on_commit=seen.append)
    saver.save(RUN, step=4, shards=shards(4), metrics={"loss": 0.5})
    saver.close()
    assert [c.step for c in seen] == [4]
    assert seen[0].metrics == {"loss": 0.5}
    with pytest.raises(RuntimeError, match="closed"):
        saver.save(RUN, step=5, shards=shards(5))


def test_bad_arguments_raise_in_the_caller(tmp_path: Any) -> None:
    with AsyncCheckpointer(CheckpointStore(str(tmp_path))) as saver:
        with pytest.raises(ValueError, match="metadata"):
            saver.save(RUN, step=1, shards=shards(1), metadata={"x": object()})
        with pytest.raises(ValueError, match="run_key"):
            saver.save("a/b", step=1, shards=shards(1))
    assert saver.last_committed is None


def test_an_unwritable_store_fails_up_front(tmp_path: Any) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    store = CheckpointStore(str(tmp_path / "a-file" / "ckpt"), retry=_STORE_RETRY)
    with pytest.raises(CheckpointStorageError, match="cannot write checkpoints"):
        AsyncCheckpointer(store)
