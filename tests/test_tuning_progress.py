"""What a user sees of a search: a line as each trial starts and as it ends, printed while the
search runs and kept in the Prefect run's logs; no TensorBoard hint into Ray's temp dir."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
TRIALS = ("00000", "00001", "00002")
_LINE = re.compile(r"trial (\d{5})(?: \(base\))? (started|completed|stopped early|failed)")


def test_a_line_per_trial_is_printed_as_the_search_runs(tmp_path):
    storage = tmp_path / "storage"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "TUNE_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "ringflow.flows.train_pipeline", "--no-serve"]
    command += ["--storage-url", str(storage), "--run-key", "progress", "--workers", "1"]
    command += ["--tune-trials", "3", "--tune-epochs", "1", "--use-best-checkpoint"]
    command += ["--tune-max-concurrent", "1"]  # one trial after the other
    flow = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, events = [], []
    try:
        for line in flow.stdout:
            lines.append(line)
            match = _LINE.search(line)
            if match:  # with what the run had done when the line arrived
                events.append((*match.groups(), _progress(storage)))
        flow.wait(timeout=60)
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, 9)
    out = "".join(lines)
    assert flow.returncode == 0, out[-4000:]
    result = next(line for line in reversed(lines) if line.startswith("{"))  # stdout's last
    assert json.loads(result)["tune"]["best_params"]

    assert [(t, what) for t, what, _ in events] == [
        (trial, what) for trial in TRIALS for what in ("started", "completed")
    ], out[-4000:]
    for trial, what, (started, done, registered) in events:
        # Read while the search ran: a trial's start before it finished, its end before the
        # trial after next started, and all of them before the flow went on to register.
        if what == "started":
            assert trial not in done, (trial, what, done)
        assert not {t for t in started if int(t) >= int(trial) + 2}, (trial, what, started)
        assert not registered, (trial, what)
    assert "tensorboard" not in out.lower()
    assert "ringflow-tune-" not in out  # nor anything else pointing into Tune's scratch dir

    (database,) = (tmp_path / "prefect").glob("*.db")
    with sqlite3.connect(database) as db:
        logged = [m for (m,) in db.execute("SELECT message FROM log")]
    for trial in TRIALS:
        for what in ("started", "completed"):
            assert any(re.match(rf"trial {trial}( \(base\))? {what}", m) for m in logged), logged


def _progress(storage: Path) -> tuple[set[str], set[str], bool]:
    """Trials started, trials done, and whether the flow registered a model after the search."""
    trials = storage / "tune" / "progress" / "trials"
    started = {p.parent.name for p in trials.glob("*/starts")}
    done = {p.parent.name for p in trials.glob("*/done.json")}
    return started, done, (storage / "registry").exists()
