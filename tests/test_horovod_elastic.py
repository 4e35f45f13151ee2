"""Elastic Horovod on ringflow: a lost rank makes the others roll back to their last
``commit()`` in memory and go on; a worker started in its place joins at a commit.

The launcher's runs are real: ``ringflow-run --min-np 1 --max-np 2`` on a local Ray cluster
(``RAY_ADDRESS``), one rank's process SIGKILLed by PID while the script trains.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ringflow.horovod as hvd
from ringflow.horovod.membership import WORKER, Membership
from tests.support.fitting import relative_difference

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "tests" / "horovod_examples" / "pytorch_synthetic_benchmark_elastic.py"
LINEAR = ROOT / "tests" / "horovod_scripts" / "elastic_linear.py"


# --------------------------------------------------------------------------- the membership


def _joining(membership: Membership, worker: str, after: int = 0) -> dict:
    """``worker`` asks to join in a thread; the thread's answer once it came."""
    answer: dict = {}

    def ask() -> None:
        try:
            answer.update(membership.join(worker, "node-a", f"tcp://{worker}:1", after))
        except RuntimeError as err:
            answer["error"] = str(err)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    answer["_thread"] = thread
    return answer


def _wait(*answers: dict, timeout: float = 10.0) -> None:
    for answer in answers:
        answer["_thread"].join(timeout)
        assert not answer["_thread"].is_alive(), "join did not return"


@pytest.mark.unit
def test_the_first_generation_waits_for_every_worker_started_and_ranks_them_in_order():
    membership = Membership(np=2, min_np=1, max_np=2, drop_after_s=60)
    membership.started("0")
    membership.started("1")
    first = _joining(membership, "1")
    time.sleep(0.5)
    assert "rank" not in first  # worker 0 has not asked yet
    second = _joining(membership, "0")
    _wait(first, second)
    assert (first["generation"], first["rank"], first["size"]) == (1, 1, 2)
    assert (second["generation"], second["rank"], second["size"]) == (1, 0, 2)
    assert first["address"] == second["address"] == "tcp://0:1"  # rank 0's rendezvous
    assert not membership.updated(1)


@pytest.mark.unit
def test_survivors_form_the_next_generation_without_the_lost_worker_and_a_newcomer_waits():
    membership = Membership(np=2, min_np=1, max_np=2, drop_after_s=60)
    for worker in "01":
        membership.started(worker)
    _wait(_joining(membership, "0"), _joining(membership, "1"))

    assert membership.lost("0") is None  # rank 0 died; rank 1 saw it and asks again
    survivor = _joining(membership, "1", after=1)
    _wait(survivor)
    _, start, events, _ = membership.poll()
    assert start == 1  # the engine's coordinator: one worker starts in its place
    assert [e.kind for e in events] == ["lost", "rollback"]
    assert (survivor["generation"], survivor["rank"], survivor["size"]) == (2, 0, 1)
    assert survivor["address"] == "tcp://1:1"  # the new rank 0's own rendezvous

    membership.started("2")  # started in its place: it waits until the ranks reach a commit
    newcomer = _joining(membership, "2")
    time.sleep(0.5)
    assert "rank" not in newcomer
    assert membership.updated(2)
    assert not membership.updated(1)
    again = _joining(membership, "1", after=2)  # at its commit, rank 0 resets to take it in
    _wait(again, newcomer)
    assert (again["generation"], again["rank"], again["size"]) == (3, 0, 2)
    assert (newcomer["generation"], newcomer["rank"]) == (3, 1)
    _, start, events, gave_up = membership.poll()
    assert (start, [e.kind for e in events], gave_up) == (0, ["joined"], None)


@pytest.mark.unit
def test_a_rank_that_never_comes_to_the_reset_is_dropped_and_fewer_than_min_np_wait():
    membership = Membership(np=3, min_np=2, max_np=3, drop_after_s=0.5)
    for worker in "012":
        membership.started(worker)
    _wait(*(_joining(membership, w) for w in "012"))
    membership.lost("2")
    survivors = [_joining(membership, "0", after=1)]  # worker 1 is alive but stuck
    time.sleep(1.0)
    assert membership.poll()[0] == ["1"]
    membership.lost("1", "ended by the launcher")  # told again: no second loss, no backoff
    assert membership.poll()[1] == 2
    assert "rank" not in survivors[0]  # one rank is fewer than min_np: it waits
    membership.started("3")
    _wait(survivors[0], _joining(membership, "3"))
    assert (survivors[0]["rank"], survivors[0]["size"]) == (0, 2)
    stuck = _joining(membership, "1", after=1)
    _wait(stuck)
    assert "no longer one of the run's workers" in stuck["error"]


@pytest.mark.unit
def test_once_a_rank_finished_the_workers_still_waiting_are_ended_and_none_joins():
    membership = Membership(np=1, min_np=1, max_np=2, drop_after_s=60)
    membership.started("0")
    _wait(_joining(membership, "0"))
    membership.started("1")
    late = _joining(membership, "1")
    assert membership.finish("0") == ["1"]
    _wait(late)
    assert "no longer one of the run's workers" in late["error"]
    assert membership.poll() == ([], 0, [], None)  # finishing is no loss


@pytest.mark.unit
def test_more_workers_asked_for_start_and_join_at_a_commit_up_to_max_np():
    """What an executor's discovery does when it finds more slots: the membership asks for
    more workers (never past ``max_np``), and they join the ranks at their next commit."""
    membership = Membership(np=1, min_np=1, max_np=2, drop_after_s=60)
    membership.started("0")
    _wait(_joining(membership, "0"))
    assert membership.poll()[1] == 0
    membership.resize(5)
    assert membership.poll()[1] == 1  # bounded by max_np=2
    membership.started("1")
    newcomer = _joining(membership, "1")
    deadline = time.monotonic() + 10
    while not membership.updated(1, committed=True):  # at its commit, rank 0 sees it wait
        assert time.monotonic() < deadline, "the worker started never waited to join"
        time.sleep(0.05)
    again = _joining(membership, "0", after=1)
    _wait(again, newcomer)
    assert (again["rank"], newcomer["rank"], newcomer["size"]) == (0, 1, 2)
    assert membership.poll()[1] == 0
    membership.resize(1)  # fewer slots: the ranks there are stay, none is started
    membership.lost("1")
    assert membership.poll()[1] == 0


@pytest.mark.unit
def test_the_reset_limit_is_the_engine_coordinators_budget_each_loss_and_join_one():
    """Horovod's ``reset_limit``: how many times the ranks may change after the first
    generation. The engine's coordinator decides: no replacement starts whose join would
    pass it, and a loss past it ends the run with the coordinator's one-line reason."""
    membership = Membership(np=3, min_np=1, max_np=3, drop_after_s=60, reset_limit=2)
    for worker in "012":
        membership.started(worker)
    _wait(*(_joining(membership, w) for w in "012"))
    assert membership.updated(1, committed=True) is False  # rank 0's commit: step 1
    assert membership.lost("2", "killed by signal 9") is None  # reset 1
    _wait(*(_joining(membership, w, after=1) for w in "01"))
    dropped, start, events, gave_up = membership.poll()
    assert (dropped, start, gave_up) == ([], 1, None)
    assert [(e.kind, e.step, e.workers) for e in events] == [("lost", 1, 2), ("rollback", 1, 2)]
    membership.started("3")
    newcomer = _joining(membership, "3")
    assert membership.updated(2, committed=True) is True
    _wait(newcomer, *(_joining(membership, w, after=2) for w in "01"))  # reset 2: the join
    assert newcomer["size"] == 3
    _, start, events, _ = membership.poll()
    assert (start, [e.kind for e in events]) == (0, ["recovered", "joined"])
    reason = membership.lost("0", "killed by signal 9")  # reset 3, past the limit
    assert reason == (
        "3 resets of the group (each loss and each join is one), more than max_resets=2 "
        "(Horovod's reset_limit); last: killed by signal 9"
    )
    _, start, events, gave_up = membership.poll()
    assert (start, gave_up) == (0, reason)
    assert [e.kind for e in events] == ["lost", "gave_up"]
    stranded = _joining(membership, "1", after=3)
    _wait(stranded)
    assert stranded["error"] == f"the run gave up: {reason}"


@pytest.mark.unit
def test_a_replacement_lost_before_it_joined_backs_off_as_the_engines_do():
    now = [0.0]
    membership = Membership(np=2, min_np=1, max_np=2, drop_after_s=60, clock=lambda: now[0])
    for worker in "01":
        membership.started(worker)
    _wait(_joining(membership, "0"), _joining(membership, "1"))
    membership.lost("1")
    assert membership.poll()[1] == 1
    membership.started("2")
    assert membership.poll()[1] == 0  # started, not yet joined
    assert membership.lost("2", "it did not start") is None  # no reset: it never joined
    assert membership.poll()[1] == 0  # backing off (the policy's backoff_s, 1 s)
    now[0] = 1.5
    assert membership.poll()[1] == 1
    assert membership._coordinator.resets == 1


@pytest.mark.unit
def test_every_worker_lost_gives_up_with_the_coordinators_reason():
    membership = Membership(np=1, min_np=1, max_np=1, drop_after_s=60)
    membership.started("0")
    _wait(_joining(membership, "0"))
    assert membership.lost("0", "killed by signal 9") == (
        "every worker was lost; last: killed by signal 9"
    )
    assert membership.poll()[1] == 0


# --------------------------------------------------------------------------- real runs


class _Run:
    """``ringflow-run`` in the background, its ranks on the Ray cluster at ``ray``, its
    output read line by line as it comes."""

    def __init__(self, ray: str, *args: str) -> None:
        env = {**os.environ, "RAY_ADDRESS": ray}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ringflow.horovod.runner", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines: list[tuple[float, str]] = []

    def until(self, pattern: str, timeout: float = 240.0) -> float:
        """Read until a line matches ``pattern``; when it came."""
        deadline = time.monotonic() + timeout
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            if re.search(pattern, line):
                return self.lines[-1][0]
            assert time.monotonic() < deadline, f"no line matched {pattern!r}"
        raise AssertionError(f"the run ended before a line matched {pattern!r}:\n{self.text()}")

    def finish(self, timeout: float = 240.0) -> int:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
        return self.process.wait(timeout)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def kill_worker(self, worker: str, script: Path) -> None:
        """SIGKILL the process of ``worker`` running ``script`` (found by its variables)."""
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(script).encode() in command and f"{WORKER}={worker}".encode() in env:
                os.kill(int(pid), signal.SIGKILL)
                return
        raise AssertionError(f"no process of worker {worker} runs {script.name}")


ELASTIC = ("-np", "2", "--min-np", "1", "--max-np", "2", "--cpus-per-worker", "0.5")


@pytest.mark.integration
def test_horovods_elastic_example_loses_a_rank_goes_on_and_takes_a_new_one_in(launcher_ray):
    """Horovod's examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py, its import
    lines changed: worker 0 (rank 0) is killed mid-run; worker 1 rolls back to the last
    commit and goes on as rank 0 at once, the worker started in its place joins at a commit,
    and the run ends with 2 ranks."""
    run = _Run(
        launcher_ray,
        *ELASTIC,
        "--timeout-s",
        "20",
        sys.executable,
        str(EXAMPLE),
        "--no-cuda",
        "--model",
        "resnet18",
        "--batch-size",
        "2",
        "--num-warmup-batches",
        "1",
        "--num-batches-per-iter",
        "1",
        "--num-iters",
        "40",  # time enough for the worker started in its place to come up and join
    )
    run.until(r"^\[0\] Iter #2:")
    run.kill_worker("0", EXAMPLE)
    killed = time.monotonic()
    next_step = run.until(r"^\[1\] Iter #\d+:")
    print(f"from the kill to the survivor's next step: {next_step - killed:.2f} s")
    assert run.finish() == 0, run.text()[-4000:]
    text = run.text()
    assert "ringflow-run: worker 0 lost (killed by signal 9)" in text
    assert re.search(r"ringflow-run: lost at step \d+: 0: killed by signal 9 \(1 workers", text)
    assert re.search(r"ringflow-run: joined at step \d+: 2: .* \(2 workers", text)
    # The survivor rolls back to its last commit as rank 0, and the worker started in its
    # place joins at a later commit; or, where that worker is ready by the survivor's reset
    # (a busy machine's timing), both happen in that one reset.
    resets = re.findall(
        r"^\[1\] ringflow.horovod: (\d) -> (\d) ranks, this one rank (\d), in [\d.]+ s: (.*)",
        text,
        re.M,
    )
    lines = [line for line in text.splitlines() if "ringflow" in line]
    assert resets, lines
    assert (resets[0][0], resets[0][2]) == ("2", "0"), lines
    if resets[0][1] == "1":
        assert resets[0][3].startswith("rolled back"), lines
        assert ("1", "2") in [reset[:2] for reset in resets[1:]], lines
    assert resets[-1][1] == "2", lines
    assert "[1] Iter #39:" in text
    assert "[1] Total img/sec on 2 CPU(s)" in text  # the worker started in its place joined


@pytest.mark.integration
def test_a_rank_lost_and_replaced_mid_epoch_ends_with_the_weights_of_one_rank(
    tmp_path, launcher_ray
):
    """A fixed global batch split over the ranks there are, a commit each step: through a
    loss (2 -> 1 ranks) and a join (1 -> 2) the run ends with one rank's weights (run
    without the launcher), within rounding."""
    alone = subprocess.run(
        [sys.executable, str(LINEAR), "--out", str(tmp_path / "alone.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("RINGFLOW_HOROVOD")},
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    run = _Run(
        launcher_ray,
        *ELASTIC,
        "--timeout-s",
        "20",
        sys.executable,
        str(LINEAR),
        "--out",
        str(tmp_path / "elastic.pt"),
        "--step-s",
        "0.25",
        "--wait-for-ranks",
        "2",
    )
    run.until(r"^\[1\] step 5 of 2 ranks")
    run.kill_worker("1", LINEAR)
    assert run.finish() == 0, run.text()[-4000:]
    text = run.text()
    assert re.search(r"\[0\] step \d+ of 1 ranks", text)
    assert re.search(r"\[0\] ringflow.horovod: 1 -> 2 ranks", text)
    assert re.search(r"\[2\] step \d+ of 2 ranks", text)  # the worker in its place trained
    alone_, elastic = (torch.load(tmp_path / f"{n}.pt") for n in ("alone", "elastic"))
    assert elastic["steps"] == alone_["steps"] == 24
    assert relative_difference(elastic["weights"], alone_["weights"]) < 1e-5


def elastic_training(steps: int = 12, die_at: int = 4) -> dict:
    """Horovod's elastic form in a function: a global batch of 8 split over the ranks there
    are, a commit each step. Worker 1 kills its own process after step ``die_at``; once
    alone, the survivor waits at a commit for the worker started in its place."""
    hvd.init()
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x @ torch.randn(4, 1)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sizes = []

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            start = state.step % 4 * 8
            xb, yb = x[start : start + 8], y[start : start + 8]
            share = slice(hvd.rank(), None, hvd.size())
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(xb[share]), yb[share]).backward()
            optimizer.step()
            state.step += 1
            sizes.append(hvd.size())
            if os.environ.get(WORKER) == "1" and state.step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            state.commit()
            deadline = time.monotonic() + 120
            while hvd.size() == 1 and WORKER in os.environ and time.monotonic() < deadline:
                time.sleep(0.1)
                state.check_host_updates()

    train(hvd.elastic.TorchState(model, optimizer, step=0))
    return {"weights": model.state_dict(), "sizes": sizes}


def test_horovod_run_with_min_np_goes_on_through_a_lost_rank_and_takes_a_new_one_in(
    ray_session,
):
    alone = elastic_training()
    hvd.shutdown()
    results = hvd.run(elastic_training, np=2, min_np=1, max_np=2, cpus_per_worker=0.5)
    assert len(results) == 2  # worker 0 and the one started in place of worker 1
    survivor = results[0]
    assert survivor["sizes"][:4] == [2, 2, 2, 2]
    assert 1 in survivor["sizes"]
    assert survivor["sizes"][-1] == 2
    for result in results:
        assert relative_difference(result["weights"], alone["weights"]) < 1e-6


@pytest.mark.integration
def test_an_elastic_run_past_its_reset_limit_ends_with_the_coordinators_reason(
    tmp_path, launcher_ray
):
    """``--reset-limit 0`` (Horovod's: the ranks may not change): worker 1 dies, and the
    engine's coordinator gives up; the launcher says why in its one line and exits 1."""
    script = tmp_path / "dies.py"
    script.write_text(
        "import os, signal, time\nimport torch\nimport ringflow.horovod as hvd\n"
        "hvd.init()\nhvd.allreduce(torch.ones(1))\n"
        "if os.environ['RINGFLOW_HOROVOD_WORKER'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(120)\n"
    )
    run = _Run(
        launcher_ray, "-np", "2", "--min-np", "1", "--reset-limit", "0", "--cpus-per-worker", "0.5",
        sys.executable, str(script),
    )  # fmt: skip
    assert run.finish() == 1, run.text()[-4000:]
    text = run.text()
    assert "ringflow-run: worker 1 lost (killed by signal 9)" in text
    assert "ringflow-run: lost at step 0: 1: killed by signal 9 (1 workers" in text
    assert text.count("lost (killed by signal 9)") == 1  # no worker started in its place
    assert (
        "ringflow-run: gave up: 1 resets of the group (each loss and each join is one), more "
        "than max_resets=0 (Horovod's reset_limit); last: killed by signal 9"
    ) in text


def test_horovod_run_past_its_reset_limit_raises_the_coordinators_reason(ray_session):
    def dies(_):
        hvd.init()
        hvd.allreduce(torch.ones(1))
        if os.environ[WORKER] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)

    with pytest.raises(hvd.HorovodError, match=r"gave up: 1 resets .* max_resets=0"):
        hvd.run(dies, args=(None,), np=2, min_np=1, reset_limit=0, cpus_per_worker=0.5)


# --------------------------------------------------------------------------- TorchState


def _training_objects():
    model = torch.nn.Linear(2, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    sampler = hvd.elastic.ElasticSampler(list(range(8)), shuffle=False)
    return model, optimizer, scheduler, sampler


def test_restore_loads_the_last_commit_into_the_users_own_objects():
    """A scheduler, an optimizer and a sampler in a ``TorchState`` are rolled back in
    place: the scheduler still drives the optimizer the script steps (Horovod's keeps the
    scheduler as a pickled value, so after a sync it drives a copy)."""
    hvd.init()  # rank 0 of 1
    try:
        _commit_step_and_restore()
    finally:
        hvd.shutdown()


def _commit_step_and_restore():
    model, optimizer, scheduler, sampler = _training_objects()
    state = hvd.elastic.TorchState(model, optimizer, scheduler=scheduler, sampler=sampler, epoch=0)
    state.commit()
    weight = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    scheduler.step()
    sampler.record_batch(0, 2)
    state.epoch = 1
    state.restore()
    assert (state.model, state.optimizer) == (model, optimizer)
    assert (state.scheduler, state.sampler) == (scheduler, sampler)
    assert scheduler.optimizer is optimizer
    assert torch.equal(model.weight, weight)
    assert optimizer.param_groups[0]["lr"] == 0.1  # put back, as the scheduler says
    assert (scheduler.last_epoch, scheduler.get_last_lr()) == (0, [0.1])
    assert (sampler.processed_num, state.epoch) == (0, 0)
    scheduler.step()  # the scheduler the script holds drives the optimizer it steps
    assert optimizer.param_groups[0]["lr"] == 0.05


def synced_state() -> dict:
    """Rank 1's objects differ from rank 0's; ``sync`` gives every rank rank 0's."""
    hvd.init()
    model, optimizer, scheduler, sampler = _training_objects()
    for _ in range(hvd.rank() * 2):
        scheduler.step()
    state = hvd.elastic.TorchState(model, optimizer, scheduler=scheduler, sampler=sampler)
    state.sync()
    return {
        "lr": optimizer.param_groups[0]["lr"],
        "last epoch": scheduler.last_epoch,
        "own objects": state.scheduler is scheduler and scheduler.optimizer is optimizer,
    }


def test_sync_gives_every_rank_rank_0s_scheduler_in_its_own_objects(ray_session):
    first, second = hvd.run(synced_state, np=2, cpus_per_worker=0.5)
    assert first == second == {"lr": 0.1, "last epoch": 0, "own objects": True}
