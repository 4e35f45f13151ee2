"""Distributed training and evaluation of the model a flow names."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import NoReturn

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ringflow.engine import DataSpec, EpochMetrics, TrainConfig, fit
from ringflow.engine import evaluate as evaluate_model
from ringflow.engine.cluster import connect, trains_in_process
from ringflow.engine.pipeline import PipelineConfig
from ringflow.engine.spec import ModelRef
from ringflow.engine.timeline import TimelineSummary
from ringflow.storage.fs import join
from ringflow.storage.layout import Workspace
from ringflow.storage.lease import LeaseError, LeaseHeldError, RunLease, read_lease
from ringflow.storage.store import CheckpointStore
from ringflow.tasks.report import epoch_table, loss_curve


@task(name="train")
def train(
    model: ModelRef,
    dataset_url: str | None,
    storage_url: str,
    *,
    run_key: str,
    config: TrainConfig,
    pipeline: PipelineConfig | None = None,
    init_from: str | None = None,
    loggers: tuple[str, ...] = (),
    model_name: str | None = None,
) -> dict:
    """Train ``model`` on Ray actors; return the checkpoint URL and the final metrics. One
    CPU worker with no Ray cluster named trains in this process and starts no Ray
    (``engine.cluster.trains_in_process``).

    Args:
        model: the model class by import path, and its hyperparameters.
        dataset_url: the preprocessed dataset; ``None``: the model's own
            ``train_dataloader()``.
        config: workers, epochs, batch size, seed, elasticity, CPUs and GPUs per worker...
        pipeline: with more than one stage the model is split into pipeline stages,
            ``config.workers`` replicas of them.
        init_from: a committed model to warm-start from.
        loggers: Lightning loggers by name (:func:`run_loggers`), written under the run's
            ``logs`` folder; ``model_name`` names an MLflow experiment.

    Training is checkpointed under ``{storage_url}/checkpoints/{run_key}``, so a retried
    flow run (same run key) resumes where the failed attempt stopped. The run key's lease
    (``storage.lease``) is held while training: a second process for the same run key is
    refused (``LeaseHeldError``, naming the holder), at once if the holder is alive on this
    machine, else when the holder's lease has not expired within ``RINGFLOW_LEASE_TTL_S``; a
    second start of this same flow run exits quietly and leaves the run to the one holding it.
    """
    stages = pipeline.stages if pipeline is not None else 1
    in_process = trains_in_process(
        workers=config.workers, gpus_per_worker=config.gpus_per_worker, stages=stages
    )
    if not in_process:
        connect(model=model.path)  # first: the lease names this process's Ray job as its writer
    workspace = Workspace(storage_url)
    if pipeline is not None and pipeline.stages > 1 and config.cpus_per_worker == 1.0:
        cpus = _stage_cpus(config.workers * pipeline.stages)
        config = config.with_changes(cpus_per_worker=cpus)
    lease = _hold_run_key(workspace.checkpoints, run_key, config)
    writers = run_loggers(loggers, workspace.logs(run_key), run_key, model_name)
    with lease, _engine_logs(), _epoch_progress(config.epochs) as on_epoch:
        try:
            result = fit(
                model.resolve(),
                hparams=model.hparams,
                data=_data(dataset_url),
                config=config,
                checkpoint_uri=workspace.run_model(run_key),
                in_process=in_process,
                on_epoch=on_epoch,
                store_url=workspace.checkpoints,
                run_key=run_key,
                init_from=init_from,
                pipeline=pipeline,
                loggers=writers,
                timeline_url=workspace.timeline(run_key),
            )
            lease.check()  # raises if another process took the run key meanwhile
        except Exception as err:
            # Superseded by another start of this flow run: whatever went wrong here, that
            # start owns the run's state, which this one must not turn Failed.
            _step_aside_if_superseded(workspace.checkpoints, run_key, lease, err)
            raise
    if result.resumed_from is not None:
        get_run_logger().warning(
            "resumed run %s from its checkpoint at step %d", run_key, result.resumed_from
        )
    _report_events(result.events)
    _report_places(result.dashboard, result.worker_logs)
    epoch_table(result.history, key="training-metrics")
    loss_curve(result.history, key="training-loss-curve")
    if result.timeline is not None:
        create_markdown_artifact(
            key="training-timeline",
            markdown=timeline_markdown(result.timeline),
            description="Where the workers' step time went, and the communication hidden "
            "behind backward",
        )
    return {
        "checkpoint": result.checkpoint,
        "metrics": result.metrics,
        "resumed_from_step": result.resumed_from,
        "dashboard": result.dashboard,
        "worker_logs": result.worker_logs,
    }


def _report_places(dashboard: str | None, worker_logs: list[dict]) -> None:
    """Where to look while debugging the run: the Ray dashboard, and each worker's output,
    as an artifact (the engine logged them as the workers started)."""
    if not dashboard and not worker_logs:
        return  # trained in this process: its output is the flow's own
    rows = "".join(
        f"| {w['rank']} | {w['node']} | `{w['stdout']}` | `{w.get('stderr', '')}` |\n"
        for w in worker_logs
    )
    create_markdown_artifact(
        key="training-workers",
        markdown=(
            f"**Ray dashboard:** {dashboard or 'none (the cluster runs no dashboard)'}\n\n"
            "| rank | node | stdout | stderr |\n|---|---|---|---|\n" + rows
        ),
        description="The Ray dashboard of the cluster the run trained on, and where each "
        "worker's output is",
    )


def timeline_markdown(summary: TimelineSummary) -> str:
    """The timeline's summary for people: the overlap first, then the step split in ms."""
    hidden = "no all-reduce" if summary.overlap is None else f"{summary.overlap:.0%}"
    rows = "".join(
        f"| {kind.replace('_', ' ')} | {ms:.3f} |\n" for kind, ms in summary.step_ms.items()
    )
    return (
        f"**Communication hidden behind backward: {hidden}** "
        f"({summary.communication_ms:.3f} ms of all-reduce per step, "
        f"{summary.exposed_communication_ms:.3f} ms of it outside backward).\n\n"
        f"{summary.steps} worker steps recorded over {summary.workers} workers; "
        + (
            f"the trace is at `{summary.trace_url}` (open it in https://ui.perfetto.dev)"
            if summary.trace_url
            else "the trace could not be written (the run's log says why)"
        )
        + ".\n\n"
        f"| per step | ms |\n|---|---|\n{rows}"
    )


def run_loggers(
    names: tuple[str, ...], logs_url: str, run_key: str, model_name: str | None
) -> list:
    """Lightning loggers by name: ``csv`` and ``tensorboard`` in ``logs_url``'s ``csv/`` and
    ``tensorboard/`` (a run resumed under the same key appends to them), ``mlflow`` to
    ``MLFLOW_TRACKING_URI`` in the experiment ``model_name``, as a run named ``run_key``."""
    made = []
    for name in names:
        if name == "csv":
            from lightning.pytorch.loggers import CSVLogger

            made.append(CSVLogger(logs_url, name="", version="csv"))
        elif name == "tensorboard":
            from lightning.pytorch.loggers import TensorBoardLogger

            made.append(TensorBoardLogger(logs_url, name="", version="tensorboard"))
        elif name == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            made.append(
                MLFlowLogger(
                    experiment_name=model_name or "ringflow",
                    run_name=run_key,
                    tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"),
                )
            )
        else:
            raise ValueError(f"loggers: unknown logger {name!r}; use csv, tensorboard or mlflow")
    return made


@contextmanager
def _engine_logs():
    """What the engine logs (resumes, checkpoints, warnings naming what a module does that
    ringflow does not honour) goes to the run's log, except its epoch lines: the progress
    display below gives those."""
    engine = logging.getLogger("ringflow.engine")
    forward = _ToRunLogger(get_run_logger())
    forward.addFilter(lambda record: record.name != "ringflow.engine.progress")
    level, disabled = engine.level, engine.disabled
    engine.addHandler(forward)
    engine.setLevel(logging.INFO)
    # A library's logging setup may have disabled loggers that existed before it ran
    # (``disable_existing_loggers``, dateparser's for one): this one must be heard.
    engine.disabled = False
    try:
        yield
    finally:
        engine.removeHandler(forward)
        engine.setLevel(level)
        engine.disabled = disabled


class _ToRunLogger(logging.Handler):
    def __init__(self, run_logger: logging.LoggerAdapter) -> None:
        super().__init__(logging.INFO)
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        self.run_logger.log(record.levelno, record.getMessage())


def _hold_run_key(store_url: str, run_key: str, config: TrainConfig) -> RunLease:
    """Take the run key's lease, noting how far the start it replaces had got.

    ``RINGFLOW_LEASE_TTL_S`` (default 60) is how long a lease outlives its holder's last
    renewal; a second process waits that long for a held lease before it is refused.
    """
    ttl = float(os.environ.get("RINGFLOW_LEASE_TTL_S", "60"))
    me = {"flow_run": str(flow_run.get_id() or ""), "start": flow_run.get_run_count() or 1}
    try:
        lease = RunLease.acquire(store_url, run_key, ttl_s=ttl, info=me)
    except LeaseHeldError as err:
        if err.lease is not None and _same_flow_run(err.lease.holder):
            _step_aside(str(err))
        raise
    previous = lease.previous
    if previous is not None:
        begun = CheckpointStore(store_url).steps_begun(run_key)
        lease.renew(
            took_over={
                "token": previous.token,
                "holder": previous.holder,
                "renewed": previous.renewed,
                "reached_step": max(begun, default=None),
            },
            checkpoint_every=config.checkpoint_every,
        )
    return lease


def _step_aside_if_superseded(
    store_url: str, run_key: str, lease: RunLease, error: Exception
) -> None:
    """Step aside (:func:`_step_aside`) if another start of this flow run holds the run key."""
    try:
        holder = read_lease(join(store_url, run_key))
    except (LeaseError, OSError):
        return
    if (
        holder is not None
        and holder.token != lease.token
        and not holder.released
        and _same_flow_run(holder.holder)
    ):
        _step_aside(f"{error}; run key {run_key!r} is held by {holder.describe()}")


def _same_flow_run(holder: dict) -> bool:
    """Whether a lease's holder is a start of this same flow run."""
    mine = flow_run.get_id()
    return bool(mine) and holder.get("flow_run") == str(mine)


def _step_aside(reason: str) -> NoReturn:
    """Leave this flow run to the start of it that holds its run key: end this process
    without proposing a state, so the run is not failed (or rescheduled) under that start.
    """
    get_run_logger().warning(
        "%s; this is a duplicate start of the same flow run, which exits and leaves the run "
        "to the start that holds it",
        reason,
    )
    try:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)
    except Exception:  # the log line is a courtesy; leaving is what matters
        pass
    os._exit(0)


def _stage_cpus(actors: int) -> float:
    """CPUs per pipeline-stage actor: one each where the cluster has them, else a fair share
    (on a laptop, 2 replicas x 2 stages share its cores)."""
    import ray

    return min(1.0, ray.cluster_resources().get("CPU", 1.0) / actors)


def _report_events(events: list) -> None:
    """Log every resume, lost worker, rollback and join, and keep them as an artifact."""
    if not events:
        return
    logger = get_run_logger()
    rows = []
    for event in events:
        logger.warning(
            "%s at step %d: %s (%d workers, %d steps lost)",
            event.kind,
            event.step,
            event.cause,
            event.workers,
            event.steps_lost,
        )
        rows.append(
            {
                "time": datetime.fromtimestamp(event.at, UTC).isoformat(timespec="seconds"),
                "event": event.kind,
                "step": event.step,
                "workers": event.workers,
                "steps lost": event.steps_lost,
                "cause": event.cause,
            }
        )
    create_table_artifact(
        key="training-events",
        table=rows,
        description="Resumes, lost workers, rollbacks and joins during training",
    )


@contextmanager
def _epoch_progress(epochs: int):
    """A terminal progress bar over epochs, and one log line per epoch for the Prefect UI."""
    logger = get_run_logger()
    with Progress(
        TextColumn("training"),
        BarColumn(),
        TextColumn("epoch {task.completed}/{task.total}"),
        TextColumn("{task.fields[metrics]}"),
        TimeElapsedColumn(),
    ) as progress:
        bar = progress.add_task("train", total=epochs, metrics="")

        def on_epoch(m: EpochMetrics) -> None:
            shown = " ".join(f"{k}={v:.4f}" for k, v in m.metrics.items())
            # Set, not advanced: a resumed run's first epoch is not the bar's first.
            progress.update(bar, completed=m.epoch + 1, metrics=shown)
            logger.info("epoch %d/%d %s (%.2f s)", m.epoch + 1, epochs, shown, m.seconds)

        yield on_epoch


@task(name="evaluate")
def evaluate(checkpoint: str, dataset_url: str | None, *, model: str) -> dict:
    """Held-out test metrics of the committed checkpoint, which must hold ``model`` (the
    class's import path): a checkpoint naming another class is refused, never imported.
    ``dataset_url`` ``None``: on the model's own test (else validation) loader; none where
    it has neither."""
    metrics = evaluate_model(checkpoint, _data(dataset_url), model=model)
    if metrics or dataset_url is not None:
        get_run_logger().info("test metrics %s", metrics)
    else:
        get_run_logger().info(
            "not evaluated: %s has neither test_dataloader() and test_step nor "
            "val_dataloader() and validation_step",
            model,
        )
    return metrics


def _data(dataset_url: str | None) -> DataSpec | None:
    """The dataset at ``dataset_url``; ``None`` (the model's own loaders) without one."""
    return None if dataset_url is None else DataSpec(dataset_url=dataset_url)
