"""Overlapping runs of one deployment, and runs of different keys on one storage URL.

The e2e test takes the run's real stack (Prefect server, Ray head, process worker, started
through deployments/start.sh and deploy.sh: tests/support/stack.py). It runs
``train-pipeline/nightly`` and triggers it twice more while that first run trains. The policy
that deployments/prefect.yaml gives the deployment (one run at a time, the others queued)
must show in Prefect's own run states. The other tests check, without a server, that what
two runs of different keys write on one storage URL never meets.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests.support.stack import Stack

ROOT = Path(__file__).resolve().parents[1]

# The first run's training is paused (its Ray workers SIGSTOPped, its flow process alive and
# Running) from its first checkpoint until the server has turned the others away, so it needs
# only a few seconds of training left after that checkpoint, however slow the machine; the
# queued runs train briefly.
FIRST = {"training": {"workers": 1, "epochs": 20, "checkpoint_every": 5}}
QUEUED = {"training": {"workers": 1, "epochs": 1}}
PARAMS = {"tune_trials": 0, "serve": False, "hparams": {"hidden": 16}}
_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def _wait(what: str, check, stack: Stack, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what} within {seconds} s" + stack.logs()
        time.sleep(0.2)


def _running_spans(stack: Stack, run_id: str) -> list[tuple[datetime, datetime]]:
    """``(from, to)`` times of each stretch the run spent Running."""
    spans, began = [], None
    for state in stack.states(run_id):
        at = datetime.fromisoformat(state["timestamp"])
        if state["type"] == "RUNNING" and began is None:
            began = at
        elif state["type"] != "RUNNING" and began is not None:
            spans.append((began, at))
            began = None
    assert began is None, f"{run_id} is still running"
    return spans


def _at_once(*calls) -> list:
    """Run the calls in threads started together; return their results in order."""
    barrier, results, errors = threading.Barrier(len(calls)), [None] * len(calls), []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def test_two_run_keys_checkpoint_into_one_storage_url_without_touching_each_other(tmp_path):
    import torch

    from ringflow.storage import CheckpointStore, RetentionPolicy
    from ringflow.storage.layout import Workspace

    workspace = Workspace(str(tmp_path / "storage"))
    keys = ("nightly-7f3a", "nightly-7f3a-2")  # one key a prefix of the other

    def train(key: str) -> None:
        store = CheckpointStore(workspace.checkpoints, retention=RetentionPolicy(keep_last=1))
        for step in range(1, 9):
            weights = {"w": torch.full((64,), float(step)), "key": torch.tensor([len(key)])}
            store.save(key, step=step, shards={"replicated": weights})
        store.cleanup(key)

    _at_once(*(lambda key=key: train(key) for key in keys))
    store = CheckpointStore(workspace.checkpoints)
    for key in keys:  # each kept its own newest step, whole, whatever the other deleted
        assert [c.step for c in store.checkpoints(key)] == [8]
        loaded = store.load_latest(key)
        assert torch.equal(loaded.shards["replicated"]["key"], torch.tensor([len(key)]))
    assert sorted(os.listdir(workspace.checkpoints)) == sorted(keys)
    paths = [workspace.run_model(k) for k in keys] + [workspace.tune(k) for k in keys]
    for a in paths:  # the model and tuning state of one key never lie inside another's
        assert not [b for b in paths if b != a and b.startswith(a + "/")]


def test_two_runs_preprocessing_one_source_at_once_share_one_whole_dataset(tmp_path):
    from ringflow.models.digits import SCHEMA, write_digits_csv
    from ringflow.storage.dataset import preprocess, read_split

    source = str(tmp_path / "raw" / "digits.csv")
    write_digits_csv(source)
    storage = str(tmp_path / "storage")
    first, second = _at_once(*(lambda: preprocess(source, storage, SCHEMA, seed=0),) * 2)
    assert first.dataset_url == second.dataset_url  # content-addressed: the same splits
    features, labels = read_split(first.dataset_url, "train", SCHEMA)  # verifies every shard
    assert len(features) == len(labels) == first.rows["train"]
    other = preprocess(source, storage, SCHEMA, seed=1)  # other splits: another directory
    assert other.dataset_url != first.dataset_url
    assert read_split(first.dataset_url, "train", SCHEMA)[0].shape == features.shape


def test_nightly_policy_is_one_run_at_a_time_with_the_others_queued():
    deployments = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    nightly = next(d for d in deployments["deployments"] if d["name"] == "nightly")
    assert nightly["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}


@pytest.mark.e2e
def test_nightly_triggered_twice_while_it_trains_queues_both(stack):
    from ringflow.storage import CheckpointStore

    deployment = stack.get("deployments/name/train-pipeline/nightly")
    assert deployment["global_concurrency_limit"]["limit"] == 1
    assert deployment["concurrency_options"]["collision_strategy"] == "ENQUEUE"

    first = stack.create_run(deployment["id"], {**PARAMS, **FIRST})
    store = CheckpointStore(str(stack.storage / "checkpoints"))
    _wait("the first run's first checkpoint", lambda: store.checkpoints(first), stack)
    # Held mid-training (not finished) while the others are triggered and turned away.
    with stack.training_paused():
        later = [stack.create_run(deployment["id"], {**PARAMS, **QUEUED}) for _ in range(2)]
        for run_id in later:  # queued by the server while the first one trains
            _wait(
                f"{run_id} waiting for the deployment's slot",
                lambda run_id=run_id: any(
                    s["name"] == "AwaitingConcurrencySlot" for s in stack.states(run_id)
                ),
                stack,
            )
        assert stack.flow_run(first)["state"]["type"] == "RUNNING"
    runs = [first, *later]
    _wait(
        "every run's end",
        lambda: all(stack.flow_run(r)["state"]["type"] in _FINAL for r in runs),
        stack,
        seconds=420,
    )
    final = {r: stack.flow_run(r)["state"]["type"] for r in runs}
    spans = {r: _running_spans(stack, r) for r in runs}
    names = {r: [s["name"] for s in stack.states(r)] for r in runs}

    assert set(final.values()) == {"COMPLETED"}, (final, names)
    ordered = sorted(span for r in runs for span in spans[r])
    assert len(ordered) == 3, names
    for (_, ended), (began, _) in zip(ordered, ordered[1:], strict=False):
        assert ended <= began, f"two runs of nightly ran at once: {spans}"
    assert ordered[0] == spans[first][0], spans  # the queued ones ran after the first
    for run_id in runs:  # each trained under its own run key, the flow run's id
        assert (stack.storage / "runs" / run_id / "model").is_dir(), run_id
