"""``train-pipeline`` with a search, on S3 (moto) behind a proxy that fails requests as a flaky
object store does: HTTP 500s, two-second stalls, connections closed without an answer. The
run is killed mid-search and run again under the same faults: it completes, and the trials
that had finished are not trained again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.moto_s3 import Faults, S3Endpoint, s3_endpoint

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
RUN_KEY = "flaky"
TRIALS = 3


@pytest.fixture
def flaky_s3():
    faults = Faults(seed=22, error_rate=0.08, slow_rate=0.05, slow_s=2.0, drop_rate=0.03)
    with s3_endpoint(faults) as endpoint:
        yield endpoint


def _flow(s3: S3Endpoint, prefect_api: str) -> subprocess.Popen:
    """The flow as a user runs it, its storage on S3 reached through the faulty proxy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "TUNE_"))}
    env.update(
        AWS_ENDPOINT_URL=s3.proxy.url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        PYTHONPATH=str(ROOT),
        PREFECT_API_URL=prefect_api,
    )
    args = {
        "storage-url": s3.url("store"),
        "run-key": RUN_KEY,
        # One trial finishes before the kill, one is interrupted by it, one starts only
        # after it: each kind of trial a resumed search meets.
        "tune-trials": TRIALS,
        "tune-epochs": 1,  # ASHA stops nothing: a trial killed mid-epoch is never a stopped one
        "tune-max-concurrent": 1,
        "workers": 1,
    }
    return subprocess.Popen(
        # The best trial's model is evaluated, registered and promoted as it is: training it
        # again would add nothing to what this test is about.
        [
            sys.executable,
            "-m",
            "ringflow.flows.train_pipeline",
            "--no-serve",
            "--use-best-checkpoint",
        ]
        + [part for key, value in args.items() for part in (f"--{key}", str(value))],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the whole tree (Ray included) is killed, as on preemption
    )


def _keys(s3: S3Endpoint) -> set[str]:
    """Every object under the flow's storage, read from moto itself (no faults)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.moto_url, region_name="us-east-1")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix="store/")
    return {obj["Key"][len("store/") :] for page in pages for obj in page.get("Contents", [])}


def _trials(keys: set[str]) -> dict[str, set[str]]:
    """Trial id to the records it has (``done.json``, ``stopped.json``, ``starts/...``)."""
    prefix = f"tune/{RUN_KEY}/trials/"
    found: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith(prefix):
            trial, record = key[len(prefix) :].split("/", 1)
            found.setdefault(trial, set()).add(record)
    return found


def _interrupted(keys: set[str]) -> set[str]:
    """Trials that started and neither finished nor were stopped."""
    return {
        trial
        for trial, records in _trials(keys).items()
        if not {"done.json", "stopped.json"} & records
        and any(r.startswith("starts/") for r in records)
    }


def _checkpointed(keys: set[str], trial: str) -> bool:
    prefix = f"checkpoints/{RUN_KEY}-trial-{trial}/"
    return any(k.startswith(prefix) and k.endswith("manifest.json") for k in keys)


def _resumed_from(s3: S3Endpoint, keys: set[str], trial: str) -> list[int | None]:
    """The step each execution of ``trial`` resumed from (``None``: from the start)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.moto_url, region_name="us-east-1")
    prefix = f"tune/{RUN_KEY}/trials/{trial}/starts/"
    return [
        json.loads(client.get_object(Bucket=s3.bucket, Key=f"store/{key}")["Body"].read())[
            "resumes_from_step"
        ]
        for key in sorted(keys)
        if key.startswith(prefix)
    ]


def _result(out: str) -> dict:
    """The flow's result: the JSON object the command prints on stdout as it ends."""
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


def _starts(keys: set[str], trial: str) -> int:
    return sum(r.startswith("starts/") for r in _trials(keys)[trial])


def test_a_search_on_a_flaky_object_store_completes_and_resumes_after_a_kill(
    flaky_s3, tmp_path, prefect_api
):
    first = _flow(flaky_s3, prefect_api)
    try:
        deadline = time.monotonic() + 400
        while True:
            keys = _keys(flaky_s3)
            done = {t for t, records in _trials(keys).items() if "done.json" in records}
            if done and _interrupted(keys):  # one trial finished, another is training
                break
            assert first.poll() is None, first.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no trial finished and another checkpointed"
            time.sleep(0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        (tmp_path / "first.log").write_text(first.communicate()[0])
    flaky_s3.proxy.settle()  # requests the killed run had sent still land, as on S3
    keys = _keys(flaky_s3)
    finished = {t for t, r in _trials(keys).items() if {"done.json", "stopped.json"} & r}
    interrupted = _interrupted(keys)
    assert finished
    assert interrupted, sorted(keys)
    checkpointed = {t for t in interrupted if _checkpointed(keys, t)}

    second = _flow(flaky_s3, prefect_api)
    out, _ = second.communicate(timeout=500)
    (tmp_path / "second.log").write_text(out)
    assert second.returncode == 0, out[-4000:]
    result = _result(out)
    assert result["tune"]["best_params"], result
    assert result["promoted"] is True
    assert result["checkpoint"].startswith(flaky_s3.url(f"store/runs/{RUN_KEY}/trials/"))

    keys = _keys(flaky_s3)
    trials = _trials(keys)
    assert len(trials) == TRIALS, sorted(trials)
    assert set(trials) - finished - interrupted, "no trial started after the kill"
    for trial in finished:  # kept, not trained again
        assert _starts(keys, trial) == 1, (trial, sorted(trials[trial]))
    for trial in interrupted:  # trained again, from its checkpoint if it had committed one
        assert _starts(keys, trial) == 2, (trial, sorted(trials[trial]))
        resumed_from = _resumed_from(flaky_s3, keys, trial)
        assert (max(s or 0 for s in resumed_from) > 0) == (trial in checkpointed), resumed_from
    assert all({"done.json", "stopped.json"} & records for records in trials.values())
    assert not [k for k in keys if k.endswith((".pkl", ".pickle"))], "tuning left pickles"
    counts = flaky_s3.proxy.faults.counts
    assert min(counts["500"], counts["slow"], counts["dropped"]) > 0, counts
