"""The ``horovod-train`` flow's task: a Horovod-style script on ranks of Ray actors, its
checkpoints under the run's key, so that a restarted flow run resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from prefect import get_run_logger, task
from prefect.runtime import flow_run

from ringflow.engine.cluster import SECRET_ENV
from ringflow.horovod.checkpoint import RUN_KEY, STORE
from ringflow.horovod.runner import _die_with_parent
from ringflow.storage import CheckpointStore
from ringflow.storage.layout import Workspace
from ringflow.storage.lease import DELEGATE, RunLease

__all__ = ["ScriptFailed", "run_script"]


class ScriptFailed(RuntimeError):
    """The script exited with an error status: its own error, which no retry fixes."""


@task(name="run-horovod-script")
def run_script(
    program: list[str],
    *,
    np: int,
    launcher: list[str],
    storage_url: str,
    run_key: str,
) -> dict[str, Any]:
    """Run ``program`` (``python train.py ARGS``, or ``python -m ringflow.horovod.call
    package.module:train KWARGS``) under ``ringflow-run -np np`` (and ``launcher``'s other
    options); its ranks find the run's checkpoint store in ``RINGFLOW_HOROVOD_CHECKPOINTS``
    and ``RINGFLOW_HOROVOD_RUN_KEY`` (``ringflow.horovod.checkpoint``). Every line the ranks
    print is logged with its rank.

    Raises:
        ScriptFailed: the script exited with an error status (the first failing rank's).
    """
    logger = get_run_logger()
    store_url = Workspace(storage_url).checkpoints
    store = CheckpointStore(store_url)
    store.check_writable()
    before = store.latest(run_key, verify="manifest")
    me = {"flow_run": str(flow_run.get_id() or ""), "start": flow_run.get_run_count() or 1}
    ttl = float(os.environ.get("RINGFLOW_LEASE_TTL_S", "60"))
    command = [sys.executable, "-m", "ringflow.horovod", "-np", str(np), *launcher]
    command += program
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env |= {STORE: store_url, RUN_KEY: run_key, "PYTHONUNBUFFERED": "1"}
    with RunLease.acquire(store_url, run_key, ttl_s=ttl, info=me) as lease:
        env[DELEGATE] = lease.record.holder["nonce"]  # the ranks write for this lease
        if before is not None:
            logger.info("resuming run %s from its checkpoint at step %d", run_key, before.step)
        with subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_die_with_parent,  # the ranks end with this flow process
        ) as process:
            for line in process.stdout:
                logger.info("%s", line.rstrip("\n"))
        lease.check()
    if process.returncode != 0:
        raise ScriptFailed(f"{_shown(program)} exited with status {process.returncode}")
    after = store.latest(run_key, verify="manifest")
    return {
        "run_key": run_key,
        "checkpoint": None if after is None else after.url,
        "step": None if after is None else after.step,
        "resumed_from_step": None if before is None else before.step,
    }


def _shown(program: list[str]) -> str:
    """The script's path, or the function's name, as the user gave it."""
    return program[3] if program[1:3] == ["-m", "ringflow.horovod.call"] else program[1]
