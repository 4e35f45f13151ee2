"""Workers that outlive a run: leased warm from the cluster's pool, given back clean, keyed
by the code they run, and never left behind by a driver that is gone."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.engine.pool import _Pool, pool_key, worker_pids
from ringflow.models.digits import DigitsClassifier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"workers": 2, "epochs": 2, "batch_size": 64, "seed": 4, "cpus_per_worker": 0.5}
_IMPORTS = {"count": 0}
_IMPORTS["count"] += 1  # once per import of this module in a process


def _in_a_worker() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class LeavesTraces(DigitsClassifier):
    """Leaves in its worker's process what careless code leaves (an environment variable, a
    module's global changed, the working directory moved) and logs whether it found any of
    that from an earlier run."""

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.found = 0.0
        if _in_a_worker():
            self.found = float("RINGFLOW_TEST_TRACE" in os.environ or _IMPORTS["count"] > 1)
            self.found += float(os.getcwd() == "/")
            os.environ["RINGFLOW_TEST_TRACE"] = "left"
            _IMPORTS["count"] += 1
            os.chdir("/")

    def training_step(self, batch, batch_idx):
        self.log("found_traces", self.found, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


class LeavesAThread(DigitsClassifier):
    """Starts a thread in its worker that never ends: that process cannot be reused."""

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        if _in_a_worker():
            threading.Thread(target=time.sleep, args=(3600,), name="left-running").start()


def _fit(tmp_path, name, module=DigitsClassifier, **config):
    return fit(
        module,
        hparams={"hidden": 16},
        data=_fit.digits,
        config=TrainConfig(**{**CONFIG, **config}),
        checkpoint_uri=str(tmp_path / name),
    )


@pytest.fixture(autouse=True)
def _digits(digits):
    _fit.digits = digits


@pytest.mark.ray
def test_consecutive_fits_run_on_the_same_warm_processes_and_end_bit_for_bit(ray_session, tmp_path):
    first = _fit(tmp_path, "first")
    idle = set(worker_pids()["idle"])
    second = _fit(tmp_path, "second")
    assert set(worker_pids()["idle"]) == idle  # the second ran on the first's processes
    assert len(idle) >= 2
    for name, tensor in first.state_dict.items():
        assert torch.equal(second.state_dict[name], tensor), name


@pytest.mark.ray
def test_a_reused_worker_holds_nothing_of_the_run_before(ray_session, tmp_path):
    first = _fit(tmp_path, "first", LeavesTraces)
    idle = set(worker_pids()["idle"])
    second = _fit(tmp_path, "second", LeavesTraces)
    assert set(worker_pids()["idle"]) == idle  # the same processes served both runs
    assert first.metrics["found_traces"] == 0.0
    assert second.metrics["found_traces"] == 0.0  # no variable, global or directory kept


@pytest.mark.ray
def test_a_worker_its_run_left_unclean_is_not_reused(ray_session, tmp_path):
    before = set(worker_pids()["idle"])
    _fit(tmp_path, "threads", LeavesAThread)
    after = set(worker_pids()["idle"])
    assert not after - before  # its processes were not given back
    gone = before - after  # idle ones it leased (none when it started fresh processes)
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(pid) for pid in gone) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in gone if psutil.pid_exists(pid)]  # killed, not kept


@pytest.mark.ray
def test_changed_code_never_runs_in_a_stale_worker(ray_session, tmp_path, monkeypatch):
    (tmp_path / "usermodel.py").write_text("import torch\nclass M(torch.nn.Module):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import usermodel

    try:
        key = pool_key(0.5, {}, usermodel.M)
        assert pool_key(0.5, {}, usermodel.M) == key
        (tmp_path / "usermodel.py").write_text("import torch\nclass M(torch.nn.Module):\n  x=1\n")
        assert pool_key(0.5, {}, usermodel.M) != key  # the edited file: other workers
        assert pool_key(1.0, {}, usermodel.M) != pool_key(0.5, {}, usermodel.M)
    finally:
        sys.modules.pop("usermodel", None)


_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    import ray
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.engine.pool import worker_pids
    from ringflow.models.digits import SCHEMA, DigitsClassifier

    class Slow(DigitsClassifier):
        def training_step(self, batch, batch_idx):
            time.sleep(0.05)
            return super().training_step(batch, batch_idx)

    ray.init(address=sys.argv[2], log_to_driver=False)

    def report(_metrics):
        print(json.dumps(worker_pids()["leased"]), flush=True)
        time.sleep(3600)  # the driver never returns

    store = {"store_url": sys.argv[4], "run_key": "never"} if len(sys.argv) > 4 else {}
    fit(Slow, hparams={"hidden": 16}, data=DataSpec(dataset_url=sys.argv[1], schema=SCHEMA),
        config=TrainConfig(workers=2, epochs=3, batch_size=64, cpus_per_worker=0.5),
        checkpoint_uri=sys.argv[3], on_epoch=report, **store)
    """
)


@pytest.mark.ray
@pytest.mark.parametrize("adoptable", [False, True], ids=["plain", "with-a-run-key"])
def test_a_driver_that_never_returns_leaves_no_worker_behind(
    ray_session, digits, tmp_path, adoptable
):
    """Killed, its workers go at once; with a run key (in-memory commits a restarted
    driver could adopt), when nobody adopted them within ``RINGFLOW_ADOPT_S``."""
    address = ray_session.get_runtime_context().gcs_address
    store = [str(tmp_path / "store")] if adoptable else []
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, digits.dataset_url, address, str(tmp_path / "m")] + store,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "RINGFLOW_POOL_GRACE_S": "30", "RINGFLOW_ADOPT_S": "2"},
    )
    try:
        leased = json.loads(driver.stdout.readline())
        assert len(leased) >= 2, leased
        assert all(psutil.pid_exists(pid) for pid in leased)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) for pid in leased) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in leased if psutil.pid_exists(pid)]  # ended with the grace
    assert not set(leased) & set(worker_pids()["idle"])


def test_idle_workers_are_released_after_their_idle_time():
    pool = _Pool(idle_s=0.0)

    async def lease_and_give_back() -> None:
        await pool.add("lease", "key", 5.0, "host-a", 11)
        await pool.add("lease", "key", 5.0, "host-b", 12)
        await pool.give_back("lease", clean=[11], cap=8)  # host-b did not come back clean

    asyncio.run(lease_and_give_back())
    assert [h.pid for h in pool.idle["key"]] == [11]
    pool.reap()
    assert pool.idle["key"] == []


def test_a_lease_not_renewed_within_its_grace_ends():
    pool = _Pool(idle_s=60.0)
    asyncio.run(pool.add("lease", "key", 0.0, "host", 11))
    assert pool.renew("lease")
    pool.reap()
    assert "lease" not in pool.leases
    assert not pool.renew("lease")


class Paced(DigitsClassifier):
    """The demo model with steps that wait as if on an accelerator: a driver killed after an
    epoch is killed inside the next one. Rank 0 notes each step it trains in ``steps_file``
    with the job of the driver it serves; while ``steps_file`` + ``.slow`` exists, the third
    epoch's validation takes seconds (a driver killed then is killed in it)."""

    def __init__(self, *, steps_file: str, **hparams) -> None:
        super().__init__(**hparams)
        self.steps_file = steps_file

    def validation_step(self, batch, batch_idx):
        if self.current_epoch == 2 and os.path.exists(self.steps_file + ".slow"):
            time.sleep(0.5)
        return super().validation_step(batch, batch_idx)

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        if self.global_rank == 0:
            with open(self.steps_file, "a") as steps:
                steps.write(f"{self.global_step} {os.environ.get('RINGFLOW_RAY_JOB')}\n")
        return super().training_step(batch, batch_idx)


ADOPTED = {"workers": 2, "epochs": 4, "batch_size": 64, "seed": 5, "cpus_per_worker": 0.5}

_LOST_DRIVER = textwrap.dedent(
    """
    import sys
    import ray
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.models.digits import SCHEMA
    from tests.test_pool import ADOPTED, Paced

    ray.init(address=sys.argv[2], log_to_driver=False)
    hparams = {"hidden": 16, "steps_file": sys.argv[5]}
    fit(Paced, hparams=hparams, data=DataSpec(dataset_url=sys.argv[1], schema=SCHEMA),
        config=TrainConfig(**ADOPTED), checkpoint_uri=sys.argv[3], store_url=sys.argv[4],
        run_key="adopted", on_epoch=lambda m: print(m.epoch, flush=True))
    """
)


@pytest.mark.ray
@pytest.mark.parametrize("killed", ["mid-epoch", "validating"])
def test_a_restarted_driver_adopts_its_lost_drivers_workers_and_ends_bit_for_bit(
    ray_session, digits, tmp_path, killed
):
    """Killed inside the third epoch's steps, or in its validation once its steps ran: the
    restarted driver goes on where the workers are (running that epoch's end first), trains
    no step twice and ends with the uninterrupted run's weights and epoch metrics."""
    steps = tmp_path / "steps.log"
    reference = _paced_fit(digits, tmp_path, "reference")
    steps.unlink()
    steps_per_epoch = _steps_per_epoch(digits)
    store = _lose_driver(ray_session, digits, tmp_path, killed=killed)
    orphaned = set(worker_pids()["leased"])
    result = _paced_fit(digits, tmp_path, "restarted", store_url=store, run_key="adopted")
    resumed = result.events[0]
    assert resumed.kind == "resumed", result.events
    assert "in-memory commit" in resumed.cause, resumed.cause
    assert result.resumed_from > 2 * steps_per_epoch  # past the last checkpoint
    if killed == "validating":
        assert result.resumed_from == 3 * steps_per_epoch, result.resumed_from
    # No step trained twice: the restarted driver went on where the lost one's workers were.
    trained = [line.split() for line in steps.read_text().splitlines()]
    jobs = list(dict.fromkeys(job for _, job in trained))
    assert len(jobs) == 2, jobs  # the lost driver's, then the restarted one's
    lost_steps = [int(step) for step, job in trained if job == jobs[0]]
    after = [int(step) for step, job in trained if job == jobs[1]]
    assert after[0] == max(lost_steps) + 1, (lost_steps[-3:], after[:3])
    assert lost_steps + after == list(range(len(lost_steps) + len(after)))
    assert orphaned <= set(worker_pids()["idle"])  # the lost driver's processes trained on
    for name, tensor in reference.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name
    # What the lost driver's steps logged came from its workers: the same epoch metrics.
    assert [e.metrics for e in result.history] == [e.metrics for e in reference.history]


def _paced_fit(digits, tmp_path, name: str, **where):
    """A run of ``Paced`` as the lost driver's (``ADOPTED``), its rank 0's steps logged to
    ``steps.log`` and its checkpoints under ``name``; ``where``: its store and run key."""
    return fit(
        Paced,
        hparams={"hidden": 16, "steps_file": str(tmp_path / "steps.log")},
        data=digits,
        config=TrainConfig(**ADOPTED),
        checkpoint_uri=str(tmp_path / name),
        **where,
    )


def _lose_driver(ray_session, digits, tmp_path, *, killed: str) -> str:
    """A driver of run key ``adopted`` in a process of its own, SIGKILLed inside its third
    epoch's steps (``mid-epoch``) or in its validation once those ran (``validating``); its
    workers are left to the pool (the steps its rank 0 trained are in ``steps.log``). Its
    checkpoint store's URL."""
    store = str(tmp_path / "store")
    steps = tmp_path / "steps.log"
    slow = tmp_path / "steps.log.slow"
    steps_per_epoch = _steps_per_epoch(digits)
    address = ray_session.get_runtime_context().gcs_address
    lost = subprocess.Popen(
        [sys.executable, "-c", _LOST_DRIVER, digits.dataset_url, address]
        + [str(tmp_path / "lost"), store, str(steps)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    if killed == "validating":
        slow.touch()
    try:
        while lost.stdout.readline().strip() != "1":  # its second epoch ended
            assert lost.poll() is None, "the first driver ended before it was killed"
        time.sleep(0.3)  # into the third
        if killed == "validating":  # its steps all ran: in its validation now
            while str(3 * steps_per_epoch - 1) not in steps.read_text().split():
                assert lost.poll() is None, "the first driver ended before it was killed"
                time.sleep(0.05)
            time.sleep(1.0)
    finally:
        lost.send_signal(signal.SIGKILL)
        lost.wait()
    slow.unlink(missing_ok=True)
    return store


@pytest.mark.ray
def test_a_lost_driver_whose_worker_died_too_is_not_adopted_and_the_run_resumes_bit_for_bit(
    ray_session, digits, tmp_path, caplog
):
    """The driver is lost, then one of the workers it left: the restarted driver cannot go on
    from their memory, says why in one line, ends the other worker, and resumes from the last
    checkpoint to the uninterrupted run's weights."""
    steps = tmp_path / "steps.log"
    reference = _paced_fit(digits, tmp_path, "reference")
    steps.unlink()
    steps_per_epoch = _steps_per_epoch(digits)
    store = _lose_driver(ray_session, digits, tmp_path, killed="mid-epoch")
    orphaned = worker_pids()["leased"]
    assert len(orphaned) == ADOPTED["workers"], orphaned
    os.kill(orphaned[-1], signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="ringflow.engine"):
        result = _paced_fit(digits, tmp_path, "restarted", store_url=store, run_key="adopted")
    said = [r.getMessage() for r in caplog.records if "not adopted" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "\n" not in said[0], said  # one line, not Ray's account of a dead actor
    assert "actor_id" not in said[0], said
    assert result.resumed_from == 2 * steps_per_epoch  # the checkpoint of epoch 2
    assert not set(orphaned) & set(worker_pids()["idle"])  # neither goes back to the pool
    for name, tensor in reference.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name


def _steps_per_epoch(digits) -> int:
    """The steps of one epoch of the digits' training split at ``ADOPTED``'s batch size."""
    from ringflow.engine.data import samples_of

    return -(-len(samples_of(digits, "train")) // ADOPTED["batch_size"])


_ONE_FIT = textwrap.dedent(
    """
    import json, sys
    import ray
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.engine.pool import worker_pids
    from ringflow.models.digits import SCHEMA, DigitsClassifier

    ray.init(address=sys.argv[2], log_to_driver=False)
    fit(DigitsClassifier, hparams={"hidden": 16},
        data=DataSpec(dataset_url=sys.argv[1], schema=SCHEMA),
        config=TrainConfig(workers=2, epochs=1, batch_size=64, cpus_per_worker=0.5),
        checkpoint_uri=sys.argv[3])
    print(json.dumps(worker_pids()["idle"]))
    """
)


@pytest.mark.ray
def test_workers_a_finished_driver_gave_back_serve_the_next_drivers_run(
    ray_session, digits, tmp_path
):
    """Each run in a process of its own, as consecutive runs of the flow's command line on a
    running stack: the second runs on the processes the first started and gave back."""
    from ringflow.engine.pool import release_idle

    release_idle()  # the first run starts its own
    address = ray_session.get_runtime_context().gcs_address

    def driver(name: str) -> set[int]:
        done = subprocess.run(
            [sys.executable, "-c", _ONE_FIT, digits.dataset_url, address, str(tmp_path / name)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return set(json.loads(done.stdout.strip().splitlines()[-1]))

    first = driver("first")
    assert len(first) >= 2
    assert driver("second") == first


@pytest.mark.ray
def test_warm_workers_write_the_checkpoints_of_the_run_whose_lease_its_driver_holds(
    ray_session, digits, tmp_path
):
    """Processes another driver started (and gave back) write this run's checkpoints as this
    driver's: the run key's lease fences writers by the job they serve, not the one that
    started them."""
    from ringflow.engine.pool import release_idle
    from ringflow.storage import CheckpointStore
    from ringflow.storage.lease import RunLease

    release_idle()
    address = ray_session.get_runtime_context().gcs_address
    started = subprocess.run(
        [sys.executable, "-c", _ONE_FIT, digits.dataset_url, address, str(tmp_path / "first")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    theirs = set(json.loads(started.stdout.strip().splitlines()[-1]))
    store = str(tmp_path / "store")
    with RunLease.acquire(store, "leased", ttl_s=60):
        result = fit(
            DigitsClassifier,
            hparams={"hidden": 16},
            data=digits,
            config=TrainConfig(workers=2, epochs=1, batch_size=64, cpus_per_worker=0.5),
            checkpoint_uri=str(tmp_path / "model"),
            store_url=store,
            run_key="leased",
        )
    assert set(worker_pids()["idle"]) == theirs  # it ran on the other driver's processes
    written = CheckpointStore(store).checkpoints("leased")
    assert written, "no checkpoint was written"
    assert written[-1].step == len(result.history) * 23  # the epoch's end: 1438 rows / 64
