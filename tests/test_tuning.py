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
from ringflow.models.digits import DigitsClassifier
from ringflow.tuning import SearchConfig, parse_space, search

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
    from ringflow.tuning.space import _Evolution

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


def _layout(path):
    from ringflow.storage.retry import RetryPolicy
    from ringflow.tuning.records import RecordStorage, SearchLayout

    return SearchLayout(
        storage_url=str(path), run_key="search", storage=RecordStorage(RetryPolicy())
    )


def _files(layout):
    """Every record of the search, by path: what a resumed search is rebuilt from."""
    found = layout.storage.find(layout.tune_dir)
    return {rel: layout.storage.read(f"{layout.tune_dir}/{rel}") for rel in sorted(found)}


# The metric of 4 trials at every epoch, run one after the other (max_concurrent=1).
# Rungs at epochs 1, 2 and 4: 00001 is stopped at 1 (below the base), 00002 at 2.
_CURVES = {
    "00000": [0.90, 0.95, 0.96, 0.97],
    "00001": [0.80, 0.85, 0.90, 0.95],
    "00002": [0.92, 0.93, 0.99, 0.99],
    "00003": [0.91, 0.96, 0.97, 0.98],
}


def _run_sequentially(layout, *, kill=None, skip=0):
    """Run ``_CURVES`` under the scheduler as a search with one trial at a time does: each
    epoch recorded, then reported; the last one after ``done.json``. ``kill=(trial, epoch)``
    ends it once that epoch is recorded, before ASHA sees it (and returns ``None``);
    ``skip``: a resumed trial reports only its epochs after this one (its checkpoint was taken
    at that epoch's end). Returns ASHA's answer to every result."""
    from ringflow.tuning.run import _resumable_asha

    history = layout.history()
    asha = _resumable_asha(
        SearchConfig(epochs=4),
        history.trials,
        base_trial="00000",
        on_stop=lambda t, r: layout.trial(t).stopped(epoch=r["epoch"]),
        on_decision=lambda t, d: layout.trial(t).decided(d),
    )
    finished = {t for t, r in layout.history().trials.items() if r.finished}
    decisions = {}
    for trial_id, curve in _CURVES.items():
        if trial_id in finished:
            continue
        trial = _tune_trial(trial_id, tune_id=f"{trial_id}-{id(asha)}")
        records = layout.trial(trial_id)
        asha.on_trial_add(None, trial)
        first = skip if trial_id in history.trials else 0
        for epoch, value in list(enumerate(curve, 1))[first:]:
            result = {"epoch": epoch, "val_accuracy": value}
            if epoch < 4:
                records.epoch(result)
            else:
                records.finish(checkpoint="model", last=result, resumed_from=None)
            if (trial_id, epoch) == kill:
                return None
            decisions[trial_id, epoch] = asha.on_trial_result(None, trial, result)
            if decisions[trial_id, epoch] == "STOP":
                break
        asha.on_trial_complete(None, trial, result)
    return decisions


def test_every_decision_of_the_early_stopping_scheduler_is_recorded_as_it_is_made(tmp_path):
    layout = _layout(tmp_path)
    decisions = _run_sequentially(layout)
    assert decisions[("00001", 1)] == decisions[("00002", 2)] == "STOP"
    rungs = {k: v for k, v in _files(layout).items() if "/rungs/" in k}
    assert rungs == {
        "trials/00000/rungs/000001.json": {"epoch": 1, "value": 0.9, "decision": "continue"},
        "trials/00000/rungs/000002.json": {"epoch": 2, "value": 0.95, "decision": "continue"},
        "trials/00001/rungs/000001.json": {"epoch": 1, "value": 0.8, "decision": "stop"},
        "trials/00002/rungs/000001.json": {"epoch": 1, "value": 0.92, "decision": "continue"},
        "trials/00002/rungs/000002.json": {"epoch": 2, "value": 0.93, "decision": "stop"},
        "trials/00003/rungs/000001.json": {"epoch": 1, "value": 0.91, "decision": "continue"},
        "trials/00003/rungs/000002.json": {"epoch": 2, "value": 0.96, "decision": "continue"},
    }
    assert layout.history().trials["00002"].stopped_at == 2


# Every epoch the uninterrupted search records: 00001 trains 1 epoch, 00002 trains 2.
_KILLS = [("00000", e) for e in (1, 2, 3, 4)] + [("00001", 1), ("00002", 1), ("00002", 2)]
_KILLS += [("00003", e) for e in (1, 2, 3, 4)]


@pytest.mark.parametrize("skip", [0, 1], ids=["rerun-from-its-start", "resumed-after-that-epoch"])
@pytest.mark.parametrize("kill", _KILLS, ids=[f"{t}-epoch-{e}" for t, e in _KILLS])
def test_a_search_killed_before_asha_decides_resumes_to_the_same_decisions(tmp_path, kill, skip):
    """Killed once an epoch is recorded but before ASHA decided on it, the search resumes
    with every decision made before the kill replayed, the one cut off made on the same
    rungs, and so the same decisions as the uninterrupted search, one trial at a time. The
    resumed trial reports that epoch again, or (``skip``) only the epochs after it."""
    whole, killed = _layout(tmp_path / "whole"), _layout(tmp_path / "killed")
    _run_sequentially(whole)
    assert _run_sequentially(killed, kill=kill) is None
    assert not any(k.startswith(f"trials/{kill[0]}/rungs/{kill[1]:06d}") for k in _files(killed))
    _run_sequentially(killed, skip=kill[1] if skip else 0)
    assert _files(killed) == _files(whole)


def test_a_recorded_stop_without_stopped_json_is_a_stopped_trial_and_is_replayed(tmp_path):
    """Killed after ASHA's stop was recorded but before ``stopped.json`` was written: the
    trial counts as stopped after that epoch and is not run again; reporting that epoch again
    gets the recorded stop, not the continue Ray gives a rung it has seen."""
    from ringflow.tuning.run import _resumable_asha

    layout = _layout(tmp_path)
    _run_sequentially(layout, kill=("00002", 1))
    (tmp_path / "tune" / "search" / "trials" / "00001" / "stopped.json").unlink()
    trial = layout.history().trials["00001"]
    assert (trial.finished, trial.stopped_at) == (True, 1)
    asha = _resumable_asha(SearchConfig(epochs=4), layout.history().trials, base_trial="00000")
    again = _tune_trial("00001", tune_id="new-id")
    asha.on_trial_add(None, again)
    assert asha.on_trial_result(None, again, {"epoch": 1, "val_accuracy": 0.8}) == "STOP"
    base = _tune_trial("00000", tune_id="new-base")
    asha.on_trial_add(None, base)
    assert asha.on_trial_result(None, base, {"epoch": 1, "val_accuracy": 0.9}) == "CONTINUE"


def test_a_search_recorded_before_decisions_were_resumes_from_its_results():
    """Records with epochs but no decisions: finished trials' results fill the rungs, so a
    new trial below a rung's cutoff is stopped, as it would have been; an unfinished trial's
    recorded results are decided when the scheduler is rebuilt."""
    from ringflow.tuning.records import _recorded
    from ringflow.tuning.run import _resumable_asha

    def trial(trial_id, values, **more):
        epochs = {f"epochs/{e:06d}.json": {"epoch": e, "val_accuracy": v} for e, v in values}
        return _recorded(trial_id, {**epochs, **more})

    done = {"done.json": {"checkpoint": "model", "last": {"epoch": 4}}}
    trials = {
        "00000": trial("00000", [(1, 0.9), (2, 0.95), (3, 0.96), (4, 0.97)], **done),
        "00001": trial("00001", [(1, 0.8)], **{"stopped.json": {"epoch": 1}}),
        "00002": trial("00002", [(1, 0.7)]),  # killed before ASHA decided on its epoch 1
    }
    stopped, decided = [], []
    asha = _resumable_asha(
        SearchConfig(epochs=4),
        trials,
        base_trial="00000",
        on_stop=lambda t, r: stopped.append((t, r["epoch"])),
        on_decision=lambda t, d: decided.append((t, d)),
    )
    rungs = dict(asha._brackets[0]._rungs)
    assert rungs[1] == {"00000": 0.9, "00001": 0.8, "00002": 0.7}
    assert rungs[2] == {"00000": 0.95}
    assert decided == [("00002", {"epoch": 1, "value": 0.7, "decision": "stop"})]
    assert stopped == [("00002", 1)]
    assert asha.decisions.stopped_on_resume == ["00002"]
    new = _tune_trial("00003")
    asha.on_trial_add(None, new)
    assert asha.on_trial_result(None, new, {"epoch": 1, "val_accuracy": 0.75}) == "STOP"


def test_the_base_trial_is_never_stopped_early():
    from ringflow.tuning.records import _recorded
    from ringflow.tuning.run import _resumable_asha

    other_stopped = _recorded(
        "00003",
        {"epochs/000001.json": {"epoch": 1, "val_accuracy": 0.9}, "stopped.json": {"epoch": 1}},
    )
    decided = []
    asha = _resumable_asha(
        SearchConfig(epochs=4),
        {"00003": other_stopped},
        base_trial="00000",
        on_decision=lambda t, d: decided.append((t, d["decision"])),
    )
    base, other = _tune_trial("00000"), _tune_trial("00001")
    for trial in (base, other):
        asha.on_trial_add(None, trial)
    low = {"epoch": 1, "val_accuracy": 0.1}
    assert asha.on_trial_result(None, base, low) == "CONTINUE"
    assert asha.on_trial_result(None, other, low) == "STOP"
    assert decided == [("00000", "continue"), ("00001", "stop")]  # what the search did


def test_random_search_proposes_by_trial_number_the_base_first():
    """Trial i's configuration depends on the seed and i only: a resumed search proposes the
    trials it had not started exactly as the uninterrupted one would have."""
    from ringflow.tuning.space import _random_search

    dims = parse_space(SPACE)

    def proposals(seed, order):
        proposer = _random_search(dims, BASE, metric="val_loss", mode="min", seed=seed)
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
    module, _ = load_model(result.best_checkpoint, allowed=DigitsClassifier)
    assert module.hparams.hidden == result.best_params["hidden"]


class _Together(DigitsClassifier):
    """The digits model, each trial waiting at its start until ``hparams["expect"]`` trials
    have started (or 60 s passed): it ends with the times of its start and its end."""

    def __init__(self, *, meet: str = "", expect: int = 1, **hparams) -> None:
        super().__init__(**hparams)
        self.meet, self.expect = meet, expect

    def on_fit_start(self) -> None:
        Path(self.meet, f"{os.getpid()}-{time.time()}").touch()
        deadline = time.monotonic() + 60
        while len(os.listdir(self.meet)) < self.expect and time.monotonic() < deadline:
            time.sleep(0.1)
        self.begun = time.time()

    def on_fit_end(self) -> None:
        ends = Path(self.meet).with_suffix(".ends")
        ends.mkdir(exist_ok=True)
        ends.joinpath(f"{self.begun} {time.time()} {self.device.type}").touch()


def _together(digits, tmp_path, **resources) -> list[tuple[float, float, str]]:
    """Four trials of ``_Together`` with ``resources``; each one's start, end and device."""
    meet = tmp_path / "meet"
    meet.mkdir()
    result = search(
        _Together,
        base_hparams={**BASE, "meet": str(meet), "expect": 4},
        space={"lr": {"loguniform": [0.001, 0.1]}},
        data=digits,
        train_config=TrainConfig(workers=1, batch_size=64),
        storage_url=str(tmp_path / "storage"),
        run_key="together",
        config=SearchConfig(trials=4, epochs=1, **resources),
    )
    assert [t.state for t in result.trials] == ["completed"] * 4
    arrived = [float(p.name.split("-")[1]) for p in meet.iterdir()]
    spans = [p.name.split() for p in meet.with_suffix(".ends").iterdir()]
    # each trial arrived at the meeting before any trial ended: all four at once
    assert len(arrived) == 4
    assert max(arrived) < min(float(ended) for _, ended, _ in spans)
    return [(float(begun), float(ended), device) for begun, ended, device in spans]


@pytest.mark.ray
def test_trials_of_half_a_cpu_run_four_at_a_time_on_two_cpus(ray_session, digits, tmp_path):
    """cpus_per_trial=0.5 on the session's 2 CPUs: the four trials train at the same time
    (each waits at its start for the other three, which only 4 at a time can meet)."""
    spans = _together(digits, tmp_path, cpus_per_trial=0.5)
    assert len(spans) == 4
    assert {device for _, _, device in spans} == {"cpu"}


@pytest.mark.gpu
def test_trials_of_a_quarter_gpu_share_one_gpu_four_at_a_time(ray_session, digits, tmp_path):
    import torch

    if torch.cuda.device_count() != 1:
        pytest.skip("needs exactly 1 CUDA device")
    spans = _together(digits, tmp_path, gpus_per_trial=0.25, cpus_per_trial=0.5)
    assert len(spans) == 4
    assert {device for _, _, device in spans} == {"cuda"}


@pytest.mark.ray
def test_gpus_per_trial_without_a_gpu_is_refused_before_any_trial(ray_session, digits, tmp_path):
    with pytest.raises(ValueError, match="gpus_per_trial=0.25 but the Ray cluster has no GPU"):
        _search(digits, tmp_path, trials=2, epochs=1, gpus_per_trial=0.25)


def test_trial_resources_that_cannot_be_given_are_refused_in_one_line():
    with pytest.raises(ValueError, match="gpus_per_trial must be from 0 to 1"):
        SearchConfig(gpus_per_trial=2)
    with pytest.raises(ValueError, match="cpus_per_trial must be positive"):
        SearchConfig(cpus_per_trial=0)
    with pytest.raises(ValueError, match="are for trials of one worker"):
        SearchConfig(workers_per_trial=2, gpus_per_trial=0.5)


_SCRIPT = """
import json, sys, time
import ray
from ringflow.engine import DataSpec, TrainConfig
from ringflow.tuning import SearchConfig, search
from ringflow.tuning import records as tune_records
from ringflow.models.digits import SCHEMA, DigitsClassifier

dataset_url, storage_url, state_dir, run_key, space, hang = sys.argv[1:7]
if hang:  # the driver hangs as it records ASHA's decision on this trial: killed meanwhile
    record = tune_records._TrialRecords.decided
    def decided(records, decision):
        if records.url.endswith("/" + hang):
            time.sleep(3600)
        record(records, decision)
    tune_records._TrialRecords.decided = decided
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
result = search(
    DigitsClassifier,
    base_hparams={"lr": 0.01, "hidden": 16},
    space=json.loads(space),
    data=DataSpec(dataset_url=dataset_url, schema=SCHEMA),
    train_config=TrainConfig(workers=1, batch_size=32),
    storage_url=storage_url,
    run_key=run_key,
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


def _start(digits, storage: Path, state_dir: Path, *, run_key="killed", space=SPACE, hang=""):
    """The search of ``_SCRIPT`` in a process group of its own; ``hang``: a trial whose ASHA
    decision the driver never records (it hangs instead)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "TUNE_"))}
    args = [digits.dataset_url, str(storage), str(state_dir), run_key, json.dumps(space), hang]
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, *args],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the whole tree (Ray included) is killed, as on preemption
    )


def _result(search: subprocess.Popen) -> dict:
    out, _ = search.communicate(timeout=400)
    assert search.returncode == 0, out[-3000:]
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0])


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.json")}


def _unfinished_with_checkpoint(storage: Path, *, decided: bool = False) -> set[str]:
    """Trials killed mid-training after a committed checkpoint (neither done nor stopped);
    ``decided``: only those on whose every epoch but the last ASHA's decision is recorded."""
    trials = storage / "tune" / "killed" / "trials"
    return {
        trial.name
        for trial in trials.glob("*")
        if not (trial / "done.json").exists()
        and not (trial / "stopped.json").exists()
        and list(storage.glob(f"checkpoints/killed-trial-{trial.name}/*/manifest.json"))
        and (not decided or _names(trial / "epochs") <= _names(trial / "rungs"))
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
        # A trial mid-epoch: ASHA has decided on every epoch it finished, so it runs again.
        while not (
            list(trials.glob("*/done.json")) and _unfinished_with_checkpoint(storage, decided=True)
        ):
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
        if states[trial_id][1] == 1:  # unless ASHA stopped it at an epoch it had finished
            rungs = [json.loads(p.read_text()) for p in sorted((trials / trial_id).glob("rungs/*"))]
            assert states[trial_id][0] == "stopped early", states
            assert {"epoch": states[trial_id][2], "decision": "stop"}.items() <= rungs[-1].items()
            continue
        assert states[trial_id][1] == 2, states
        starts = [json.loads(p.read_text()) for p in (trials / trial_id / "starts").glob("*")]
        assert max(s["resumes_from_step"] or 0 for s in starts) >= 5, starts
    assert all(state in ("completed", "stopped early") for state, _, _ in states.values())


_SLOWER = {"lr": {"loguniform": [0.0001, 0.0003]}}
"""Every trial but the base learns slower: ASHA stops ``00001`` after its first epoch."""


def _decisions(storage: Path) -> dict[str, dict]:
    """ASHA's recorded decisions on every trial, by epoch, and how the trial ended (the epoch
    it was stopped after, or ``done``): what the resumed search must repeat."""
    decisions = {}
    for trial in sorted((storage / "tune" / "decided" / "trials").glob("*")):
        rungs = [json.loads(p.read_text()) for p in trial.glob("rungs/*.json")]
        ended = "done" if (trial / "done.json").exists() else None
        if (trial / "stopped.json").exists():
            ended = json.loads((trial / "stopped.json").read_text())["epoch"]
        decisions[trial.name] = {
            "rungs": {r["epoch"]: r["decision"] for r in rungs},
            "ended": ended,
        }
    return decisions


def _kill_once_recorded(search: subprocess.Popen, record: Path) -> None:
    """SIGKILL ``search``'s process group once ``record`` exists."""
    try:
        deadline = time.monotonic() + 300
        while not record.exists():
            assert search.poll() is None, search.stdout.read()[-3000:]
            assert time.monotonic() < deadline, f"no {record} within 5 minutes"
            time.sleep(0.05)
    finally:
        os.killpg(search.pid, signal.SIGKILL)
        search.wait()


@pytest.mark.ray
def test_a_search_killed_while_asha_decides_resumes_to_the_decisions_of_the_uninterrupted_one(
    digits, tmp_path
):
    """One trial at a time, killed after ASHA's first decision (on the base) is on storage,
    once 00001's first epoch is recorded and before ASHA's decision on it is (the driver hangs
    recording it): the resumed search makes that decision on the rungs the kill left and the
    later ones on the same rungs, so it decides as the same search run without a kill."""
    uninterrupted = _result(
        _start(
            digits, tmp_path / "whole", tmp_path / "whole-tune", run_key="decided", space=_SLOWER
        )
    )
    storage = tmp_path / "killed"
    _kill_once_recorded(
        _start(
            digits,
            storage,
            tmp_path / "killed-tune",
            run_key="decided",
            space=_SLOWER,
            hang="00001",
        ),
        storage / "tune" / "decided" / "trials" / "00001" / "epochs" / "000001.json",
    )
    cut = _decisions(storage)
    assert cut["00000"]["rungs"] == {1: "continue"}, cut  # the first decision is on storage
    assert cut["00001"] == {"rungs": {}, "ended": None}, cut  # the next one was cut off
    expected = _decisions(tmp_path / "whole")
    assert expected["00001"] == {"rungs": {1: "stop"}, "ended": 1}, expected
    resumed = _result(
        _start(digits, storage, tmp_path / "killed-tune", run_key="decided", space=_SLOWER)
    )
    assert resumed["resumed"] is True
    assert _decisions(storage) == expected
    assert resumed["trials"] == uninterrupted["trials"]  # states, executions and epochs
