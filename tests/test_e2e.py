"""The whole pipeline, started the way a user starts it: the CLI with no server, and the demo.

The CLI tests start their own private Ray and Prefect, on ports of their own; the demo runs
on the run's stack (tests/support/stack.py). Neither touches a developer's own demo.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from sklearn.datasets import load_digits

from ringflow.models.digits import write_digits_csv
from tests.support.net import free_port
from tests.support.stack import clean_env

ROOT = Path(__file__).resolve().parents[1]


def _a_digit() -> tuple[list[int], int]:
    digits = load_digits()
    return [int(v) for v in digits.data[7]], int(digits.target[7])


def _assert_serves_digits(endpoint: str) -> None:
    pixels, label = _a_digit()
    reply = httpx.post(endpoint, json={"pixels": pixels}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["digit"] == label
    for bad in (b"not json", b'{"pixels": [1, 2, 3]}', b'{"pixel": []}'):
        reply = httpx.post(endpoint, content=bad, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]
    assert httpx.post(endpoint, json={"pixels": pixels}, timeout=30).json()["digit"] == label


def _digits_with_bad_rows(path: Path) -> int:
    """The digits CSV with malformed rows appended; returns how many are bad."""
    write_digits_csv(str(path))
    with path.open("a") as f:
        f.write(",".join(["1"] * 64) + ",12\n")  # label out of range
        f.write(",".join(["x"] * 65) + "\n")  # not numbers
        f.write("1,2,3\n")  # too few fields
    return 3


def _result_line(proc: subprocess.Popen, on_line=None, timeout_s: float = 600) -> dict:
    """The JSON result a ``--keep-serving`` run prints before it waits for Ctrl-C; ``on_line``
    sees every line before it as it arrives."""
    output: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "the run ended without a JSON result:\n" + "".join(output[-40:])
        output.append(line)
        if line.startswith("{"):
            return json.loads(line)
        if on_line is not None:
            on_line(line)
    raise AssertionError(f"no result within {timeout_s:.0f} s")


@contextlib.contextmanager
def _serving_run(tmp_path: Path, *args: str, on_line=None, prefect_api: str | None = None):
    """A ``--keep-serving`` CLI run of the flow with ``args``; yields its JSON result while the
    model serves, then stops it with Ctrl-C, as a user would, and checks it exited cleanly.
    ``on_line`` sees each line the run prints before its result, as it arrives; the run
    reports to ``prefect_api``, else to a temporary Prefect server of its own."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ringflow.flows.train_pipeline",
            *args,
            f"--storage-url={tmp_path / 'storage'}",
            f"--serve-port={port}",
            "--keep-serving",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(
            PREFECT_HOME=str(tmp_path / "prefect"),
            **({"PREFECT_API_URL": prefect_api} if prefect_api else {}),
        ),
    )
    try:
        result = _result_line(proc, on_line)
        assert result["endpoint"] == f"http://127.0.0.1:{port}/predict"
        yield result
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    assert proc.returncode == 0


_TRIAL_LINE = re.compile(r"trial (\d{5})(?: \(base\))? (started|completed|stopped early|failed)")


@pytest.mark.integration  # a private Ray and Prefect of its own
def test_cli_runs_the_flow_with_no_server(tmp_path):
    """The whole flow from the command line, with what a user sees of its search: a line as
    each trial starts and ends, printed while the search runs and kept in the Prefect run's
    logs, and no TensorBoard hint into Ray's temp dir."""
    bad_rows = _digits_with_bad_rows(tmp_path / "drop.csv")
    args = [
        "--workers=2",
        "--tune-trials=3",
        "--tune-epochs=1",  # ASHA stops nothing: every trial completes
        "--tune-max-concurrent=1",  # one trial after the other
        f"--data-url={tmp_path / 'drop.csv'}",
    ]
    storage = tmp_path / "storage"
    lines, events = [], []

    def seen(line: str) -> None:
        lines.append(line)
        match = _TRIAL_LINE.search(line)
        if match:  # with what the run had done when the line arrived
            events.append((*match.groups(), _search_progress(storage)))

    with _serving_run(tmp_path, *args, on_line=seen) as result:
        assert result["test_accuracy"] >= 0.95
        assert result["rejected_rows"] == bad_rows
        assert Path(result["dataset_url"], "rejected.parquet").exists()
        assert result["checkpoint"].startswith(str(storage))
        assert Path(result["model_uri"], "manifest.json").exists()
        assert result["tune"]["best_params"]
        _assert_serves_digits(result["endpoint"])

    trials = ("00000", "00001", "00002")
    out = "".join(lines)
    assert [(t, what) for t, what, _ in events] == [
        (trial, what) for trial in trials for what in ("started", "completed")
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
    for trial in trials:
        for what in ("started", "completed"):
            assert any(re.match(rf"trial {trial}( \(base\))? {what}", m) for m in logged), what


def _search_progress(storage: Path) -> tuple[set[str], set[str], bool]:
    """Trials started, trials done, and whether the flow registered a model after the search."""
    trials = storage / "tune"
    started = {p.parent.name for p in trials.glob("*/trials/*/starts")}
    done = {p.parent.name for p in trials.glob("*/trials/*/done.json")}
    return started, done, (storage / "registry").exists()


@pytest.mark.integration  # a private Ray of its own, reporting to the test process's Prefect
def test_a_killed_local_run_resumes_under_its_run_key_bit_for_bit(tmp_path, prefect_api):
    """The whole process tree of a run is killed mid-training, as on a preempted machine."""
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.models.digits import DigitsClassifier
    from ringflow.storage import CheckpointStore, load_model

    storage = tmp_path / "storage"
    args = [
        sys.executable,
        "-m",
        "ringflow.flows.train_pipeline",
        "--workers=1",
        "--tune-trials=0",
        "--no-serve",
        "--epochs=60",
        "--checkpoint-every=5",
        '--hparams={"hidden": 32}',
        "--run-key=nightly-7",
        f"--storage-url={storage}",
    ]
    env = clean_env(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_API_URL=prefect_api)
    first = subprocess.Popen(args, cwd=ROOT, env=env, start_new_session=True, **_QUIET)
    store = CheckpointStore(str(storage / "checkpoints"))
    try:
        deadline = time.monotonic() + 300
        while not store.checkpoints("nightly-7"):
            assert first.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 5 minutes"
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    killed_at = store.latest("nightly-7").step
    assert 0 < killed_at < 60 * 23

    second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    result = json.loads(second.stdout.strip().splitlines()[-1])
    assert result["resumed_from_step"] >= killed_at
    assert result["run_key"] == "nightly-7"

    reference = fit(
        DigitsClassifier,
        hparams=result["hparams"],
        data=DataSpec(dataset_url=result["dataset_url"]),
        config=TrainConfig(workers=1, epochs=60, batch_size=64, seed=0, checkpoint_every=5),
        checkpoint_uri=str(tmp_path / "reference"),
        in_process=True,
    )
    resumed, _ = load_model(result["checkpoint"], allowed=DigitsClassifier)
    for name, tensor in reference.state_dict.items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


_QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}


@pytest.mark.integration  # a private Ray of its own, reporting to the test process's Prefect
def test_the_sequence_model_trains_in_stages_of_two_replicas_resumes_and_serves_its_predict_step(
    tmp_path, prefect_api
):
    """The character LM, named like any model of one's own: its example data, tuning, two
    replicas of two pipeline stages in bf16-mixed, accumulating and clipping by norm, each
    stage's optimizer state sharded over its replicas (ZeRO-1); started
    again under its run key with more epochs, as a retried flow run is, it goes on from its
    checkpoint instead of training from scratch, and serves its ``predict_step`` by feature
    name."""
    from ringflow.storage import CheckpointStore

    hparams = {"context": 16, "width": 32, "depth": 2, "heads": 2}
    args = [
        "--model=ringflow.models.charlm:CharLM",
        f"--hparams={json.dumps(hparams)}",
        "--workers=2",
        "--pipeline-stages=2",
        # Every option means the same under both layouts (docs/pipeline.md).
        "--precision=bf16-mixed",
        "--accumulate-grad-batches=2",
        "--gradient-clip-val=1.0",
        "--gradient-clip-algorithm=norm",
        "--shard=optimizer",
        "--tune-trials=2",
        "--tune-epochs=1",
        "--run-key=staged",
    ]
    first = subprocess.run(
        [sys.executable, "-m", "ringflow.flows.train_pipeline", *args, "--epochs=1"]
        + ["--no-serve", f"--storage-url={tmp_path / 'storage'}"],
        cwd=ROOT,
        env=clean_env(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_API_URL=prefect_api),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] is None
    assert summary["promoted"] is True
    trained_to = CheckpointStore(str(tmp_path / "storage" / "checkpoints")).latest("staged").step
    assert trained_to > 0

    with _serving_run(tmp_path, *args, "--epochs=2", prefect_api=prefect_api) as result:
        assert result["resumed_from_step"] == trained_to
        assert result["model_name"] == "char_lm"
        assert result["test_loss"] < 3.0  # ln(128) = 4.85 is a uniform guess
        assert set(result["tune"]["best_params"]) == {"lr", "batch_size"}
        text = "def main(args):\n "  # a window of context + 1 = 17 characters
        window = {f"c{i}": ord(ch) for i, ch in enumerate(text)}
        reply = httpx.post(result["endpoint"], json=window, timeout=30)
        assert reply.status_code == 200, reply.text
        prediction = reply.json()["prediction"]
        assert 0 <= prediction["next"] < 128
        assert 0 < prediction["probability"] <= 1
        short = {k: v for k, v in window.items() if k != "c3"}
        assert httpx.post(result["endpoint"], json=short, timeout=30).status_code == 400


@pytest.mark.integration  # a private Ray of its own, reporting to the test process's Prefect
def test_the_sequence_model_trains_on_four_workers_holding_a_shard_of_its_weights_and_serves(
    tmp_path, prefect_api
):
    """``--shard parameters --workers 4`` (ZeRO-3) from the command line: each of the four
    workers writes its own shard of the checkpoint, and the model they trained is registered
    whole and served."""
    from ringflow.storage import CheckpointStore

    hparams = {"context": 16, "width": 32, "depth": 2, "heads": 2}
    args = [
        "--model=ringflow.models.charlm:CharLM",
        f"--hparams={json.dumps(hparams)}",
        "--workers=4",
        "--cpus-per-worker=0.5",  # four workers on this machine's two CPUs
        "--shard=parameters",
        "--epochs=1",
        "--tune-trials=0",
        "--run-key=sharded",
    ]
    with _serving_run(tmp_path, *args, prefect_api=prefect_api) as result:
        assert result["model_name"] == "char_lm"
        assert result["test_loss"] < 4.85  # ln(128): a uniform guess
        window = {f"c{i}": ord(ch) for i, ch in enumerate("def main(args):\n ")}
        reply = httpx.post(result["endpoint"], json=window, timeout=30)
        assert reply.status_code == 200, reply.text
        assert 0 <= reply.json()["prediction"]["next"] < 128
    checkpoint = CheckpointStore(str(tmp_path / "storage" / "checkpoints")).latest("sharded")
    assert sorted(checkpoint.shards) == [f"zero-0000{r}" for r in range(4)]


@pytest.mark.integration  # a private Ray and Prefect of its own
def test_missing_data_url_fails_the_run_naming_it(tmp_path):
    missing = tmp_path / "nowhere.csv"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringflow.flows.train_pipeline",
            "--data-url",
            str(missing),
            "--storage-url",
            str(tmp_path / "storage"),
            "--no-serve",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(PREFECT_HOME=str(tmp_path / "prefect")),
    )
    assert result.returncode != 0
    assert f"{missing} does not exist" in result.stdout + result.stderr
    assert not (tmp_path / "storage" / "runs").exists()


@pytest.mark.e2e
def test_demo_command_from_the_readme(stack):
    """demo.sh on the run's stack: its start.sh finds the stack up and keeps it; the rest is
    what a new user sees (stop.sh is checked when the stack stops, at the end of the run)."""
    port = str(stack.serve_port)
    demo = subprocess.run(
        ["./deployments/demo.sh"],
        cwd=ROOT,
        env=stack.env,
        text=True,
        capture_output=True,
        timeout=900,
    )
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    assert "Flow run finished successfully in 'Completed'" in demo.stdout
    _assert_summary(demo.stdout, port)
    _assert_links_the_dashboard_and_the_workers_logs(demo.stdout, stack.env)
    assert '"digit":' in demo.stdout.rsplit("Asking it about", 1)[-1]
    # The endpoint outlives the flow run: it is hosted by the Ray head.
    _assert_serves_digits(f"http://127.0.0.1:{port}/predict")
    _check_deployments(stack.env)
    _deploys_the_sequence_model_in_stages(stack.env, port)


def _assert_summary(stdout: str, port: str) -> None:
    """The demo ends with what its run produced: accuracy, the gate's decision, the endpoint."""
    summary = stdout.rsplit("train-pipeline run ", 1)[-1]
    assert re.search(r"^\s+test\s+accuracy 0\.\d{4}, loss \d", summary, re.M), summary
    assert re.search(
        r"^\s+gate\s+digits v\d{4} (promoted to production|not promoted): \S", summary, re.M
    ), summary
    assert f"endpoint    http://127.0.0.1:{port}/predict" in summary, summary
    assert "python -m ringflow.flows.result " in summary


def _assert_links_the_dashboard_and_the_workers_logs(stdout: str, env: dict[str, str]) -> None:
    """The stack's Ray head runs a dashboard (start.sh): the summary links it, and says where
    the training workers' output went."""
    summary = stdout.rsplit("train-pipeline run ", 1)[-1]
    dashboard = f"http://127.0.0.1:{env['RINGFLOW_RAY_DASHBOARD_PORT']}"
    assert re.search(rf"^\s+dashboard\s+{re.escape(dashboard)}$", summary, re.M), summary
    assert httpx.get(dashboard, timeout=30, trust_env=False).status_code == 200
    found = re.search(r"^\s+worker logs\s+(\S+) \((\d+) workers'", summary, re.M)
    assert found, summary
    outputs = list(Path(found[1]).glob("worker-*.out"))
    assert int(found[2]) == 2, found[0]
    assert outputs, (found[0], sorted(os.listdir(found[1])))


def _prefect(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", '. deployments/env.sh && exec prefect "$@"', "prefect", *args],
        cwd=ROOT,
        env={**env, "COLUMNS": "250"},  # wide enough that rich does not cut names short
        text=True,
        capture_output=True,
        timeout=120,
    )


def _deploys_the_sequence_model_in_stages(env: dict[str, str], port: str) -> None:
    """The same deployment trains another model, named by parameter: the character LM in two
    replicas of two pipeline stages, which then answers on the served endpoint."""
    hparams = json.dumps({"context": 16, "width": 32, "depth": 2, "heads": 2})
    params = {
        "model": "ringflow.models.charlm:CharLM",
        "hparams": hparams,
        "pipeline_stages": 2,
        # Batches of 256: a quarter of the default 64's steps through the four stages.
        "training": json.dumps({"workers": 2, "epochs": 1, "batch_size": 256}),
        "tune_trials": 0,
        "serve_port": port,
    }
    run = subprocess.run(
        ["bash", "-c", '. deployments/env.sh && exec prefect "$@"', "prefect"]
        + ["deployment", "run", "train-pipeline/local", "--watch"]
        + [a for k, v in params.items() for a in ("--param", f"{k}={v}")],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert "Flow run finished successfully in 'Completed'" in run.stdout, run.stdout[-3000:]
    window = [ord(ch) for ch in "def main(args):\n "]  # context + 1 characters
    reply = httpx.post(f"http://127.0.0.1:{port}/predict", json={"instances": [window]}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"]["module"] == "ringflow.models.charlm:CharLM"
    assert 0 <= reply.json()["predictions"][0]["prediction"]["next"] < 128


def _check_deployments(env: dict[str, str]) -> None:
    """What the CLI shows of the deployments and the demo's run, and the runs it refuses:
    four commands that read and change nothing of one another's, run at once."""
    refused = (('training={"workers": -1}', "workers"), ("bogus=1", "bogus"))
    commands = [("deployment", "inspect", "train-pipeline/nightly"), ("artifact", "ls")]
    commands += [("deployment", "run", "train-pipeline/local", "--param", p) for p, _ in refused]
    with ThreadPoolExecutor(len(commands)) as pool:
        nightly, artifacts, *submitted = pool.map(lambda args: _prefect(env, *args), commands)
    assert nightly.returncode == 0, nightly.stderr
    assert "0 3 * * *" in nightly.stdout
    for key in ("training-metrics", "training-loss-curve", "best-hyperparameters", "tuning-trials"):
        assert key in artifacts.stdout, artifacts.stdout
    for (_, named), done in zip(refused, submitted, strict=True):
        out = done.stdout + done.stderr
        assert named in out, out
        assert "Created flow run" not in out, out
