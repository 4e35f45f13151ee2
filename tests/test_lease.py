"""One writer per run key: the lease in storage, its fencing of checkpoint commits and
retention, between real processes (and Ray workers of the holder's job)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ringflow.storage import CheckpointStore, RetentionPolicy
from ringflow.storage.fs import create_once
from ringflow.storage.lease import (
    LeaseHeldError,
    LeaseLostError,
    RunLease,
    read_lease,
    this_process,
)
from tests.moto_s3 import s3_endpoint

ROOT = Path(__file__).resolve().parents[1]


def _shards(value: float) -> dict:
    return {"replicated": {"w": torch.full((4,), value)}}


def _holder(url: str, run_key: str, *, ready: Path, ttl_s: float = 30.0) -> subprocess.Popen:
    """A separate process that takes the lease, commits steps 1 and 2, says so, and holds it."""
    code = textwrap.dedent(
        f"""
        import pathlib, time, torch
        from ringflow.storage import CheckpointStore
        from ringflow.storage.lease import RunLease
        lease = RunLease.acquire({url!r}, {run_key!r}, ttl_s={ttl_s}, info={{"flow_run": "A"}})
        with lease:
            for step in (1, 2):
                CheckpointStore({url!r}).save(
                    {run_key!r}, step=step, shards={{"replicated": {{"w": torch.ones(4)}}}}
                )
            pathlib.Path({str(ready)!r}).write_text(str(lease.token))
            time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, "the holder process died"
        assert time.monotonic() < deadline, "the holder took no lease within 2 minutes"
        time.sleep(0.1)
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_a_second_process_is_refused_and_cannot_commit_or_delete(tmp_path):
    url, run_key = str(tmp_path / "checkpoints"), "run-1"
    holder = _holder(url, run_key, ready=tmp_path / "ready")
    try:
        started = time.monotonic()
        # Its holder is alive on this machine: refused at once, not queued behind it.
        with pytest.raises(LeaseHeldError, match=rf"flow run A .*pid {holder.pid}") as refused:
            RunLease.acquire(url, run_key, ttl_s=600)
        assert time.monotonic() - started < 30
        assert "\n" not in str(refused.value)
        assert isinstance(refused.value, ValueError)  # the flow fails such a run at once

        # Not the holder: no shard written, no manifest published, no checkpoint deleted.
        store = CheckpointStore(url, retention=RetentionPolicy(keep_last=1))
        with pytest.raises(LeaseLostError, match="not by this process"):
            store.save(run_key, step=3, shards=_shards(3.0))
        with pytest.raises(LeaseLostError, match="deleting"):
            store.cleanup(run_key)  # keep_last=1 would delete step 1
        assert [c.step for c in store.checkpoints(run_key)] == [1, 2]
        assert not (tmp_path / "checkpoints" / run_key / "step-000000000003").exists()
        for checkpoint in store.checkpoints(run_key):
            assert torch.equal(store.load(checkpoint).shards["replicated"]["w"], torch.ones(4))
    finally:
        _kill(holder)


def test_the_lease_of_a_killed_holder_is_taken_at_once_with_the_next_token(tmp_path):
    url, run_key = str(tmp_path / "checkpoints"), "run-1"
    holder = _holder(url, run_key, ready=tmp_path / "ready")
    first = int((tmp_path / "ready").read_text())
    _kill(holder)

    started = time.monotonic()
    lease = RunLease.acquire(url, run_key, ttl_s=600, wait_s=0)  # no waiting for the expiry
    assert time.monotonic() - started < 5
    assert lease.token == first + 1
    assert lease.previous.token == first
    assert lease.previous.holder["pid"] == holder.pid
    with lease:
        committed = CheckpointStore(url).save(run_key, step=2, shards=_shards(2.0))
        assert committed.step == 2
    assert read_lease(f"{url}/{run_key}").released


def test_a_save_whose_lease_changed_hands_is_not_committed(tmp_path):
    url, run_key = str(tmp_path / "checkpoints"), "run-1"
    store = CheckpointStore(url)
    first = RunLease.acquire(url, run_key)
    record = store.write_shard(run_key, step=5, name="replicated", tensors={"w": torch.ones(2)})
    first.release()
    second = RunLease.acquire(url, run_key, wait_s=0)  # released: free at once
    with pytest.raises(LeaseLostError, match="changed hands"):
        store.commit(run_key, step=5, shards=[record], fence=first.token)
    assert store.checkpoints(run_key) == []
    second.release()


def test_only_one_of_racing_processes_gets_the_lease(tmp_path):
    url = str(tmp_path / "checkpoints")
    code = textwrap.dedent(
        f"""
        import pathlib, sys, time
        from ringflow.storage.lease import LeaseHeldError, RunLease
        barrier = pathlib.Path({str(tmp_path)!r})
        (barrier / f"ready-{{sys.argv[1]}}").touch()
        while len(list(barrier.glob("ready-*"))) < 4:  # all imported: race from here
            time.sleep(0.01)
        try:
            lease = RunLease.acquire({url!r}, "run-1", wait_s=0, ttl_s=60)
        except LeaseHeldError:
            print("refused")
        else:
            print("token", lease.token)
            time.sleep(5)  # alive while the others look
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(i)], cwd=ROOT, stdout=subprocess.PIPE)
        for i in range(4)
    ]
    outputs = sorted(p.communicate(timeout=120)[0].decode().strip() for p in procs)
    assert outputs == ["refused", "refused", "refused", "token 1"], outputs


def test_a_lease_held_on_another_machine_counts_until_it_expires(tmp_path):
    url, run_key = str(tmp_path / "checkpoints"), "run-1"
    directory = tmp_path / "checkpoints" / run_key
    directory.mkdir(parents=True)
    now = time.time()
    elsewhere = {**this_process(), "machine": "another-host/boot/pid:[1]", "ray_job": None}
    record = {
        "format": "ringflow.lease/1",
        "run_key": run_key,
        "token": 7,
        "holder": elsewhere,
        "acquired": now,
        "renewed": now,
        "expires": now + 2.0,
        "released": False,
        "note": {},
    }
    (directory / "lease-000000000007.json").write_text(json.dumps(record))
    # Its pid may be ours, but it is another machine's: only its expiry frees it.
    with pytest.raises(LeaseHeldError):
        RunLease.acquire(url, run_key, wait_s=0)
    lease = RunLease.acquire(url, run_key, wait_s=10, poll_s=0.2)
    assert lease.token == 8
    lease.release()


def test_ray_workers_of_the_holders_job_may_write_and_others_may_not(tmp_path, ray_session):
    ray = ray_session
    url, run_key = str(tmp_path / "checkpoints"), "run-1"

    @ray.remote
    def save(step: int) -> str:
        from ringflow.storage import CheckpointStore

        try:
            CheckpointStore(url).save(run_key, step=step, shards=_shards(float(step)))
        except Exception as err:
            return f"{type(err).__name__}: {err}"
        return "committed"

    with RunLease.acquire(url, run_key):
        assert ray.get(save.remote(1)) == "committed"
    holder = _holder(url, run_key, ready=tmp_path / "ready")  # another process, another job
    try:
        refused = ray.get(save.remote(3))
        assert refused.startswith("LeaseLostError"), refused
        assert f"pid {holder.pid}" in refused, refused
    finally:
        _kill(holder)
    assert [c.step for c in CheckpointStore(url).checkpoints(run_key)] == [1, 2]


def test_on_s3_each_token_is_created_once_by_a_conditional_put():
    import fsspec

    with s3_endpoint() as s3:
        url, options = s3.url("checkpoints"), s3.storage_options()
        first = RunLease.acquire(url, "run-1", storage_options=options)
        assert first.token == 1
        fs, root = fsspec.core.url_to_fs(url, **options)
        path = f"{root}/run-1/lease-000000000001.json"
        assert not create_once(fs, path, b"{}")  # taken: the second PUT is refused, not applied
        assert read_lease(url + "/run-1", **options).holder == first.record.holder
        first.release()
        second = RunLease.acquire(url, "run-1", storage_options=options, wait_s=0)
        assert second.token == 2
        assert second.previous.released
        second.release()
