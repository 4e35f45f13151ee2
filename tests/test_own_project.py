"""Your own model and your own project, run as docs/own-model.md tells a user to run them.

``examples/regression`` (a LightningModule and a CSV, nothing else) is trained, tuned and
served by ringflow's own flow from the command line; ``examples/user-project`` (a flow of its
own, with its own ``models`` and ``tasks`` packages) and ``examples/regression`` are deployed
with their own ``prefect.yaml`` to a real stack (Prefect server, Ray head, process worker)
and run by its worker. Both projects are copied outside the repository first, as a user's
would be. The walkthrough's commands are the documented ones (checked below).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.net import free_port
from tests.support.stack import Stack, clean_env, descendants, kill_tree

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DOC = ROOT / "docs" / "own-model.md"

# The walkthrough of docs/own-model.md, command for command.
MAKE_DATA = "python make_data.py"
TRAIN = (
    "python -m ringflow.flows.train_pipeline --model houses:HousePrice "
    "--data-url houses.csv --label price"
)
ONE_HOUSE = {"size_m2": 120, "age_years": 15, "rooms": 4, "distance_km": 6.5}
TWO_HOUSES = {
    "instances": [
        [120, 15, 4, 6.5],
        {"size_m2": 60, "age_years": 40, "rooms": 2, "distance_km": 12},
    ]
}
CURL = "curl -s -X POST 127.0.0.1:8000/predict -d '{}'"
REGISTRY = (
    "python -m ringflow.tasks.registry show --storage-url .ringflow/storage --model house-price"
)
DEPLOY = "prefect deploy --all"
RUN_HOUSES = "prefect deployment run train-pipeline/houses --watch"
RUN_WINE = "prefect deployment run wine-pipeline/lab --watch"


def test_the_walkthrough_is_the_one_the_docs_show():
    doc = DOC.read_text()
    commands = [MAKE_DATA, TRAIN, REGISTRY, DEPLOY, RUN_HOUSES, RUN_WINE]
    commands += [CURL.format(json.dumps(body)) for body in (ONE_HOUSE, TWO_HOUSES)]
    for command in commands:
        assert command in doc, f"docs/own-model.md no longer shows: {command}"
    assert "tests/test_own_project.py" in doc


def _python(command: str) -> list[str]:
    """A documented ``python ...`` command, run with this interpreter (ringflow's venv)."""
    return [sys.executable, *command.split()[1:]]


def _houses_project(tmp_path: Path) -> Path:
    """examples/regression copied out of the repository, its CSV made by make_data.py."""
    project = shutil.copytree(EXAMPLES / "regression", tmp_path / "houses")
    committed = (project / "houses.csv").read_text()
    (project / "houses.csv").unlink()
    subprocess.run(_python(MAKE_DATA), cwd=project, check=True, timeout=60, env=clean_env())
    assert (project / "houses.csv").read_text() == committed, "make_data.py != houses.csv"
    return project


def _mean_price_error(path: Path) -> float:
    """The mean absolute error of always answering the mean price: what a model must beat."""
    prices = []
    with path.open() as f:
        for row in csv.DictReader(f):
            try:
                prices.append(float(row["price"]))
            except (TypeError, ValueError):
                continue
    mean = sum(prices) / len(prices)
    return sum(abs(p - mean) for p in prices) / len(prices)


def _post(url: str, body: object) -> httpx.Response:
    return httpx.post(url, json=body, timeout=30, trust_env=False)


def _assert_answers_prices(endpoint: str) -> float:
    """One house by named features, then two (an array in schema order and an object)."""
    one = _post(endpoint, ONE_HOUSE)
    assert one.status_code == 200, one.text
    value = one.json()["value"]
    assert isinstance(value, float), one.json()
    assert math.isfinite(value), one.json()
    assert one.json()["model"]["module"] == "houses:HousePrice"
    both = _post(endpoint, TWO_HOUSES)
    assert both.status_code == 200, both.text
    values = [p["value"] for p in both.json()["predictions"]]
    assert len(values) == 2, both.json()
    assert all(math.isfinite(v) for v in values), both.json()
    # The same house as an array in schema order gets the same price as by name.
    assert values[0] == pytest.approx(value, rel=1e-5)
    return value


@pytest.mark.integration  # a private Ray and Prefect of its own
def test_the_walkthrough_trains_tunes_and_serves_your_model_locally(tmp_path):
    project = _houses_project(tmp_path)
    bad_rows = runpy.run_path(str(project / "make_data.py"))["BAD_ROWS"]
    port = free_port()
    storage = project / ".ringflow" / "storage"  # the flow's default, in the project
    extra = "--workers 2 --tune-trials 2 --tune-epochs 2 --epochs 30 --keep-serving"
    proc = subprocess.Popen(
        [*_python(TRAIN), *extra.split(), "--serve-port", str(port)],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(PREFECT_HOME=str(tmp_path / "prefect")),
    )
    try:
        result, output = None, []
        deadline = time.monotonic() + 400
        while result is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the run ended without a JSON result:\n" + "".join(output[-40:])
            output.append(line)
            if line.startswith("{"):
                result = json.loads(line)
        assert result is not None, "no result within 400 s:\n" + "".join(output[-40:])

        # The label's values made it a regression, and the model learnt it.
        assert result["task"] == "regression"
        assert math.isfinite(result["test_loss"])
        assert result["test_mae"] < _mean_price_error(project / "houses.csv") / 2, result
        # Bad rows are kept aside with the reason for each, not trained on, not dropped.
        assert result["rejected_rows"] == len(bad_rows)
        import pyarrow.parquet as pq

        reasons = pq.read_table(Path(result["dataset_url"], "rejected.parquet"))["reason"]
        reasons = reasons.to_pylist()
        assert "size_m2: 'n/a' is not a number" in reasons[0], reasons
        assert "age_years: -3 is below the minimum 0" in reasons[1], reasons  # data_defaults
        assert "expected 5 fields, found 3" in reasons[2], reasons
        # The class's model_name names it in the registry; its search_space was searched.
        assert result["model_name"] == "house-price"
        assert set(result["tune"]["best_params"]) == {"lr", "hidden", "batch_size"}
        assert result["checkpoint"].startswith(str(storage))

        assert result["endpoint"] == f"http://127.0.0.1:{port}/predict"
        _assert_answers_prices(result["endpoint"])
        # The bounds of data_defaults hold for requests too: a clear 400, not a guess.
        outside = _post(result["endpoint"], {**ONE_HOUSE, "age_years": -1})
        assert outside.status_code == 400
        assert "age_years" in outside.json()["error"]

        shown = subprocess.run(
            _python(REGISTRY), cwd=project, capture_output=True, text=True, timeout=120
        )
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["production"] == "v0001"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    assert proc.returncode == 0
    # Served by the run's private Ray, the model stops with it.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5, trust_env=False)


# ----------------------------------------------------------------- deployed, on a real stack


def _deploy(stack: Stack, project: Path, deployment: str) -> dict:
    done = stack.prefect_in(project, DEPLOY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reply = httpx.get(f"{stack.api}/deployments/name/{deployment}", timeout=30)
    return reply.raise_for_status().json()


def _run(stack: Stack, project: Path, command: str, *params: str) -> dict:
    """Run a deployment from ``project`` and watch it to the end; return the flow run."""
    flags = [a for p in params for a in ("--param", p)]
    done = stack.prefect_in(project, command, *flags, timeout=420)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:] + stack.logs()
    assert "Flow run finished successfully in 'Completed'" in out, out[-3000:]
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    run = stack.flow_run(run_id)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    return run


def _replica_code(stack: Stack) -> list[Path]:
    """The PYTHONPATH folders of the serving replicas under the stack's Ray head: where the
    code shipped with the job (Ray's py_modules) is unpacked."""
    head = stack.ray_head()
    found = []
    for pid in descendants(head):
        try:
            if b"ServeReplica" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"PYTHONPATH="):
                found += [Path(p) for p in entry[11:].decode().split(os.pathsep) if p]
    return found


def _working_directory(deployment: dict) -> str:
    (step,) = deployment["pull_steps"]
    return step["prefect.deployments.steps.set_working_directory"]["directory"]


def _kill_mid_training(stack: Stack, run_id: str, storage: Path) -> None:
    """SIGKILL the flow process of ``run_id`` once it has a checkpoint, its training paused
    meanwhile so that it cannot end first."""
    from ringflow.storage import CheckpointStore

    store = CheckpointStore(str(storage / "checkpoints"))
    deadline = time.monotonic() + 300
    while not store.checkpoints(run_id):
        assert stack.flow_run(run_id)["state"]["type"] in {"SCHEDULED", "PENDING", "RUNNING"}
        assert time.monotonic() < deadline, "no checkpoint within 5 minutes" + stack.logs()
        time.sleep(0.05)
    with stack.training_paused():
        (process,) = stack.flow_processes(run_id)
        kill_tree(process)


@pytest.mark.e2e
def test_your_own_flow_deployed_from_your_project_trains_on_the_ray_head_and_serves(
    stack, tmp_path
):
    """Deployed as docs/own-model.md says (deploy.sh with the project's prefect.yaml, the
    template's tag and heartbeat), its flow process SIGKILLed mid-training: the run comes
    back by itself, completes once, and serves."""
    project = shutil.copytree(EXAMPLES / "user-project", tmp_path / "wine")
    stack.script("deploy.sh", "prefect.yaml", cwd=project)
    reply = httpx.get(f"{stack.api}/deployments/name/wine-pipeline/lab", timeout=30)
    deployment = reply.raise_for_status().json()
    # {{ $PWD }} was resolved when deploying: the worker's run works in this directory.
    assert _working_directory(deployment) == str(project)
    assert deployment["work_pool_name"] == stack.env["RINGFLOW_POOL"]

    storage = project / ".ringflow" / "storage"
    run_id = stack.run_deployment(
        "wine-pipeline/lab", {"epochs": 30, "serve_port": stack.serve_port}
    )
    _kill_mid_training(stack, run_id, storage)
    run = stack.wait_until_completed(run_id, 300)
    names = [s["name"] for s in stack.states(run_id)]
    assert run["run_count"] == 2, names
    assert (names.count("AwaitingRetry"), names.count("Completed")) == (1, 1), names
    # It went on from where the killed process had trained to, not from the start.
    assert f"resumed run {run_id} from its checkpoint at step" in stack.run_log(run_id)

    # The project's own task ran first: it wrote its features under the storage URL, and
    # they are what the model was trained on and what serving takes.
    import pandas as pd

    table = pd.read_parquet(storage / "features" / "wine.parquet")
    endpoint = f"http://127.0.0.1:{stack.serve_port}"
    info = httpx.get(f"{endpoint}/model", timeout=30, trust_env=False).json()
    served = [f["name"] for f in info["input"]["features"]]
    assert served == [c for c in table.columns if c != "cultivar"]
    assert {"flavanoid_share", "colour_per_hue"} <= set(served)

    # The flow process has ended; the model answers from the Ray head, where the replicas
    # import the project's own `models` package (shipped with the job), not ringflow's.
    rows = json.loads(table.drop(columns="cultivar").to_json(orient="records"))
    one = _post(f"{endpoint}/predict", rows[0])
    assert one.status_code == 200, one.text
    answer = one.json()
    assert answer["label"] in (0, 1, 2)
    assert len(answer["probabilities"]) == 3
    assert sum(answer["probabilities"]) == pytest.approx(1.0, abs=1e-4)
    assert answer["model"]["module"] == "models.wine:WineClassifier"
    assert answer["model"]["version"] == "v0001"
    assert any((path / "models" / "wine.py").is_file() for path in _replica_code(stack))
    every = _post(f"{endpoint}/predict", {"instances": rows})
    assert every.status_code == 200, every.text
    labels = [p["label"] for p in every.json()["predictions"]]
    accuracy = sum(a == b for a, b in zip(labels, table["cultivar"], strict=True)) / len(rows)
    assert accuracy >= 0.8, accuracy

    shown = subprocess.run(
        _python(REGISTRY.replace("house-price", "wine")),
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["production"] == "v0001"


@pytest.mark.e2e
def test_the_regression_project_deploys_ringflows_own_flow(stack, tmp_path):
    project = _houses_project(tmp_path)
    deployment = _deploy(stack, project, "train-pipeline/houses")
    assert _working_directory(deployment) == str(project)
    assert deployment["parameters"] == {
        "model": "houses:HousePrice",
        "data_url": "houses.csv",
        "label": "price",
    }

    _run(
        stack,
        project,
        RUN_HOUSES,
        "tune_trials=0",
        'training={"epochs": 10}',
        f"serve_port={stack.serve_port}",
    )
    # houses.csv and the `houses` module were found in the project's directory, and the
    # model serves after the run: the house-price model now answers on the stack's port.
    _assert_answers_prices(f"http://127.0.0.1:{stack.serve_port}/predict")
    assert (project / ".ringflow" / "storage" / "registry" / "house-price").is_dir()
