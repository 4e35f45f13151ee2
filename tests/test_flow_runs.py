"""``train-pipeline`` run in-process against a Prefect server: what a search picks is what
training uses, and bad input ends a run on its first attempt, in one line."""

from __future__ import annotations

import re
import time

import pytest
from prefect import get_client

from ringflow.flows.result import main as show_result
from ringflow.flows.train_pipeline import train_pipeline
from ringflow.storage import read_checkpoint
from tests.test_own_model import write_table

pytestmark = [pytest.mark.ray, pytest.mark.e2e]  # on the run's stack's Prefect server


@pytest.fixture(scope="module")
def houses(tmp_path_factory):
    return str(write_table(tmp_path_factory.mktemp("data") / "houses.csv", regression=True))


def _run_count(state) -> int:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id).run_count


@pytest.mark.parametrize(
    ("params", "why"),
    [
        (
            {"model": "nosuch.module:Model"},
            "ModelError: model 'nosuch.module:Model': cannot import",
        ),
        ({"label": "price"}, r"PreflightError: data_url .* has no column 'price' \(named by label"),
        ({"data_url": "/nonexistent/houses.csv"}, "PreflightError: data_url .* does not exist"),
        ({"hparams": {"depth": 0}}, r"ModelError: TabularMLP\(depth=0, input_dim=4\) refused"),
    ],
)
def test_bad_input_ends_the_run_on_its_first_attempt_saying_why(
    params, why, prefect_server, ray_session, houses, tmp_path, capsys
):
    state = train_pipeline(
        **{
            "model": "ringflow.models.tabular:TabularMLP",
            "data_url": houses,
            "label": "target",
            "storage_url": str(tmp_path),
            "tune_trials": 0,
            "serve": False,
            **params,
        },
        return_state=True,
    )
    assert state.is_failed()
    assert "\n" not in state.message
    assert re.search(why, state.message), state.message
    assert _run_count(state) == 1  # failed once: the flow's retry was not used
    capsys.readouterr()
    assert show_result([str(state.state_details.flow_run_id)]) == 1
    shown = capsys.readouterr().out
    assert re.search(r"^  why +" + why, shown, re.M), shown


def test_the_configuration_a_search_picks_is_the_one_training_uses(
    prefect_server, ray_session, houses, tmp_path, capsys
):
    # The base configuration (batch 256, no compression) is the first trial; the second takes
    # the only values the space offers, and with 16 times the steps per epoch it wins.
    state = train_pipeline(
        model="ringflow.models.tabular:TabularMLP",
        hparams={"hidden": 16},
        data_url=houses,
        label="target",
        storage_url=str(tmp_path),
        training={"workers": 1, "epochs": 1, "batch_size": 256, "log_every_n_steps": 10},
        tune_trials=2,
        tune_epochs=2,
        tune_space={"batch_size": [16], "compression": ["bf16"], "lr": [0.02]},
        serve=False,
        loggers=["csv"],
        return_state=True,
    )
    result = state.result()
    assert result["tune"]["best_params"] == {"batch_size": 16, "compression": "bf16", "lr": 0.02}
    trained = read_checkpoint(result["checkpoint"])
    assert trained.meta["train_config"]["batch_size"] == 16
    assert trained.meta["train_config"]["compression"] == "bf16"
    assert trained.hparams["lr"] == 0.02
    assert result["hparams"] == {"hidden": 16, "lr": 0.02}
    # The loggers asked for, under the run's folder: Lightning's names and steps.
    run_key = trained.meta["run_key"]
    with open(tmp_path / "runs" / run_key / "logs" / "csv" / "metrics.csv") as rows:
        header = rows.readline().strip().split(",")
    assert {"epoch", "step", "train_loss", "val_loss", "val_mae"} <= set(header), header
    # What the engine logs reaches the run's log (its checkpoints), once per checkpoint; the
    # run's logs reach the server in batches, in the background.
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    flow_run = LogFilterFlowRunId(any_=[state.state_details.flow_run_id])
    saving = rf"checkpoint of step \d+ of run {run_key}: saving"
    for _ in range(60):
        with get_client(sync_client=True) as client:
            logged = [entry.message for entry in client.read_logs(LogFilter(flow_run_id=flow_run))]
        saves = [m for m in logged if re.fullmatch(saving, m)]
        if saves:
            break
        time.sleep(0.5)
    assert len(saves) == 1, logged  # one epoch: its end
    capsys.readouterr()
    assert show_result([str(state.state_details.flow_run_id)]) == 0
    shown = capsys.readouterr().out
    assert f"model       {result['model_uri']}" in shown, shown
    assert re.search(r"^  gate +tabular_mlp v0001 promoted to production: ", shown, re.M), shown
