"""``train-pipeline``: preprocess, tune, train on Ray workers, evaluate, publish and serve.

Run it locally with no server: ``python -m flows.train_pipeline --help``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from prefect import flow, get_client
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.states import Failed
from pydantic import Field

from storage import CheckpointStore, CommittedCheckpoint, join
from storage.fs import absolute
from tasks import demo_data, evaluate, preprocess, publish, train, tune
from tasks import serve as serve_task


@flow(
    name="train-pipeline",
    retries=1,
    retry_delay_seconds=10,
    persist_result=True,
    result_serializer="json",
)
def train_pipeline(
    data_url: str | None = None,
    storage_url: str = ".ringflow/storage",
    workers: Annotated[int, Field(ge=1, le=1024)] = 2,
    epochs: Annotated[int, Field(ge=1, le=100_000)] = 20,
    batch_size: Annotated[int, Field(ge=1, le=1_000_000)] = 64,
    learning_rate: Annotated[float, Field(gt=0, le=10)] = 0.01,
    hidden: Annotated[int, Field(ge=1, le=65_536)] = 128,
    tune_trials: Annotated[int, Field(ge=0, le=1000)] = 4,
    tune_epochs: Annotated[int, Field(ge=1, le=100_000)] = 5,
    serve: bool = True,
    serve_port: Annotated[int, Field(ge=1, le=65_535)] = 8000,
    seed: Annotated[int, Field(ge=0)] = 0,
    checkpoint_every: Annotated[int, Field(ge=0)] = 0,
    run_key: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")] = None,
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 3,
) -> dict:
    """Train the digits classifier end to end and serve it.

    Args:
        data_url: CSV or Parquet file (any fsspec URL) with columns p0..p63 and label; empty
            means the bundled digits, dropped as a raw CSV under storage_url.
        storage_url: where datasets, checkpoints and published models go (any fsspec URL).
        workers: data-parallel Ray workers for training.
        epochs: training epochs.
        batch_size: global batch size, split across the workers.
        learning_rate: Adam learning rate (the search starts from it).
        hidden: hidden-layer width (the search starts from it).
        tune_trials: hyperparameter-search trials; 0 skips the search.
        tune_epochs: epochs of each search trial (bad trials stop earlier).
        serve: serve the trained model over HTTP with Ray Serve.
        serve_port: HTTP port of the served model on 127.0.0.1.
        seed: seeds data splits, weight initialisation and shuffling.
        checkpoint_every: checkpoint the training state every this many steps (0: at epoch
            ends only); a retried run resumes from the newest checkpoint.
        run_key: what checkpoints are kept under; empty means this flow run's id, which
            stays the same across its retries. Give the key of a killed local run to resume it.
        max_restarts: how often this flow run may start again after a failure or a crash
            (flow retries and automatic rescheduling together); a run started more often
            fails at once without training, which ends any crash loop.
    """
    attempt = flow_run.get_run_count() or 1
    if attempt > max_restarts + 1:
        return Failed(
            message=f"Not started again: this is start {attempt} of a run allowed "
            f"{max_restarts} restarts (raise max_restarts to allow more)"
        )
    if batch_size < workers:
        raise ValueError(f"batch_size ({batch_size}) must be at least workers ({workers})")
    storage_url = absolute(storage_url)
    run_key = run_key or str(flow_run.get_id() or "local")
    source = absolute(data_url) if data_url else demo_data(storage_url)
    dataset = preprocess(source, storage_url, seed=seed)
    hparams = {"lr": learning_rate, "hidden": hidden}
    common = {"run_key": run_key, "batch_size": batch_size, "seed": seed}
    if tune_trials:
        best = tune(
            dataset["dataset_url"],
            storage_url,
            base_hparams=hparams,
            trials=tune_trials,
            epochs=tune_epochs,
            **common,
        )
        hparams = {**hparams, **best["best_params"]}
    # Listed before training, which may delete them (retention): the steps-lost estimate needs them.
    checkpoints = CheckpointStore(join(storage_url, "checkpoints")).checkpoints(run_key)
    trained = train(
        dataset["dataset_url"],
        storage_url,
        hparams=hparams,
        workers=workers,
        epochs=epochs,
        checkpoint_every=checkpoint_every,
        **common,
    )
    if trained["resumed_from_step"] is not None:
        _report_resume(checkpoints, run_key, trained["resumed_from_step"], attempt)
    test = evaluate(trained["checkpoint"], dataset["dataset_url"])
    model_uri = publish(trained["checkpoint"], storage_url, run_key=run_key)
    result = {
        "test_accuracy": test["test_accuracy"],
        "test_loss": test["test_loss"],
        "checkpoint": trained["checkpoint"],
        "model_uri": model_uri,
        "hparams": hparams,
        "dataset_url": dataset["dataset_url"],
        "rejected_rows": dataset["rejected_rows"],
        "run_key": run_key,
        "resumed_from_step": trained["resumed_from_step"],
        "run_count": attempt,
    }
    if serve:
        result.update(serve_task(model_uri, dataset["dataset_url"], port=serve_port))
    create_markdown_artifact(
        key="run-summary",
        markdown="| | |\n|---|---|\n" + "".join(f"| {k} | `{v}` |\n" for k, v in result.items()),
        description="What this run produced",
    )
    return result


def _report_resume(
    checkpoints: list[CommittedCheckpoint], run_key: str, step: int, attempt: int
) -> None:
    """Log why this run resumed and roughly how many steps it lost; add a ``resume`` artifact."""
    cause, crashed_at = _last_failure()
    lost = _steps_lost(checkpoints, step, crashed_at)
    lost_text = "unknown" if lost is None else f"about {lost} (step rate x time to the crash)"
    get_run_logger().warning(
        "start %d of run %s resumed at step %d after: %s; steps lost: %s",
        attempt,
        run_key,
        step,
        cause,
        lost_text,
    )
    create_markdown_artifact(
        key="resume",
        markdown=f"| | |\n|---|---|\n| start | {attempt} |\n| cause | {cause} |\n"
        f"| resumed from step | {step} |\n| steps lost | {lost_text} |\n",
        description=f"Why start {attempt} of this run resumed, and from where",
    )


def _last_failure() -> tuple[str, datetime | None]:
    """What ended this flow run's previous start (a Crashed, Failed or AwaitingRetry state)."""
    run_id = flow_run.get_id()
    states = []
    if run_id is not None:
        with get_client(sync_client=True) as client:
            states = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
    running = [i for i, s in enumerate(states) if s.is_running()]
    cause = None
    # Back from the current start to the previous one: the crash or failure in between.
    for state in reversed(states[running[-2] + 1 : running[-1]] if len(running) > 1 else []):
        if state.is_crashed() or state.is_failed():
            return f"{state.name}: {state.message}", state.timestamp
        if state.is_scheduled():
            cause = cause or state
    if cause is None:
        return "an earlier run under the same run key stopped", None
    return f"{cause.name}: {cause.message}", cause.timestamp


def _steps_lost(
    checkpoints: list[CommittedCheckpoint], step: int, ended: datetime | None
) -> int | None:
    """Steps trained after checkpoint ``step`` and lost, from the step rate between checkpoints.

    An upper bound where the crash was noticed late (a lost host is marked Crashed only after
    its heartbeats have been missing for a while).
    """
    before = [c for c in checkpoints if c.step <= step]
    if ended is None or len(before) < 2:
        return None
    (a, b) = (before[-2], before[-1])
    times = [datetime.fromisoformat(c.created) for c in (a, b)]
    rate = (b.step - a.step) / max((times[1] - times[0]).total_seconds(), 1e-3)
    return max(0, round(rate * (ended - times[1]).total_seconds()))


if __name__ == "__main__":
    from flows.cli import main

    raise SystemExit(main(train_pipeline))
