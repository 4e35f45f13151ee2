"""The flow's parameters: documented, checked before any work, on every way in (the command
line's refusals are in test_cli_errors.py)."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest
from prefect.exceptions import ParameterTypeError, SignatureMismatchError
from prefect.utilities.callables import parameter_schema

from ringflow.engine.config import TrainConfig
from ringflow.flows.train_pipeline import train_pipeline

PARAMETERS = list(inspect.signature(train_pipeline.fn).parameters)
"""The flow function's own parameters, in order: what a deployment, the CLI and the UI get."""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ringflow.flows.train_pipeline", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_parameter_is_documented_in_the_schema_a_deployment_shows():
    schema = parameter_schema(train_pipeline)
    assert list(schema.properties) == PARAMETERS  # none dropped or renamed on the way
    undocumented = [name for name in PARAMETERS if not schema.properties[name].get("description")]
    assert not undocumented, f"no Args: entry in train_pipeline's docstring for {undocumented}"


def test_cli_help_lists_every_parameter():
    result = _cli("--help")
    assert result.returncode == 0
    options = [name for name in PARAMETERS if name != "training"]  # its fields instead
    options += [field.name for field in dataclasses.fields(TrainConfig)]
    for name in options:
        assert "--" + name.replace("_", "-") in result.stdout


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"training": {"workers": -1}}, "workers"),
        ({"training": {"epochs": 0}}, "epochs"),
        ({"model": "not a path"}, "model"),
        ({"task": "ranking"}, "task"),
        ({"serve_port": 70000}, "serve_port"),
        ({"training": {"workers": "two"}}, "workers"),
        ({"training": {"gpus_per_worker": -1}}, "gpus_per_worker"),
        ({"training": {"gpus_per_worker": 0.5}}, "gpus_per_worker"),
        ({"training": {"wokers": 2}}, "wokers"),
        ({"training": {"batch_size": 1, "workers": 2}}, "batch_size"),
    ],
)
def test_bad_values_are_rejected_naming_the_parameter(params, named):
    with pytest.raises(ParameterTypeError, match=named):
        train_pipeline.validate_parameters(params)


def test_training_is_one_typed_parameter_handed_down_as_it_came_every_way_in():
    """Every TrainConfig field can be set from a deployment's parameters (a JSON object) and
    from the command line (an option each); a field not given keeps its default, and the
    run's parts get the very TrainConfig the edge built."""
    from ringflow.flows.cli import _check_command_line
    from ringflow.flows.spec import RunSpec

    given = {"workers": 3, "batch_size": 30, "compression": "bf16", "collective_timeout_s": 5.0}
    from_json = train_pipeline.validate_parameters({"training": given})["training"]
    assert from_json == TrainConfig(**given)
    argv = ["--workers", "3", "--batch-size", "30", "--compression", "bf16"]
    params, _ = _check_command_line(train_pipeline.fn, [*argv, "--collective-timeout-s", "5"])
    assert params["training"] == from_json
    assert _check_command_line(train_pipeline.fn, [])[0]["training"] == TrainConfig()
    spec = RunSpec.build(**{**params, "run_key": "k", "tune_trials": 0})
    assert spec.config is params["training"]


def test_unknown_parameter_is_rejected():
    with pytest.raises(SignatureMismatchError, match="bogus"):
        train_pipeline.validate_parameters({"bogus": 1})


def test_a_run_is_described_by_its_accuracy_gate_endpoint_and_artifacts():
    from ringflow.flows.result import describe

    lines = describe(
        {
            "test_accuracy": 0.96875,
            "test_loss": 0.1,
            "model_name": "digits",
            "model_version": "v0002",
            "promoted": False,
            "gate_reason": "test_accuracy 0.9688 < production's 0.9700",
            "endpoint": "http://127.0.0.1:8000/predict",
            "served_version": "v0001",
            "model_uri": "/s/registry/digits/versions/v0002/model",
            "checkpoint": "/s/runs/k/checkpoints/step-40",
            "dataset_url": "/s/datasets/ab",
            "rejected_rows": 3,
        }
    )
    text = "\n".join(lines)
    assert "accuracy 0.9688, loss 0.1000" in text
    assert "digits v0002 not promoted: test_accuracy 0.9688 < production's 0.9700" in text
    assert "http://127.0.0.1:8000/predict (answering with v0001)" in text
    assert "/s/registry/digits/versions/v0002/model" in text
    assert "(3 rows rejected)" in text
    assert "dashboard" not in text  # trained in one process
    assert "worker logs" not in text
    logs = "/tmp/ray/session_1/logs"
    lines = describe(
        {
            "dashboard": "http://127.0.0.1:8265",
            "worker_logs": [
                {"rank": r, "node": "h", "stdout": f"{logs}/worker-{r}.out"} for r in (0, 1)
            ],
        }
    )
    assert "dashboard   http://127.0.0.1:8265" in lines
    assert f"worker logs {logs} (2 workers' worker-*.out and .err)" in lines
