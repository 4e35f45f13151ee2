"""``fit``: the one driver that trains a LightningModule on Ray workers, whatever the layout
(data parallel, or pipeline stages: ``engine.layout``)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ringflow.engine.callbacks import Callbacks
from ringflow.engine.cluster import dashboard_url
from ringflow.engine.config import DataSpec, TrainConfig
from ringflow.engine.data import ModuleData, as_data, samples_of
from ringflow.engine.elastic.coordinator import ElasticEvent
from ringflow.engine.epochs import Epochs
from ringflow.engine.errors import EngineError, ModelError
from ringflow.engine.group import LocalGroup, MembershipLost, RayWorkerGroup, Steps, WorkerGroup
from ringflow.engine.layout import Layout, layout_of
from ringflow.engine.metrics import Logged, logger_rows
from ringflow.engine.module import call_hook, overrides, uncalled_hooks
from ringflow.engine.phases import mark
from ringflow.engine.spec import build_module, check_warm_start, model_hparams
from ringflow.engine.timeline import TimelineSummary, chrome_trace, summarize, trace_bytes
from ringflow.engine.worker import Worker, evaluate_module
from ringflow.storage.checkpoint import Allowed, load_model, read_checkpoint, save_model
from ringflow.storage.fs import atomic_write, join
from ringflow.storage.store import CheckpointStore, CommittedCheckpoint

if TYPE_CHECKING:
    from ringflow.engine.pipeline.config import PipelineConfig

__all__ = ["EpochMetrics", "FitResult", "check_layout", "evaluate", "fit"]

log = logging.getLogger("ringflow.engine")
progress = logging.getLogger("ringflow.engine.progress")
"""Epoch lines: a caller with a display of its own (the flow's progress bar) may leave them."""

EpochCallback = Callable[["EpochMetrics"], None]


@dataclass(frozen=True, kw_only=True)
class EpochMetrics:
    """Metrics of one epoch, averaged over every sample of every worker."""

    epoch: int
    metrics: dict[str, float]
    seconds: float
    batch_size: int | None = None
    """The global batch it trained at (under weak scaling with elastic workers, the batch
    per worker times the workers that started it)."""


@dataclass(frozen=True, kw_only=True)
class FitResult:
    """What a finished ``fit`` returns."""

    checkpoint: str
    """URL of the committed model checkpoint."""
    history: list[EpochMetrics] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """The last epoch's metrics."""
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    resumed_from: int | None = None
    """The step this run resumed from, or ``None`` if it started afresh."""
    events: list[ElasticEvent] = field(default_factory=list)
    """Resumes, lost workers, rollbacks and joins, in order."""
    timeline: TimelineSummary | None = None
    """With ``config.timeline``: where the trace was written and what it says."""
    dashboard: str | None = None
    """The Ray dashboard of the cluster the workers ran on, when it runs one."""
    worker_logs: list[dict[str, Any]] = field(default_factory=list)
    """Each Ray worker's ``rank``, ``node`` and the ``stdout`` and ``stderr`` files its output
    went to (a replacement's too), in the order they started."""


def _keeps_the_callers_generator(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` leaves torch's CPU generator as it found it: the driver draws initial
    weights when it builds the module, an in-process worker reseeds at every step, and what
    the caller draws afterwards must not depend on either."""

    @functools.wraps(function)
    def keeping(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return function(*args, **kwargs)

    return keeping


@_keeps_the_callers_generator
def fit(
    module_cls: type[torch.nn.Module],
    *,
    hparams: dict[str, Any],
    data: Any,
    config: TrainConfig,
    checkpoint_uri: str,
    in_process: bool = False,
    on_epoch: EpochCallback | None = None,
    meta: dict[str, Any] | None = None,
    store_url: str | None = None,
    run_key: str | None = None,
    init_from: str | None = None,
    pipeline: PipelineConfig | None = None,
    loggers: Any = None,
    callbacks: list[Any] | None = None,
    timeline_url: str | None = None,
) -> FitResult:
    """Train ``module_cls(**hparams)`` on ``data`` with ``config.workers`` data-parallel workers.

    With ``pipeline``, each worker is a pipeline of ``pipeline.stages`` stage actors instead
    (``engine.layout.Pipeline``); options that layout does not support are refused before
    anything starts (:func:`check_layout`).

    Every worker holds a full replica; each global batch of ``config.batch_size`` samples is
    split across the workers and their gradients are averaged through ``config.collective``
    every step, so the result does not depend on the number of workers.

    With ``store_url``, the training state is checkpointed there under ``run_key`` every
    ``config.checkpoint_every`` steps and at the end of every epoch (asynchronously: a step
    is blocked only while the state is copied to host memory), and a call with a run key that
    already has a committed checkpoint resumes from the newest one that verifies. The resumed
    run ends with the same weights, bit for bit, as the uninterrupted one; calling again after
    it finished trains nothing and returns the same result.

    Args:
        module_cls: a ``LightningModule`` class; ``training_step`` returns the batch-mean loss.
        hparams: keyword arguments for ``module_cls``; checked here, before any worker starts.
            ``input_dim`` and ``num_classes`` come from the data where the constructor
            declares them (``engine.spec.model_hparams``).
        data: the preprocessed dataset (``DataSpec``), ``TensorData``, a
            ``LightningDataModule`` or ``DatasetData`` of map-style datasets (``engine.data``);
            ``None`` (or the module) for the module's own ``train_dataloader()``.
        config: workers, epochs, global batch, seed, collective, checkpoint interval.
        checkpoint_uri: fsspec URL where the trained model is committed.
        in_process: run the single worker in this process instead of a Ray actor.
        on_epoch: called after every epoch with its metrics (progress display, tuning reports).
        meta: extra JSON metadata recorded in the checkpoint.
        store_url: fsspec URL of the checkpoint store; ``None`` trains without checkpoints.
        run_key: the run's identity in the store, stable across retries (the flow run id).
        init_from: URL of a committed model to start from (warm start: its weights, a fresh
            optimizer); ignored when the run resumes from its own checkpoint.
        pipeline: cut the model into pipeline stages (``PipelineConfig``).
        loggers: Lightning loggers (``CSVLogger``, ``TensorBoardLogger``, ``MLFlowLogger``...)
            the driver writes what the module logs to, with Trainer's names and steps.
        callbacks: Lightning ``Callback``s, as Trainer takes them (the module's
            ``configure_callbacks`` are added); ``engine.callbacks`` says where each runs.
        timeline_url: where the Chrome trace of ``config.timeline`` is written; ``None``:
            ``timeline/trace.json`` next to ``checkpoint_uri`` (in its parent folder).

    Returns:
        The checkpoint URL, the per-epoch metrics and the final weights.

    Raises:
        ValueError: bad hyperparameters, ``store_url`` without ``run_key``, or a checkpoint of
            ``run_key`` written by a different configuration.
        CheckpointStorageError: ``store_url`` cannot be written (checked before training).
    """
    mark("fit called")
    data = as_data(data, batch_size=config.batch_size, module_cls=module_cls)
    layout = check_layout(config, pipeline, data=data, init_from=init_from)
    hparams = model_hparams(module_cls, hparams, getattr(data, "schema", None))
    # The driver's one copy of the module (a refused hyperparameter fails here): checked,
    # running its driver-side hooks, and at the end holding the trained weights to save.
    module = build_module(module_cls, hparams)
    layout.prepare(module_cls, hparams, data, module=module)
    if init_from is not None:
        _check_warm_start(module, hparams, init_from)
    resume = _Resume.find(
        module_cls, hparams, data, config, store_url, run_key, init_from, layout=layout
    )
    writers = _Loggers(loggers)
    logged = _logged_hyperparameters(module, hparams, data) if writers.loggers else None
    _warn_uncalled_hooks(module_cls, layout, own_data=isinstance(data, ModuleData))
    if hasattr(data, "prepare"):
        data.prepare()  # a DataModule's prepare_data: once, before any worker starts
    if overrides(module_cls, "prepare_data"):  # then the module's, as Trainer calls them
        module.prepare_data()
    group_cls = LocalGroup if in_process else RayWorkerGroup
    mark("driver ready")
    group = _start_group(group_cls, layout, module_cls, hparams, data, config, resume.identity())
    mark("workers connected")
    if group.adopted is not None:
        resume.adopt(*group.adopted)
    dashboard = None if in_process else dashboard_url()
    worker_logs = _worker_logs(group, [], dashboard)
    try:
        if init_from is not None and resume.checkpoint is None and resume.adopted is None:
            group.call(Worker.warm_start, init_from)
            log.info("warm start from %s", init_from)
        callbacks = Callbacks(
            module if _has_callbacks(module_cls) or callbacks else torch.nn.Module(),
            max_epochs=config.epochs,
            world_size=config.workers,
            accumulate=config.accumulate_grad_batches,
            extra=callbacks,
            loggers=writers.loggers,
        )
        layout.attach_callbacks(callbacks, group, loggers=bool(writers.loggers))
        if writers.loggers:
            writers.start(*logged)
        history = _train(group, layout, config, resume, on_epoch, callbacks, writers)
        mark("trained")
        timeline = _write_timeline(group, config, timeline_url or _trace_url(checkpoint_uri))
        state = layout.model_state(group)
        mark("weights fetched")
        environment = group.call_rank0(Worker.environment)
        events = resume.events() + group.events
        worker_logs = _worker_logs(group, worker_logs, dashboard)
    except BaseException:
        writers.finish("failed")
        group.shutdown()
        raise
    writers.finish("success")
    group.shutdown(reuse=True)  # pooled workers go back warm for the next run
    mark("workers given back")
    module.load_state_dict(state, strict=True)
    uri = save_model(
        checkpoint_uri,
        module,
        hparams=hparams,
        metrics=history[-1].metrics,
        meta={
            **run_meta(config, data),
            "environment": environment,
            **layout.meta(),
            **({"run_key": run_key} if run_key else {}),
            **(meta or {}),
        },
    )
    mark("model saved")
    return FitResult(
        checkpoint=uri,
        history=history,
        metrics=history[-1].metrics,
        state_dict=state,
        resumed_from=resume.step if resume.resumed else None,
        events=events,
        timeline=timeline,
        dashboard=dashboard,
        worker_logs=worker_logs,
    )


def _worker_logs(
    group: WorkerGroup, known: list[dict[str, Any]], dashboard: str | None
) -> list[dict[str, Any]]:
    """``known`` and the log files of the group's workers not among them, each logged: where
    a person debugging the run looks."""
    seen = {where["stdout"] for where in known}
    found = [w for w in group.call(Worker.log_files) if "stdout" in w and w["stdout"] not in seen]
    for where in found:
        log.info(
            "worker %d on %s writes its output to %s%s",
            where["rank"],
            where["node"],
            where["stdout"],
            f" (Ray dashboard: {dashboard})" if dashboard else "",
        )
    return known + found


def _trace_url(checkpoint_uri: str) -> str:
    """``timeline/trace.json`` beside the model: ``runs/{run key}/timeline`` in a workspace."""
    parent = checkpoint_uri.rstrip("/").rsplit("/", 1)[0]
    return join(parent, "timeline", "trace.json")


def _write_timeline(group: WorkerGroup, config: TrainConfig, url: str) -> TimelineSummary | None:
    """Merge the workers' timelines into one Chrome trace at ``url`` (written whole or not at
    all); its summary. A trace that cannot be written costs a warning, not the run."""
    if not config.timeline:
        return None
    clock = "cuda events" if config.gpus_per_worker else "wall clock"
    trace = chrome_trace(group.call(Worker.timeline_spans), clock=clock)
    try:
        atomic_write(url, trace_bytes(trace))
    except OSError as err:
        log.warning("the timeline could not be written to %s: %s", url, err)
        return summarize(trace)
    summary = summarize(trace, trace_url=url)
    log.info(
        "timeline of %d worker steps written to %s: %.0f%% of communication hidden behind backward",
        summary.steps,
        url,
        100 * (summary.overlap or 0.0),
    )
    return summary


def _warn_uncalled_hooks(module_cls: type, layout: Layout, *, own_data: bool = False) -> None:
    """Name the hooks the module overrides that this run will not call (never silence);
    with ``own_data``, its training and validation loaders are called."""
    if not isinstance(module_cls, type) or not issubclass(module_cls, torch.nn.Module):
        return
    import lightning as L

    if not issubclass(module_cls, L.LightningModule):
        return
    called = layout.called_hooks()
    if own_data:
        called |= {"train_dataloader", "val_dataloader"}
    uncalled = uncalled_hooks(module_cls, called=called)
    if uncalled:
        log.warning(
            "%s overrides %s, which ringflow does not call%s (docs/own-model.md lists what "
            "it calls)",
            module_cls.__name__,
            ", ".join(uncalled),
            layout.in_words,
        )


def _has_callbacks(module_cls: type) -> bool:
    """Whether the module configures callbacks (the driver then builds one to run them)."""
    import lightning as L

    own = getattr(module_cls, "configure_callbacks", None)
    return own is not None and own is not L.LightningModule.configure_callbacks


def check_layout(
    config: TrainConfig,
    pipeline: PipelineConfig | None,
    *,
    data: Any = None,
    init_from: str | None = None,
) -> Layout:
    """The run's layout, refusing, before anything starts, data or an option it would not
    honour (``Layout.refuse``).

    Raises:
        ValueError: naming every such option and why.
    """
    layout = layout_of(config, pipeline)
    layout.refuse(data=data, init_from=init_from)
    return layout


def run_meta(config: TrainConfig, data: Any) -> dict[str, Any]:
    """What a committed model records about the run that trained it (and the data's schema,
    which serving reads its requests by)."""
    return {
        "epochs": config.epochs,
        "workers": config.workers,
        "seed": config.seed,
        "batch_size": config.batch_size,
        "lr_scale": config.lr_factor(),
        "collective": config.collective,
        "train_config": dataclasses.asdict(config),
        "dataset_url": getattr(data, "dataset_url", None),
        **({"data_schema": data.schema.to_json()} if getattr(data, "schema", None) else {}),
    }


def _start_group(
    group_cls: type[WorkerGroup],
    layout: Layout,
    module_cls: type,
    hparams: dict[str, Any],
    data: Any,
    config: TrainConfig,
    run: str | None = None,
) -> WorkerGroup:
    """Start the workers (adopting those a lost driver of ``run`` left, where there are);
    a worker lost while they connect starts the group again.

    Nothing is committed yet at that point, so there is nothing to roll back to: the group is
    shut down and started afresh, up to ``config.max_failures`` times. A worker that raised
    (the module's code, or what ringflow refuses of it) fails the run at once as
    ``ModelError``: every new start would raise the same (``engine.failures``).
    """
    for attempt in range(config.max_failures + 1):
        try:
            return group_cls(
                module_cls, hparams=hparams, data=data, config=config, layout=layout, run=run
            )
        except MembershipLost as err:
            if attempt == config.max_failures:
                raise EngineError(
                    f"the workers did not start: {err} (after {attempt + 1} attempts; "
                    f"max_failures={config.max_failures})"
                ) from err
            log.warning("a worker was lost while the group started (%s); starting again", err)
    raise AssertionError("unreachable")


def _train(
    group: WorkerGroup,
    layout: Layout,
    config: TrainConfig,
    resume: _Resume,
    on_epoch: EpochCallback | None,
    callbacks: Callbacks,
    loggers: _Loggers,
) -> list[EpochMetrics]:
    """The driver loop: steps in chunks that end where a checkpoint or an epoch ends."""
    epochs = Epochs(
        group.call_rank0(Worker.train_samples), (config.batch_size,), config.accumulate_grad_batches
    )
    callbacks.trainer.count_batches(epochs.steps(0))
    epochs = resume.restore(group, epochs)
    history = list(resume.history)
    logged, seconds = resume.logged, resume.seconds
    step = resume.step
    chunks = _Chunks(config, epochs)
    group.commit(step)
    callbacks.load_state_dict(resume.callbacks)
    group.call(Worker.fit_start)
    callbacks.fit_start()
    probe = False  # after a loss, commit after one step: the new ring is proven at once
    while step < chunks.epochs.start(config.epochs) and not callbacks.should_stop:
        chunks.follow_workers(step, group.size)
        steps = chunks.at(step, probe=probe)
        epoch, first, count = steps.epoch, steps.first, steps.count
        if first == 0:
            callbacks.epoch_start(epoch)
        started = time.perf_counter()
        try:
            ended = steps.commit_at is None
            # Within an epoch the next steps follow at once, unless a checkpoint is taken
            # between (of these steps' state) or these are a probe of a new ring.
            follows = not probe and chunks.follows(steps, resume.store_url)
            then = chunks.at(step + count, probe=False) if follows else None
            chunk = _merged(
                group.train_steps(
                    epoch,
                    first,
                    count,
                    commit_at=steps.commit_at,
                    then=then,
                    then_runs_next=then is not None and chunks.follows(then, resume.store_url),
                    epochs=steps.epochs,
                )
            )
            mark("steps", to=step + count)
            layout.settle(group)  # a checkpoint whose files its workers wrote is committed
            # The epoch so far; the chunk's step rows and callbacks' rows go to the loggers now.
            so_far = logged.merge(dataclasses.replace(chunk, steps={}, rows=[]))
            if ended:
                validation = _merged(group.call(Worker.evaluate, "validation"))
                mark("validated")
                so_far = so_far.merge(_merged(group.call(Worker.train_epoch_end, epoch)))
                metrics = {**so_far.results(), **validation.results()}
                group.call(Worker.end_epoch, epoch, metrics)  # schedulers waiting for the metrics
                group.commit(step + count)
                mark("epoch ended", epoch=epoch)
        except MembershipLost as lost:
            # The members are back at the commit of ``step``, nothing of this chunk kept, or
            # they went on from the step that failed, keeping the steps before it.
            recovery = group.recover(lost, at_step=step + count)
            if recovery.logged is not None:
                logged = logged.merge(dataclasses.replace(recovery.logged, steps={}, rows=[]))
                _write_rows(loggers, recovery.logged, epoch)
                seconds += time.perf_counter() - started
            step, probe = recovery.step, True
            continue
        step += count
        probe = False
        seconds += time.perf_counter() - started
        _write_rows(loggers, chunk, epoch)
        logged = so_far
        if ended:
            last = chunks.epochs.optimizer_start(epoch + 1) - 1  # Trainer's step for epoch-end rows
            validation_steps, validation_row = logger_rows(validation, epoch_end=True)
            for at, row in validation_steps.items():  # at each batch's index, as Trainer's
                loggers.write(row, step=at, epoch=None)
            epoch_row = logger_rows(logged, epoch_end=True)[1]
            loggers.write(validation_row, step=last, epoch=epoch)
            loggers.write(epoch_row, step=last, epoch=epoch)
            batch = chunks.epochs.batch(epoch)
            history.append(
                EpochMetrics(epoch=epoch, metrics=metrics, seconds=seconds, batch_size=batch)
            )
            progress.info("epoch %d/%d %s", epoch + 1, config.epochs, _fmt(metrics))
            callback_metrics = {**metrics, **validation_row, **epoch_row}
            logged, seconds = Logged(), 0.0
            if on_epoch is not None:
                on_epoch(history[-1])
            # EarlyStopping may stop the run here
            callbacks.epoch_end(epoch, last + 1, callback_metrics)
        step = _committed(group, layout, resume, chunks, step, history, logged, seconds, callbacks)
    if resume.store_url is not None:
        for error in layout.flush(group):
            log.warning("a checkpoint of run %s was not saved: %s", resume.run_key, error)
    group.call(Worker.fit_end, chunks.epochs.locate(step)[0])
    callbacks.fit_end()
    return history


def _committed(
    group: WorkerGroup,
    layout: Layout,
    resume: _Resume,
    chunks: _Chunks,
    step: int,
    history: list[EpochMetrics],
    logged: Logged,
    seconds: float,
    callbacks: Callbacks,
) -> int:
    """After the commit of ``step``: the driver's state kept beside it (a driver that adopts
    the workers goes on from there), and the checkpoint due there taken; the step training
    goes on from."""
    checkpoint = bool(resume.store_url and chunks.checkpoint_due(step))
    if not (checkpoint or group.remembers):
        return step
    meta = resume.metadata(step, chunks.epochs, history, logged, seconds)
    meta["callbacks"] = callbacks.state_dict()
    group.remember(step, meta)
    if checkpoint:
        return _checkpoint(group, layout, resume, step, meta, history)
    return step


def _write_rows(loggers: _Loggers, chunk: Logged, epoch: int) -> None:
    """The rows of a chunk's steps to the loggers: callbacks' rows (LearningRateMonitor's,
    at a batch's start) before the step's own."""
    rows = [(at, 0, row) for at, row in chunk.rows]
    rows += [(at, 1, row) for at, row in logger_rows(chunk, epoch_end=False)[0].items()]
    for at, own, row in sorted(rows, key=lambda entry: entry[:2]):
        loggers.write(row, step=at, epoch=epoch if own else None)


def _merged(parts: list[Logged]) -> Logged:
    """The workers' records of the same steps as one (``engine.metrics``)."""
    merged = Logged()
    for part in parts:
        merged = merged.merge(part)
    return merged


class _Loggers:
    """Lightning loggers (``CSVLogger``, ``TensorBoardLogger``, ``MLFlowLogger``, ...) written
    by the driver, the one process that holds every worker's values (Trainer's rank 0)."""

    def __init__(self, loggers: Any) -> None:
        if loggers is None:
            loggers = []
        self.loggers = list(loggers) if isinstance(loggers, list | tuple) else [loggers]
        for logger in self.loggers:
            if not callable(getattr(logger, "log_metrics", None)):
                raise ValueError(
                    f"loggers: {logger!r} is not a Lightning logger (it has no log_metrics); "
                    "pass lightning.pytorch.loggers objects such as CSVLogger"
                )

    def start(self, hparams: dict[str, Any] | None, module: torch.nn.Module) -> None:
        for logger in self.loggers:
            if hparams is not None:
                logger.log_hyperparams(hparams)
            logger.log_graph(module)
            logger.save()

    def write(self, row: dict[str, float], *, step: int, epoch: int | None) -> None:
        """``row`` at ``step``; with ``epoch``, the row has it too (Trainer adds it to what
        the module logs, not to what callbacks log to the loggers themselves)."""
        if not row:
            return
        for logger in self.loggers:
            logger.log_metrics(row if epoch is None else {**row, "epoch": epoch}, step=step)
            logger.save()

    def finish(self, status: str) -> None:
        for logger in self.loggers:
            logger.finalize(status)


def _logged_hyperparameters(
    module: torch.nn.Module, hparams: dict[str, Any], data: Any
) -> tuple[dict[str, Any] | None, torch.nn.Module]:
    """What Trainer hands its loggers at the start (``hparams.yaml``): the hyperparameters
    the module saved (``save_hyperparameters``) and its DataModule's, merged, and the
    module for ``log_graph``; a module that is not a LightningModule, the ``hparams``."""
    if not hasattr(module, "hparams_initial"):
        return dict(hparams), module
    datamodule = getattr(data, "datamodule", None)
    saved = [
        dict(source.hparams_initial)
        for source in (module, datamodule)
        if source is not None and getattr(source, "_log_hyperparams", False)
    ]
    if not saved:
        return None, module
    merged: dict[str, Any] = {}
    for part in saved:
        clash = [k for k in part if k in merged and merged[k] != part[k]]
        if clash:
            raise ModelError(
                f"the keys {clash} are in both the module's and the DataModule's saved "
                "hyperparameters, with different values: rename one, as Trainer asks"
            )
        merged.update(part)
    return merged, module


@dataclass
class _Chunks:
    """Where the driver's chunks of steps end: at commits, checkpoints and epoch ends. With
    gradient accumulation, windows of ``accumulate_grad_batches`` batches start at every
    epoch's start (as under Lightning), and commits and checkpoints count from there, so a
    chunk never ends inside a window."""

    config: TrainConfig
    epochs: Epochs

    def follow_workers(self, step: int, workers: int) -> None:
        """At an epoch's start, where the global batch follows the workers
        (``TrainConfig.batch_follows_workers``): the batch per worker times the ``workers``
        training now. Decided again after a rollback to the epoch's start."""
        if not self.config.batch_follows_workers:
            return
        epoch, first = self.epochs.locate(step)
        batch = self.config.per_worker_batch_size * workers
        if first or batch == self.epochs.batch(epoch):
            return
        log.warning(
            "epoch %d: global batch %d (%d workers x %d), learning rates x %.4g",
            epoch + 1,
            batch,
            workers,
            self.config.per_worker_batch_size,
            self.config.lr_factor(batch),
        )
        self.epochs = self.epochs.decided(epoch, batch)

    def _since(self, step: int) -> int:
        """Steps since the origin commits count from: the run's start, or the epoch's."""
        return self.epochs.locate(step)[1] if self.config.accumulate_grad_batches > 1 else step

    def size(self, step: int, *, probe: bool) -> int:
        """Steps in the chunk starting at ``step`` (``probe``: the shortest one possible)."""
        epoch, first = self.epochs.locate(step)
        window = self.config.accumulate_grad_batches
        rest = self.epochs.steps(epoch) - first
        if probe:
            return min(rest, window - first % window)
        since = self._since(step)
        bounds = [self.config.commit_every]
        if self.config.checkpoint_every:
            bounds.append(self.config.checkpoint_every)
        return min([b - since % b for b in bounds] + [rest])

    def at(self, step: int, *, probe: bool) -> Steps:
        """The chunk starting at ``step``. Mid-epoch its workers commit where it ends; at an
        epoch's end the commit comes after the epoch's validation and schedulers' epoch step
        (``commit_at`` is ``None``)."""
        count = self.size(step, probe=probe)
        epoch, first = self.epochs.locate(step)
        end = step + count
        commit_at = None if first + count == self.epochs.steps(epoch) else end
        plan = self.epochs if self.config.batch_follows_workers else None
        return Steps(epoch, first, count, commit_at, plan)

    def follows(self, steps: Steps, store_url: str | None) -> bool:
        """Whether the chunk after ``steps`` follows it at once: ``steps`` end inside an
        epoch, and no checkpoint (with a store) is taken where they end."""
        end = steps.commit_at
        return end is not None and not (store_url and self.checkpoint_due(end))

    def checkpoint_due(self, step: int) -> bool:
        """A checkpoint is taken at every epoch's end, and every ``checkpoint_every`` steps."""
        every = self.config.checkpoint_every
        return self.epochs.locate(step)[1] == 0 or bool(every and self._since(step) % every == 0)


def _checkpoint(
    group: WorkerGroup,
    layout: Layout,
    resume: _Resume,
    step: int,
    metadata: dict[str, Any],
    history: list[EpochMetrics],
) -> int:
    """Checkpoint ``step`` as the layout does (data parallel: queued on rank 0)."""
    log.info("checkpoint of step %d of run %s: saving", step, resume.run_key)
    try:
        layout.checkpoint(
            group,
            resume.store_url,
            resume.run_key,
            step=step,
            metadata=metadata,
            metrics=history[-1].metrics if history else {},
        )
    except MembershipLost as lost:  # rank 0 went: the next checkpoint is taken as usual
        return group.recover(lost, at_step=step).step
    return step


def resumed_events(
    run_key: str | None, checkpoint: CommittedCheckpoint | None
) -> list[ElasticEvent]:
    """The ``resumed`` event of a run that started from ``checkpoint`` (none without one)."""
    if checkpoint is None:
        return []
    cause = f"run {run_key} resumed from its checkpoint at {checkpoint.url}"
    return [ElasticEvent(kind="resumed", step=checkpoint.step, workers=0, cause=cause)]


def find_checkpoint(
    module_cls: type,
    hparams: dict[str, Any],
    config: TrainConfig,
    store_url: str,
    run_key: str | None,
    **identity: Any,
) -> tuple[CheckpointStore, dict[str, Any], CommittedCheckpoint | None]:
    """Check the store is writable; return it, the run's fingerprint and the run's newest
    committed checkpoint (``None`` for a new run).

    The fingerprint (module, hyperparameters, seed, global batch and ``identity``) is kept
    in every checkpoint's metadata: a run key reused for another configuration is refused
    rather than resumed into it.

    Raises:
        ValueError: no ``run_key``, or its checkpoint was written with another fingerprint.
    """
    if not run_key:
        raise ValueError("store_url needs a run_key: the name checkpoints are kept under")
    store = CheckpointStore(store_url)
    store.check_writable()  # a wrong URL fails now, not after an hour of training
    fingerprint = {
        "module": f"{module_cls.__module__}.{module_cls.__qualname__}",
        "hparams": json.loads(json.dumps(hparams)),
        "seed": config.seed,
        "batch_size": config.batch_size,
        **identity,
        # another rule would go on with other learning rates
        **(
            {"lr_scaling": [config.lr_scaling, config.reference_batch, config.lr_warmup_steps]}
            if config.lr_scaling != "none"
            else {}
        ),
    }
    latest = store.latest(run_key)
    if latest is not None and latest.metadata.get("fingerprint") != fingerprint:
        raise ValueError(
            f"run {run_key!r} has a checkpoint at {latest.url} written with "
            f"{latest.metadata.get('fingerprint')}, which differs from this run's "
            f"{fingerprint}; use a new run key to start afresh"
        )
    return store, fingerprint, latest


@dataclass(kw_only=True)
class _Resume:
    """Where a run starts: step 0, or the newest committed checkpoint of its run key."""

    store_url: str | None = None
    run_key: str | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    checkpoint: CommittedCheckpoint | None = None
    step: int = 0
    history: list[EpochMetrics] = field(default_factory=list)
    callbacks: dict[str, Any] = field(default_factory=dict)
    """The callbacks' states at the checkpoint (``engine.callbacks``)."""
    logged: Logged = field(default_factory=Logged)
    """What the module logged in the epoch so far (``engine.metrics``)."""
    seconds: float = 0.0
    _history: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """The history's entries as checkpoints record them, each made once (``metadata``)."""
    _planned: Epochs | None = field(default=None, repr=False)
    """The epochs at the configured global batch (:meth:`restore`)."""
    config: TrainConfig | None = None
    adopted: int | None = None
    """The step of the commit that workers a lost driver left went on from (:meth:`adopt`)."""
    _recorded: dict[str, Any] = field(default_factory=dict, repr=False)
    """The metadata of where the run goes on from: its checkpoint's, or the adopted
    workers' driver state."""

    @classmethod
    def find(
        cls,
        module_cls: type,
        hparams: dict[str, Any],
        data: DataSpec,
        config: TrainConfig,
        store_url: str | None,
        run_key: str | None,
        init_from: str | None = None,
        *,
        layout: Layout,
    ) -> _Resume:
        """Check the store is writable and read its newest checkpoint of ``run_key``."""
        if store_url is None:
            return cls()
        store, fingerprint, latest = find_checkpoint(
            module_cls,
            hparams,
            config,
            store_url,
            run_key,
            dataset_url=getattr(data, "dataset_url", None)
            or (data.identity() if hasattr(data, "identity") else "tensors"),
            **({"init_from": init_from} if init_from else {}),
            **layout.identity(),
        )
        resume = cls(store_url=store.url, run_key=run_key, fingerprint=fingerprint, config=config)
        if latest is None:
            return resume
        resume.checkpoint = latest
        resume._go_on_from(latest.step, latest.metadata)
        return resume

    def _go_on_from(self, step: int, recorded: dict[str, Any]) -> None:
        self.step, self._recorded = step, recorded
        self.history = [EpochMetrics(**entry) for entry in recorded["history"]]
        self.callbacks = recorded.get("callbacks", {})
        self.logged = Logged.from_json(recorded["epoch_logged"])
        self.seconds = float(recorded["epoch_seconds"])

    def identity(self) -> str | None:
        """The run's state by its key and whole configuration: what a driver restarted
        under the same run key must share with the lost one to adopt its workers."""
        if self.store_url is None or self.config is None:
            return None
        text = json.dumps(
            [self.store_url, self.run_key, self.fingerprint, dataclasses.asdict(self.config)],
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def adopt(self, step: int, state: dict[str, Any]) -> None:
        """Go on from the adopted workers' commit of ``step`` (``state``: the lost driver's
        there, as a checkpoint records it) where it is newer than the checkpoint."""
        if step < self.step:
            return
        self.adopted = step
        self._go_on_from(step, state)

    @property
    def resumed(self) -> bool:
        return self.checkpoint is not None or self.adopted is not None

    def events(self) -> list[ElasticEvent]:
        if self.adopted is not None:
            cause = (
                f"run {self.run_key} went on from the in-memory commit its lost driver's "
                f"workers held at step {self.adopted}"
            )
            return [ElasticEvent(kind="resumed", step=self.adopted, workers=0, cause=cause)]
        return resumed_events(self.run_key, self.checkpoint)

    def restore(self, group: WorkerGroup, epochs: Epochs) -> Epochs:
        """Load the checkpoint (if any) into every worker; the run's epochs as it recorded
        them (each epoch's global batch, where it follows the workers)."""
        self.check_layout(epochs.steps(0))
        self._planned = epochs
        if not self.resumed:
            return epochs
        recorded = self._recorded.get("epoch_batches")
        if recorded:
            epochs = Epochs(epochs.samples, tuple(recorded), epochs.accumulate)
        if self.adopted is not None:
            group.call(Worker.rollback, self.adopted)
            log.info("run %s goes on from its workers' commit of step %d", self.run_key, self.step)
            return epochs
        group.call(Worker.restore, self.store_url, self.checkpoint)
        epoch, first = epochs.locate(self.step)
        log.info(
            "run %s resumes from step %d (epoch %d, step %d of %d) at %s",
            self.run_key,
            self.step,
            epoch + 1,
            first,
            epochs.steps(epoch),
            self.checkpoint.url,
        )
        return epochs

    def check_layout(self, steps_per_epoch: int) -> None:
        if self.resumed and self._recorded["steps_per_epoch"] != steps_per_epoch:
            where = self.checkpoint.url if self.adopted is None else "its workers' commit"
            raise ValueError(
                f"{where} was written with {self._recorded['steps_per_epoch']} steps per "
                f"epoch, this run has {steps_per_epoch}: the dataset changed; use a new run key"
            )

    def metadata(
        self,
        step: int,
        epochs: Epochs,
        history: list[EpochMetrics],
        logged: Logged,
        seconds: float,
    ) -> dict[str, Any]:
        """What a resumed driver needs besides the tensors: position and metrics so far.

        Every checkpoint records the whole history; each epoch's entry is made once, or a
        long run checkpointing often would spend longer on it with every epoch."""
        made = self._history  # the driver's history only grows
        made.extend(dataclasses.asdict(entry) for entry in history[len(made) :])
        epoch, first = epochs.locate(step)
        return {
            "fingerprint": self.fingerprint,
            "epoch": epoch,
            "step_in_epoch": first,
            "steps_per_epoch": self._planned.steps(0),  # at the configured global batch
            **(
                {"epoch_batches": list(epochs.batches)}
                if epochs.batches != self._planned.batches
                else {}
            ),
            "history": list(made),
            "epoch_logged": logged.to_json(),
            "epoch_seconds": seconds,
        }


def evaluate(
    model_uri: str,
    data: DataSpec | None,
    *,
    model: Allowed,
    split: str = "test",
    batch_size: int = 512,
) -> dict[str, float]:
    """Load the committed model at ``model_uri`` and evaluate it on ``split`` in this process.

    ``model`` is the class (or classes) the checkpoint may hold, or their import paths, from
    the caller's configuration: a checkpoint naming another class is refused before anything is
    imported (``storage.checkpoint.ModelClassRefused``). ``data=None``: the module's own
    loaders, its test split or else its validation split (``ModuleData.evaluation_split``,
    after its ``setup`` as Trainer calls it); no metrics where it has neither."""
    module, _ = load_model(model_uri, allowed=model)
    if data is None:
        own = ModuleData(type(module))
        split = own.evaluation_split()
        if split is None:
            return {}
        call_hook(module, "setup", "test" if split == "test" else "validate")
        data = own.bind(module, batch_size)
    logged = evaluate_module(module, samples_of(data, split), split=split, batch_size=batch_size)
    return logged.results()


def _check_warm_start(module: torch.nn.Module, hparams: dict[str, Any], init_from: str) -> None:
    """The warm-start model must have this run's tensors, names and shapes (a lazy layer's
    shapes are checked by the workers, which materialise it from the data)."""
    saved = read_checkpoint(init_from).state_dict
    check_warm_start(f"{type(module).__name__}({hparams})", saved, module.state_dict(), init_from)


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
