"""Hyperparameter search: bad input fails before trials, the searcher and scheduler without a
cluster, a small search on the session's Ray, and a search killed mid-way that resumes."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringflow.engine import TrainConfig
from ringflow.engine.tuning import SearchConfig, parse_space, search
from ringflow.models.digits import DigitsClassifier

ROOT = Path(__file__).resolve().parents[1]
BASE = {"lr": 0.01, "hidden": 16}
SPACE = {"lr": {"loguniform": [0.001, 0.1]}, "hidden": [8, 16, 32]}


def _search(digits, tmp_path, *, space=SPACE, **config):
    return search(
        DigitsClassifier,
        base_hparams=BASE,
        space=space,
        data=digits,
        train_config=TrainConfig(workers=1, batch_size=64),
        storage_url=str(tmp_path / "storage"),
        run_key="search",
        config=SearchConfig(**config),
    )


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({}, "search space is empty"),
        ({"dropout": [0.1, 0.2]}, "DigitsClassifier does not take"),
        ({"hidden": [0, 8]}, "'hidden' allows 0"),
        ({"lr": {"loguniform": [0, 0.1]}}, "must be a non-empty list"),
        ({"lr": {"normal": [0.1, 0.2]}}, "must be a non-empty list"),
        ({"hidden": []}, "must be a non-empty list"),
        ({"batch_size": [0, 32]}, "'batch_size' allows 0"),
    ],
)
def test_a_bad_space_fails_before_any_trial(digits, tmp_path, space, message):
    with pytest.raises(ValueError, match=message):
        _search(digits, tmp_path, space=space)
    assert not (tmp_path / "storage").exists()


def test_a_metric_no_trial_reports_fails_before_any_trial(digits, tmp_path):
    with pytest.raises(ValueError, match=r"metric 'val_f1' is not reported .*val_accuracy"):
        _search(digits, tmp_path, metric="val_f1")
    assert not (tmp_path / "storage").exists()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("algorithm", "bayesopt", r"one of \['evolution', 'random'\]"),
        ("trials", 0, "trials must be a positive integer"),
        ("mode", "best", "mode must be 'max' or 'min'"),
        ("grace_period", 5, "must not exceed epochs"),
        ("max_concurrent", 0, "max_concurrent must be None or at least 1"),
    ],
)
def test_search_config_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SearchConfig(**{field: value})


# --------------------------------------------------------------------------- without a cluster


def test_evolution_starts_from_the_base_is_seeded_and_climbs_from_the_best():
    from ringflow.engine.tuning import _Evolution

    def run(seed):
        evo = _Evolution(parse_space(SPACE), BASE, metric="acc", mode="max", seed=seed, initial=2)
        configs = [evo.suggest(f"t{i}") for i in range(3)]
        evo.observe("t1", {"acc": 0.5, "epoch": 3})  # went furthest: the parent
        evo.observe("t0", {"acc": 0.9, "epoch": 1})  # better metric, but stopped early
        return evo, configs + [evo.suggest(f"t{i}") for i in range(3, 8)]

    evo, configs = run(seed=1)
    assert configs[0] == BASE
    assert configs == run(seed=1)[1]
    assert configs != run(seed=2)[1]
    for config in configs:
        assert 0.001 <= config["lr"] <= 0.1
        assert config["hidden"] in (8, 16, 32)
    assert max(evo.scores, key=evo.scores.__getitem__) == "t1"


def _tune_trial(trial_id, tune_id=None):
    """A Tune trial as the scheduler sees one: Tune's own id, ringflow's id in its config."""
    from types import SimpleNamespace

    return SimpleNamespace(trial_id=tune_id or f"tune-{trial_id}", config={"trial": trial_id})


def test_the_scheduler_starts_from_every_recorded_result():
    """A rebuilt search hands ASHA every recorded result, keyed by ringflow's trial ids."""
    from ringflow.engine.tuning import _resumable_asha

    stopped = []
    seen = {"00000": [(1, 0.9), (2, 0.95)], "00001": [(1, 0.8)]}
    asha = _resumable_asha(SearchConfig(epochs=4), seen, on_stop=lambda t, r: stopped.append(t))
    rungs = dict(asha._brackets[0]._rungs)
    assert rungs[1] == {"00000": 0.9, "00001": 0.8}
    assert rungs[2] == {"00000": 0.95}
    # A resumed trial, under a new Tune id, is not compared again at a rung it passed...
    resumed = _tune_trial("00001", tune_id="new-id")
    asha.on_trial_add(None, resumed)
    assert asha.on_trial_result(None, resumed, {"epoch": 1, "val_accuracy": 0.1}) == "CONTINUE"
    # ...and a new trial below the recorded rung's cutoff is stopped, as it would have been.
    new = _tune_trial("00002")
    asha.on_trial_add(None, new)
    assert asha.on_trial_result(None, new, {"epoch": 1, "val_accuracy": 0.1}) == "STOP"
    assert stopped == ["00002"]


def test_the_base_trial_is_never_stopped_early():
    from ringflow.engine.tuning import _resumable_asha

    asha = _resumable_asha(SearchConfig(epochs=4), {"00003": [(1, 0.9)]}, base_trial="00000")
    base, other = _tune_trial("00000"), _tune_trial("00001")
    for trial in (base, other):
        asha.on_trial_add(None, trial)
    low = {"epoch": 1, "val_accuracy": 0.1}
    assert asha.on_trial_result(None, base, low) == "CONTINUE"
    assert asha.on_trial_result(None, other, low) == "STOP"


def test_random_search_proposes_by_trial_number_the_base_first():
    """Trial i's configuration depends on the seed and i only: a resumed search proposes the
    trials it had not started exactly as the uninterrupted one would have."""
    from ringflow.engine.tuning import _random_search

    dims = parse_space(SPACE)

    def proposals(seed, order):
        proposer = _random_search(dims, BASE, SearchConfig(), seed)
        return {i: proposer.suggest(f"{i:05d}") for i in order}

    first = proposals(3, [0, 1, 2, 3])
    assert first[0] == BASE
    assert first == proposals(3, [3, 2, 1, 0])
    assert first[1] != first[2]
    assert first[1] != proposals(4, [1])[1]


# --------------------------------------------------------------------------- with Ray


@pytest.mark.ray
def test_a_search_keeps_the_base_trial_and_returns_the_best_checkpoint(
    ray_session, digits, tmp_path
):
    from ringflow.storage import load_model

    result = _search(digits, tmp_path, trials=3, epochs=2, algorithm="evolution")
    assert len(result.trials) == 3
    base = [t for t in result.trials if t.is_base]
    assert len(base) == 1
    assert base[0].params == BASE
    assert result.best_metric >= result.base_metric
    assert all(t.executions == 1 for t in result.trials)
    assert all(t.state in ("completed", "stopped early") for t in result.trials)
    for t in result.trials:
        assert len(t.curve) == t.epochs
        assert t.state != "completed" or t.epochs == 2
    module, _ = load_model(result.best_checkpoint)
    assert module.hparams.hidden == result.best_params["hidden"]


_SCRIPT = """
import json, sys
import ray
from ringflow.engine import DataSpec, TrainConfig
from ringflow.engine.tuning import SearchConfig, search
from ringflow.models.digits import SCHEMA, DigitsClassifier

dataset_url, storage_url, state_dir = sys.argv[1:4]
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
result = search(
    DigitsClassifier,
    base_hparams={"lr": 0.01, "hidden": 16},
    space={"lr": {"loguniform": [0.001, 0.1]}, "hidden": [8, 16, 32]},
    data=DataSpec(dataset_url=dataset_url, schema=SCHEMA),
    train_config=TrainConfig(workers=1, batch_size=32),
    storage_url=storage_url,
    run_key="killed",
    config=SearchConfig(
        trials=3, epochs=2, max_concurrent=1, checkpoint_every=5, state_dir=state_dir
    ),
)
print("RESULT " + json.dumps({
    "resumed": result.resumed,
    "trials": {t.trial_id: [t.state, t.executions, t.epochs] for t in result.trials},
    "ignored": result.ignored_files,
}), flush=True)
"""


def _start(digits, storage: Path, state_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "TUNE_"))}
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, digits.dataset_url, str(storage), str(state_dir)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the whole tree (Ray included) is killed, as on preemption
    )


def _unfinished_with_checkpoint(storage: Path) -> set[str]:
    """Trials killed mid-training after a committed checkpoint (neither done nor stopped)."""
    trials = storage / "tune" / "killed" / "trials"
    return {
        trial.name
        for trial in trials.glob("*")
        if not (trial / "done.json").exists()
        and not (trial / "stopped.json").exists()
        and list(storage.glob(f"checkpoints/killed-trial-{trial.name}/*/manifest.json"))
    }


def _sentinel_pickle(sentinel: Path) -> bytes:
    """A pickle that, once loaded, creates ``sentinel``: what a bucket writer could plant."""

    class Plant:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    return pickle.dumps(Plant())


def _is_pickle(path: Path) -> bool:
    with path.open("rb") as f:
        return path.suffix in (".pkl", ".pickle") or f.read(1) == b"\x80"


@pytest.mark.ray
def test_a_search_killed_mid_way_resumes_without_rerunning_finished_trials_or_unpickling(
    digits, tmp_path
):
    """Killed mid-search, then a pickle that writes a sentinel file planted in place of every
    file Ray Tune keeps for the experiment: the search resumes from its own JSON records,
    never loads a plant, and reports each one."""
    storage, scratch = tmp_path / "storage", tmp_path / "tune-scratch"
    trials = storage / "tune" / "killed" / "trials"
    first = _start(digits, storage, scratch)
    try:
        deadline = time.monotonic() + 300
        while not (list(trials.glob("*/done.json")) and _unfinished_with_checkpoint(storage)):
            assert first.poll() is None, first.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no trial finished within 5 minutes"
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finished = {p.parent.name for p in trials.glob("*/done.json")}
    stopped = {p.parent.name for p in trials.glob("*/stopped.json")}
    interrupted = _unfinished_with_checkpoint(storage)
    assert not [p for p in storage.rglob("*") if p.is_file() and _is_pickle(p)]

    # Plant: every file Tune left in its scratch directory (tuner.pkl, its searcher's and
    # trials' states...), at the same place under the search's directory in storage_url.
    sentinel = tmp_path / "sentinel"
    pickle.loads(_sentinel_pickle(tmp_path / "proof"))  # the plant works: loading writes it
    assert (tmp_path / "proof").exists()
    (experiment,) = scratch.glob("killed")
    planted = sorted(str(p.relative_to(experiment)) for p in experiment.rglob("*") if p.is_file())
    assert "tuner.pkl" in planted, planted
    for rel in planted:
        target = storage / "tune" / "killed" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_sentinel_pickle(sentinel))

    second = _start(digits, storage, scratch)
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out[-3000:]
    assert not sentinel.exists()
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert set(planted) <= set(result["ignored"]), result["ignored"]
    assert "tuner.pkl" in out.split("ignored", 1)[1].split("\n", 1)[0]  # the warning names it
    assert result["resumed"] is True
    states = result["trials"]
    assert len(states) == 3
    for trial_id in finished:
        assert states[trial_id][:2] == ["completed", 1], states
    for trial_id in stopped:
        assert states[trial_id][:2] == ["stopped early", 1], states
    for trial_id in interrupted:  # ran again, from its checkpoint rather than from scratch
        assert states[trial_id][1] == 2, states
        starts = [json.loads(p.read_text()) for p in (trials / trial_id / "starts").glob("*")]
        assert max(s["resumes_from_step"] or 0 for s in starts) >= 5, starts
    assert all(state in ("completed", "stopped early") for state, _, _ in states.values())
