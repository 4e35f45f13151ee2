"""``score-pipeline`` through its command line: the digits demo's production model scores the
digits table, every row once, as ``/predict`` answers; bad input is one line and exit 2,
before Prefect starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.csv as pv
import pyarrow.parquet as pq
import pytest

from ringflow.engine import TrainConfig, fit
from ringflow.models.digits import DigitsClassifier, write_digits_csv
from ringflow.serving.replica import _forward, _load_served
from ringflow.storage.layout import Workspace
from ringflow.storage.registry import ModelRegistry

DIGITS = "ringflow.models.digits:DigitsClassifier"


@pytest.fixture(scope="module")
def storage(digits, tmp_path_factory) -> str:
    """A storage URL whose registry has a small digits model in production."""
    root = str(tmp_path_factory.mktemp("storage"))
    trained = fit(
        DigitsClassifier,
        hparams={"hidden": 32, "lr": 0.01},
        data=digits,
        config=TrainConfig(workers=1, epochs=3, batch_size=64, seed=0),
        checkpoint_uri=f"{root}/runs/r1/model",
        in_process=True,
    ).checkpoint
    registry = ModelRegistry(Workspace(root).registry, "digits")
    version = registry.register(trained, metrics={"test_accuracy": 0.9}, data_fingerprint="d")
    registry.promote(version.version)
    return root


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> str:
    """The digits as a CSV drop, label and all (scoring ignores the label)."""
    url = str(tmp_path_factory.mktemp("table") / "digits.csv")
    write_digits_csv(url)
    return url


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ringflow.flows.score_pipeline", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RINGFLOW_LOCAL_STACK": "0", "RINGFLOW_DEBUG": "0", **env},
    )


@pytest.mark.integration  # a process of its own, reporting to the test process's Prefect
def test_the_production_digits_model_scores_every_row_once(storage, table, prefect_api, capsys):
    done = _cli(
        *(f"--input-url={table}", f"--storage-url={storage}", "--run-key=nightly"),
        "--block-rows=500",
        PREFECT_API_URL=prefect_api,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = pv.read_csv(table)
    assert (result["rows_scored"], result["rows_rejected"]) == (rows.num_rows, 0)
    assert (result["blocks"], result["blocks_scored"]) == (4, 4)
    assert (result["model_name"], result["model_version"]) == ("digits", "v0001")
    assert result["output_url"] == Workspace(storage).scores("nightly")
    assert "block 4/4" in done.stderr  # the progress log
    with open(os.path.join(result["output_url"], "_manifest.json")) as f:
        manifest = json.load(f)
    shards = [os.path.join(result["output_url"], e["path"]) for e in manifest["files"]]
    predictions = pa.concat_tables([pq.read_table(s) for s in shards])
    assert predictions["source_row"].to_pylist() == list(range(1, rows.num_rows + 1))
    labels = rows["label"].to_pylist()
    right = sum(p == y for p, y in zip(predictions["digit"].to_pylist(), labels, strict=True))
    assert right / len(labels) > 0.8  # the trained model, not a random one
    served = _load_served(f"{Workspace(storage).registry}/digits/versions/v0001/model", DIGITS)
    pixels = [[float(rows[f"p{i}"][r].as_py()) for i in range(64)] for r in range(0, 1797, 7)]
    expected = _forward(served, pixels)
    sample = predictions.take(list(range(0, 1797, 7)))
    assert sample["digit"].to_pylist() == [a["digit"] for a in expected]
    assert sample["probabilities"].to_pylist() == [a["probabilities"] for a in expected]
    _shows_the_result(prefect_api, result, capsys)


def _shows_the_result(api: str, result: dict, capsys) -> None:
    """``python -m ringflow.flows.result`` describes the run as a scoring run, and ``--json``
    gives its result as the command line printed it."""
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ringflow.flows.result import main as show_result

    flow = httpx.get(f"{api}/flows/name/score-pipeline").json()
    (run,) = httpx.post(
        f"{api}/flow_runs/filter",
        json={"flows": {"id": {"any_": [flow["id"]]}}, "sort": "START_TIME_DESC", "limit": 1},
    ).json()
    capsys.readouterr()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        assert show_result([run["id"]]) == 0
        shown = capsys.readouterr().out
        assert show_result([run["id"], "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == result
    assert shown.startswith(f"score-pipeline run {run['name']} ({run['id']}): Completed"), shown
    assert "  scored      1,797 rows, 0 rejected, in 4 blocks (0 committed before" in shown, shown
    assert f"  output      {result['output_url']} (complete" in shown, shown


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--key-columns=order_id"], "lacks the schema columns ['order_id']"),
        (["--version=v0009"], "has no version v0009 (committed: v0001)"),
        (["--model=ringflow.models.tabular:TabularMLP"], "refused without importing it"),
        (["--input-url=/nonexistent/rows.parquet"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_work(storage, table, args, named):
    done = _cli(f"--input-url={table}", f"--storage-url={storage}", "--run-key=bad", *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    assert named in lines[0]
    assert not os.path.exists(Workspace(storage).scores("bad"))


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"key_columns": ["order_id"]}, "ScoringError: input .* lacks the schema columns"),
        ({"version": "v0009"}, r"ScoringError: .*has no version v0009 \(committed: v0001\)"),
        ({"model": "ringflow.models.tabular:TabularMLP"}, "refused without importing it"),
        ({"input_url": "/nonexistent/rows.parquet"}, "ScoringError: input .* does not exist"),
    ],
)
def test_bad_input_fails_the_flow_run_on_its_first_attempt_saying_why(
    storage, table, prefect_api, params, why
):
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ringflow.flows.score_pipeline import score_pipeline

    with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
        state = score_pipeline(
            **{"input_url": table, "storage_url": storage, "run_key": "bad-run", **params},
            return_state=True,
        )
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(state.state_details.flow_run_id)
    assert state.is_failed()
    assert "\n" not in state.message
    assert re.search(why, state.message), state.message
    assert run.run_count == 1  # failed once: the flow's retry was not used
    assert not os.path.exists(Workspace(storage).scores("bad-run"))
