"""``score-pipeline``'s deployments on the run's real stack (tests/support/stack.py):
``score-pipeline/local`` scores a table on the process worker, every row once, as ``/predict``
answers; ``score-pipeline/nightly`` starts when a run of ``train-pipeline/nightly`` ends, and
not when another deployment's run does.

The model is a tiny digits version registered into a storage URL of the test's own, so the
test does not depend on what earlier e2e tests trained.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import UTC, datetime

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ringflow.models.digits import SCHEMA, DigitsClassifier
from ringflow.serving.replica import _forward, _load_served
from ringflow.storage.checkpoint import save_model
from ringflow.storage.layout import Workspace
from ringflow.storage.registry import ModelRegistry

pytestmark = pytest.mark.e2e

DIGITS = "ringflow.models.digits:DigitsClassifier"
ROWS = 400
_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    """A storage URL whose registry has an untrained digits model (hidden 8) in production."""
    root = str(tmp_path_factory.mktemp("score-storage"))
    torch.manual_seed(0)
    module = DigitsClassifier(hidden=8).eval()
    uri = save_model(
        f"{root}/runs/r0/model",
        module,
        hparams=dict(module.hparams),
        meta={"data_schema": SCHEMA.to_json()},
    )
    registry = ModelRegistry(Workspace(root).registry, "digits")
    registry.promote(
        registry.register(uri, metrics={"test_accuracy": 0.1}, data_fingerprint="d").version
    )
    return root


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> tuple[str, pa.Table]:
    """The first digits as a folder of two Parquet files keyed by ``order_id``."""
    from sklearn.datasets import load_digits

    pixels = load_digits().data[:ROWS]
    rows = pa.table(
        {"order_id": [f"o{i:04d}" for i in range(ROWS)]}
        | {f"p{i}": pixels[:, i] for i in range(64)}
    )
    folder = tmp_path_factory.mktemp("score-table")
    pq.write_table(rows.slice(0, 250), folder / "part-0.parquet", row_group_size=50)
    pq.write_table(rows.slice(250), folder / "part-1.parquet", row_group_size=50)
    return str(folder), rows


def test_score_pipeline_local_scores_every_row_once_on_the_worker(stack, storage, table):
    folder, rows = table
    run_key = f"e2e-{uuid.uuid4().hex[:8]}"
    run_id = stack.run_deployment(
        "score-pipeline/local",
        {
            "input_url": folder,
            "storage_url": storage,
            "key_columns": ["order_id"],
            "block_rows": 100,
            "run_key": run_key,
        },
    )
    stack.wait_until_completed(run_id, 300)

    output = Workspace(storage).scores(run_key)
    with open(os.path.join(output, "_manifest.json")) as f:
        manifest = json.load(f)
    shards = [e["path"] for e in manifest["files"]]
    assert all(p.startswith("predictions/") for p in shards), shards  # nothing rejected
    scored = pa.concat_tables([pq.read_table(os.path.join(output, p)) for p in shards])
    assert sorted(scored["order_id"].to_pylist()) == rows["order_id"].to_pylist()  # each once
    assert set(scored["model_version"].to_pylist()) == {"v0001"}
    # What /predict answers for the same rows.
    served = _load_served(f"{Workspace(storage).registry}/digits/versions/v0001/model", DIGITS)
    order = {key: n for n, key in enumerate(rows["order_id"].to_pylist())}
    pixels = np.stack([rows[f"p{i}"].to_numpy() for i in range(64)], axis=1)
    expected = _forward(served, pixels[[order[k] for k in scored["order_id"].to_pylist()]].tolist())
    assert scored["digit"].to_pylist() == [a["digit"] for a in expected]
    assert scored["probabilities"].to_pylist() == [a["probabilities"] for a in expected]
    summary = stack.artifact(run_id, "scoring-summary")
    assert f"| rows scored | `{ROWS}` |" in summary, summary
    assert f"| output | `{output}` |" in summary, summary


def _ended(stack, flow: str, deployment: str) -> dict:
    """A flow run event's resources, as the server emits them when a run of
    ``flow/deployment`` ends Completed."""
    found = (
        httpx.post(
            f"{stack.api}/deployments/filter",
            json={
                "flows": {"name": {"any_": [flow]}},
                "deployments": {"name": {"any_": [deployment]}},
            },
            timeout=30,
        )
        .raise_for_status()
        .json()
    )
    assert len(found) == 1, found
    run_id = str(uuid.uuid4())
    return {
        "id": str(uuid.uuid4()),
        "occurred": datetime.now(UTC).isoformat(),
        "event": "prefect.flow-run.Completed",
        "resource": {
            "prefect.resource.id": f"prefect.flow-run.{run_id}",
            "prefect.resource.name": "fake-run",
            "prefect.state-name": "Completed",
            "prefect.state-type": "COMPLETED",
        },
        "related": [
            {
                "prefect.resource.id": f"prefect.flow.{found[0]['flow_id']}",
                "prefect.resource.role": "flow",
                "prefect.resource.name": flow,
            },
            {
                "prefect.resource.id": f"prefect.deployment.{found[0]['id']}",
                "prefect.resource.role": "deployment",
                "prefect.resource.name": deployment,
            },
        ],
    }


def _nightly_scoring_runs(stack) -> list[dict]:
    body = {
        "flows": {"name": {"any_": ["score-pipeline"]}},
        "deployments": {"name": {"any_": ["nightly"]}},
    }
    reply = httpx.post(f"{stack.api}/flow_runs/filter", json=body, timeout=30)
    return reply.raise_for_status().json()


def _settled_nightly_scoring_runs(stack) -> set[str]:
    """The ids of score-pipeline/nightly's runs once no new one has come for 3 s: each run of
    train-pipeline/nightly that an earlier e2e test ended on this stack started one."""
    seen, since = {r["id"] for r in _nightly_scoring_runs(stack)}, time.monotonic()
    deadline = since + 60
    while time.monotonic() - since < 3:
        assert time.monotonic() < deadline, "score-pipeline/nightly runs keep coming"
        time.sleep(0.5)
        now = {r["id"] for r in _nightly_scoring_runs(stack)}
        if now != seen:
            seen, since = now, time.monotonic()
    return seen


def test_score_pipeline_nightly_starts_when_train_pipeline_nightly_ends(stack):
    earlier = _settled_nightly_scoring_runs(stack)

    def started() -> list[dict]:
        return [r for r in _nightly_scoring_runs(stack) if r["id"] not in earlier]

    # Runs of other deployments ending (train-pipeline/local, score-pipeline/nightly itself)
    # start nothing; sent first, so a run they started would show by the time the
    # train-pipeline/nightly one's does.
    events = [
        _ended(stack, "train-pipeline", "local"),
        _ended(stack, "score-pipeline", "nightly"),
        _ended(stack, "train-pipeline", "nightly"),
    ]
    httpx.post(f"{stack.api}/events", json=events, timeout=30).raise_for_status()
    deadline = time.monotonic() + 120
    while not (runs := started()):
        assert time.monotonic() < deadline, "no score-pipeline/nightly run" + stack.logs()
        time.sleep(1)
    assert len(runs) == 1, runs
    # It scores the day's table that deploy.sh named (RINGFLOW_SCORE_INPUT); the stack has
    # none, so the run fails once, before any work, saying so.
    assert runs[0]["parameters"]["input_url"] == str(stack.state / "score-input")
    deadline = time.monotonic() + 240
    while (run := stack.flow_run(runs[0]["id"]))["state"]["type"] not in _FINAL:
        assert time.monotonic() < deadline, run["state"]
        time.sleep(2)
    assert run["state"]["type"] == "FAILED", run["state"]
    assert "does not exist" in run["state"]["message"], run["state"]
    assert run["run_count"] == 1
    assert len(started()) == 1
