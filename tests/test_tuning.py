"""Hyperparameter search: bad input fails before trials, the searcher and scheduler without a
cluster, a small search on the session's Ray, and a search killed mid-way that resumes."""

from __future__ import annotations

import json
import os
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


def test_the_scheduler_replays_the_results_of_restored_trials():
    """Tune does not save its scheduler: a restored search hands ASHA every result again."""
    from types import SimpleNamespace

    from ringflow.engine.tuning import _resumable_asha

    cfg = SearchConfig(epochs=4)
    seen = {"a": [(1, 0.9), (2, 0.95)], "b": [(1, 0.8)]}
    asha = _resumable_asha(cfg, seen)
    for trial_id in ("a", "b", "c"):
        asha.on_trial_add(None, SimpleNamespace(trial_id=trial_id))
    rungs = dict(asha._brackets[0]._rungs)
    assert rungs[1] == {"a": 0.9, "b": 0.8}
    assert rungs[2] == {"a": 0.95}
    # A new trial below the restored rung's cutoff is stopped, as it would have been.
    decision = asha.on_trial_result(
        None, SimpleNamespace(trial_id="c"), {"epoch": 1, "val_accuracy": 0.1}
    )
    assert decision == "STOP"


def test_the_base_trial_is_never_stopped_early():
    from types import SimpleNamespace

    from ringflow.engine.tuning import _resumable_asha

    asha = _resumable_asha(SearchConfig(epochs=4), {"a": [(1, 0.9)]}, base=BASE)
    base, other = SimpleNamespace(trial_id="b", config=BASE), SimpleNamespace(trial_id="c")
    for trial in (SimpleNamespace(trial_id="a"), base, other):
        asha.on_trial_add(None, trial)
    low = {"epoch": 1, "val_accuracy": 0.1}
    assert asha.on_trial_result(None, base, low) == "CONTINUE"
    assert asha.on_trial_result(None, other, low) == "STOP"


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

dataset_url, storage_url = sys.argv[1:3]
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
result = search(
    DigitsClassifier,
    base_hparams={"lr": 0.01, "hidden": 16},
    space={"lr": {"loguniform": [0.001, 0.1]}, "hidden": [8, 16, 32]},
    data=DataSpec(dataset_url=dataset_url, schema=SCHEMA),
    train_config=TrainConfig(workers=1, batch_size=32),
    storage_url=storage_url,
    run_key="killed",
    config=SearchConfig(trials=3, epochs=2, max_concurrent=1, checkpoint_every=5),
)
print("RESULT " + json.dumps({
    "resumed": result.resumed,
    "trials": {t.trial_id: [t.state, t.executions, t.epochs] for t in result.trials},
}), flush=True)
"""


def _start(digits, storage: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "TUNE_"))}
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, digits.dataset_url, str(storage)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the whole tree (Ray included) is killed, as on preemption
    )


def _unfinished_with_checkpoint(storage: Path) -> set[str]:
    """Trials killed mid-training after a committed checkpoint."""
    trials = storage / "tune" / "killed" / "trials"
    return {
        trial.name
        for trial in trials.glob("*")
        if not (trial / "done.json").exists()
        and list(
            storage.glob(f"checkpoints/killed-trial-{trial.name.replace('_', '-')}/*/manifest.json")
        )
    }


@pytest.mark.ray
def test_a_search_killed_mid_way_resumes_without_rerunning_finished_trials(digits, tmp_path):
    storage = tmp_path / "storage"
    trials = storage / "tune" / "killed" / "trials"
    first = _start(digits, storage)
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
    interrupted = _unfinished_with_checkpoint(storage)

    second = _start(digits, storage)
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out[-3000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["resumed"] is True
    states = result["trials"]
    assert len(states) == 3
    for trial_id in finished:
        assert states[trial_id][:2] == ["completed", 1], states
    for trial_id in interrupted:  # ran again, from its checkpoint rather than from scratch
        assert states[trial_id][1] == 2, states
        starts = [json.loads(p.read_text()) for p in (trials / trial_id / "starts").glob("*")]
        assert max(s["resumes_from_step"] or 0 for s in starts) >= 5, starts
    assert all(state in ("completed", "stopped early") for state, _, _ in states.values())
