"""``horovod-train``: a Horovod-style PyTorch script as a stage of a flow.

The script (a file: the ``python train.py ARGS`` of ``horovodrun``; or a function,
``package.module:train``, called with keyword arguments as ``horovod.run(fn)`` calls it) runs
on ``np`` ranks of Ray actors, as under ``ringflow-run``; it saves and finds its checkpoints through
``ringflow.horovod.checkpoint``, under ``{storage_url}/checkpoints/{run_key}``. A flow run
restarted after a crash (the deployment's automations reschedule it) keeps its run key and
resumes from the newest checkpoint; a script that exits with an error fails the run at once,
with no retry. Run it locally with no server: ``python -m ringflow.flows.horovod_train --help``.
"""

# ruff: noqa: E402 (Prefect and the tasks are imported after the command line's checks)
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

from pydantic import Field


def horovod_train(
    script: Annotated[str | None, Field(min_length=1)] = None,
    args: list[str] | None = None,
    function: Annotated[str | None, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")] = None,
    kwargs: dict | None = None,
    np: Annotated[int, Field(ge=1, le=4096)] = 2,
    min_np: Annotated[int | None, Field(ge=1, le=4096)] = None,
    max_np: Annotated[int | None, Field(ge=1, le=4096)] = None,
    cpus_per_worker: Annotated[float, Field(gt=0, le=1024)] = 1.0,
    gpus_per_worker: Annotated[int, Field(ge=0, le=64)] = 0,
    timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 30.0,
    storage_url: str = ".ringflow/storage",
    run_key: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")] = None,
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 3,
) -> dict:
    """Run a Horovod-style training script on ranks of Ray actors, its checkpoints kept.

    Args:
        script: the script's path (``train.py``), relative to where the flow runs; it
            imports ``ringflow.horovod as hvd`` where it imported ``horovod.torch``.
        args: the script's own arguments.
        function: instead of a script, a training function, ``package.module:train``,
            importable where the flow and the ranks run; each rank calls it.
        kwargs: the function's keyword arguments (JSON values).
        np: ranks (ringflow-run's -np).
        min_np: an elastic run: the fewest ranks it goes on with (ringflow-run's --min-np).
        max_np: an elastic run: the most ranks it takes in (ringflow-run's --max-np).
        cpus_per_worker: CPUs of each rank's Ray actor.
        gpus_per_worker: GPUs of each rank's Ray actor.
        timeout_s: every collective's deadline: a lost rank is an error within it.
        storage_url: where the run's checkpoints go (any fsspec URL).
        run_key: what the checkpoints are kept under; empty means this flow run's id, which
            stays the same across its restarts.
        max_restarts: how often this flow run may start again after a crash; a run started
            more often fails at once without training.
    """
    refused = too_many_starts(max_restarts)
    if refused is not None:
        return refused
    try:
        program = _program(script, args, function, kwargs)
    except ValueError as err:
        return fail_at_once(err)
    launcher = ["--cpus-per-worker", str(cpus_per_worker), "--timeout-s", str(timeout_s)]
    launcher += ["--gpus-per-worker", str(gpus_per_worker)]
    launcher += [] if min_np is None else ["--min-np", str(min_np)]
    launcher += [] if max_np is None else ["--max-np", str(max_np)]
    try:
        result = run_script(
            program,
            np=np,
            launcher=launcher,
            storage_url=storage_url,
            run_key=run_key or str(flow_run.get_id() or "local"),
        )
    except ScriptFailed as err:  # the script's own error: no retry fixes it
        return fail_at_once(err)
    publish_summary(result)
    return result


def _program(
    script: str | None, args: list[str] | None, function: str | None, kwargs: dict | None
) -> list[str]:
    """What each rank runs: the script with its arguments, or the function's caller.

    Raises:
        ValueError: not exactly one of a script and a function, a script that is not a
            file, or a function that cannot be imported.
    """
    if (script is None) == (function is None):
        raise ValueError("give a script or a function (package.module:train), not both")
    if script is not None:
        if kwargs:
            raise ValueError("kwargs are a function's: a script takes args")
        if not Path(script).is_file():
            raise ValueError(f"script {script!r}: no such file")
        return [sys.executable, str(Path(script).resolve()), *(args or [])]
    if args:
        raise ValueError("args are a script's: a function takes kwargs")
    from ringflow.horovod.call import resolve

    resolve(function)  # importable here, as it must be on the ranks
    return [sys.executable, "-m", "ringflow.horovod.call", function, json.dumps(kwargs or {})]


def preflight(parameters: dict) -> None:
    """The command line's second check, before Prefect or Ray starts."""
    _program(
        parameters.get("script"),
        parameters.get("args"),
        parameters.get("function"),
        parameters.get("kwargs"),
    )


if __name__ == "__main__":
    from ringflow.flows.cli import main

    raise SystemExit(main(horovod_train))

from prefect import flow
from prefect.runtime import flow_run

from ringflow.flows.train_pipeline import fail_at_once, publish_summary, too_many_starts
from ringflow.tasks.horovod import ScriptFailed, run_script

horovod_train = flow(name="horovod-train", persist_result=True, result_serializer="json")(
    horovod_train
)
