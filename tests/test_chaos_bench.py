"""``bench.chaos`` on a short schedule: every runner (ours, Ray TorchTrainer, torchft) trains
uninterrupted and then through a worker kill, a second and a kill of its whole training
process, and the benchmark prints its table and its JSON with the figures the issue names.
Ours must come through every failure; a peer that does not is reported with why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.integration
DEADLINE_S = 300
"""Seconds a runner's training run may take (a minute idle, two under the suite's load)."""
EPOCHS = 150
"""Enough for ours' run (the fastest) to outlast the schedule's three failures, 3 s apart."""


def test_ours_survives_the_schedule_and_every_runners_goodput_or_failure_is_reported(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # private Rays
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "bench.chaos", "--hidden", "64", "--layers", "2", "--epochs", str(EPOCHS)),
            *("--every", "3", "--warmup", "1", "--process-every", "3", "--failures", "3"),
            *("--keep", str(tmp_path), "--deadline", str(DEADLINE_S)),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=6 * DEADLINE_S + 300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert "ours" not in summary["notes"], summary["notes"]
    assert summary["runners"]["ours"]["crashes"] == []  # ours never fails on its own
    for runner in ("ours", "torchtrainer", "torchft"):
        if runner in summary["notes"]:
            # A peer that never comes back from a failure (TorchTrainer's restarted group
            # once waited forever on a loaded machine) is stopped and reported as such; one
            # that fails on its own is reported with the last words of its error.
            note = summary["notes"][runner]
            assert "did not finish within" in note or "training failed" in note, note
            assert "INFO worker.py" not in note, note  # its error, not Ray's log lines
            assert summary["goodput"][runner] is None, summary
            assert any(line.startswith(f"{runner} ") and "not run" in line for line in lines)
            warnings.warn(f"bench.chaos: {summary['notes'][runner]}", stacklevel=1)
            continue
        row = summary["runners"][runner]
        assert row["failures"] == 3, (runner, row)
        assert row["process_failures"] == 1, (runner, row)
        assert 0 < summary["goodput"][runner] <= 1.5, (runner, summary["goodput"])
        assert 0 <= summary["final_loss_rel_diff"][runner] < 1, (runner, summary)
        assert row["kill_to_step_median_s"] is not None, (runner, row)
        assert any(line.startswith(f"{runner} ") for line in lines), lines
        # every step was trained: the last logged is the uninterrupted run's last
        calm, chaos = (
            (tmp_path / f"{runner}-{run}" / "steps.log").read_text().split()
            for run in ("calm", "chaos")
        )
        assert int(chaos[-1]) == int(calm[-1]), (runner, calm[-2:], chaos[-2:])
        assert int(calm[-1]) % EPOCHS == 0, (runner, calm[-2:])  # whole epochs of steps
    # Ours keeps the math of the uninterrupted run (a fixed global batch, rolled back to a
    # commit): only rounding parts them, where a wrong rollback would leave weights far off.
    # torchft's steps with a peer missing take another course (measured 6e-2).
    assert summary["final_loss_rel_diff"]["ours"] < 1e-2, summary


def test_a_failed_runner_is_reported_with_its_error_not_rays_log_lines(tmp_path):
    from bench.chaos import _last_words

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "output.log").write_text(
        "2026-12-05 10:05:01,214\tINFO worker.py:1691 -- Using address 127.0.0.1:38555\n"
        "Traceback (most recent call last):\n"
        '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
        "ray.exceptions.RayTaskError(ValueError): the checkpoint is gone\n"
        "(pid=31) 2026-12-05 10:05:02,001\tINFO worker.py:2038 -- Connected to Ray cluster.\n"
    )
    words = _last_words(str(tmp_path), "run")
    assert words.endswith("RayTaskError(ValueError): the checkpoint is gone"), words
    assert "INFO" not in words, words


def test_a_memory_run_never_kills_the_oldest_worker():
    """``--spare-oldest``: the worker that started first lives through every kill, so its
    memory shows what the recoveries leave behind."""
    import random
    import time

    from bench.chaos import Runner, _kill_a_worker, _workers

    class Looking(Runner):
        """Workers told by their title alone (``Ours`` counts only the pool's leased ones
        where this process holds a Ray, as a session's earlier tests may have left it)."""

        name, worker_title = "looking", "ringflow-test-chaos-worker"

    title = Looking.worker_title
    started = []
    try:
        for _ in range(3):  # processes that look like ours' workers, oldest first
            started.append(
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", title])
            )
            time.sleep(0.05)
        oldest = started[0].pid
        rng = random.Random(0)
        for left in (3, 2):
            assert _workers(Looking()) == sorted(p.pid for p in started if p.poll() is None)
            assert _kill_a_worker(Looking(), rng, left, spare_oldest=True)
            time.sleep(0.2)
            for proc in started[1:]:
                proc.poll()  # reaped: no longer among the workers
        assert started[0].poll() is None  # alive: never chosen
        assert [p.wait(timeout=5) for p in started[1:]] == [-9, -9]
        # the oldest alone is never killed: nothing else to choose
        assert _kill_a_worker(Looking(), rng, 1, spare_oldest=True) is False
        assert started[0].poll() is None
        assert _workers(Looking()) == [oldest]
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def test_memory_is_read_between_the_warm_up_and_the_last_step():
    """What a process holds after training (the final weights loaded for the loss) is not
    read as growth over the failures."""
    from bench.chaos import Ours, _Memory

    memory = _Memory(Ours(), child=lambda: None)
    memory.warmed_at = 10.0
    # pid 1 lived longest; the sample at t=50 is after the last step (t=40)
    memory._processes = {
        1: [(-6.0, 10, 10), (5.0, 90, 80), (10.0, 100, 90), (40.0, 101, 91), (50.0, 200, 190)]
    }
    # worker 2 lived longest; its first 15 s it was starting
    memory._workers = {
        2: [(12.0, 30, 20), (27.0, 300, 200), (39.0, 310, 205)],
        3: [(30.0, 900, 800), (31.0, 900, 800)],
    }
    assert memory.summary(until=40.0) == {
        "process": {"rss": (100, 101), "private": (90, 91)},
        "survivor": {"rss": (300, 310), "private": (200, 205)},
    }
