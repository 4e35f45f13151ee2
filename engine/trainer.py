"""``fit``: the one driver that trains a LightningModule on Ray workers, whatever the layout
(data parallel, or pipeline stages: ``engine.layout``)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ringflow.engine.callbacks import Callbacks
from ringflow.engine.config import DataSpec, TrainConfig
from ringflow.engine.controller import Controller, EpochCallback, EpochMetrics, trace_url
from ringflow.engine.data import ModuleData, as_data, samples_of
from ringflow.engine.elastic.coordinator import ElasticEvent
from ringflow.engine.epochs import Epochs
from ringflow.engine.errors import ModelError
from ringflow.engine.group import Adopted, LocalGroup, RayWorkerGroup, WorkerGroup
from ringflow.engine.layout import Layout, layout_of
from ringflow.engine.metrics import Logged
from ringflow.engine.module import call_hook, overrides, uncalled_hooks
from ringflow.engine.phases import mark
from ringflow.engine.spec import build_module, check_warm_start, model_hparams
from ringflow.engine.timeline import TimelineSummary
from ringflow.engine.worker import Worker, evaluate_module
from ringflow.storage.checkpoint import Allowed, load_model, read_checkpoint, save_model
from ringflow.storage.store import CheckpointStore, CommittedCheckpoint

if TYPE_CHECKING:
    from ringflow.engine.pipeline.config import PipelineConfig

__all__ = ["EpochMetrics", "FitResult", "check_layout", "evaluate", "fit"]

log = logging.getLogger("ringflow.engine")


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
    find_resume = functools.partial(
        _Resume.find, module_cls, hparams, data, config, store_url, run_key, init_from
    )
    resume = find_resume(layout=layout)
    writers = _Loggers(loggers)
    logged = _logged_hyperparameters(module, hparams, data) if writers.loggers else None
    _warn_uncalled_hooks(module_cls, layout, own_data=isinstance(data, ModuleData))
    if hasattr(data, "prepare"):
        data.prepare()  # a DataModule's prepare_data: once, before any worker starts
    if overrides(module_cls, "prepare_data"):  # then the module's, as Trainer calls them
        module.prepare_data()
    group_cls = LocalGroup if in_process else RayWorkerGroup
    callbacks = Callbacks(
        module if _has_callbacks(module_cls) or callbacks else torch.nn.Module(),
        max_epochs=config.epochs,
        world_size=config.workers,
        accumulate=config.accumulate_grad_batches,
        extra=callbacks,
        loggers=writers.loggers,
    )
    mark("driver ready")
    trained = Controller(
        start=functools.partial(
            group_cls, module_cls, hparams=hparams, data=data, config=config, layout=layout
        ),
        resume=resume,
        find_resume=functools.partial(find_resume, layout=layout),
        layout=layout,
        config=config,
        callbacks=callbacks,
        loggers=writers,
        logged_hparams=logged,
        init_from=init_from,
        on_epoch=on_epoch,
        timeline_url=timeline_url or trace_url(checkpoint_uri),
        on_ray=not in_process,
    ).run()
    history, state = trained.history, trained.state
    module.load_state_dict(state, strict=True)
    uri = save_model(
        checkpoint_uri,
        module,
        hparams=hparams,
        metrics=history[-1].metrics,
        meta={
            **run_meta(config, data),
            "environment": trained.environment,
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
        resumed_from=trained.resumed_from,
        events=trained.events,
        timeline=trained.timeline,
        dashboard=trained.dashboard,
        worker_logs=trained.worker_logs,
    )


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
    unwritten: list[tuple[int, Logged]] = field(default_factory=list)
    """What the adopted workers' calls of steps logged that their lost driver never wrote
    to the loggers, with where each started."""
    _as_it_is: bool = False
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

    def adopt(self, adopted: Adopted) -> None:
        """Go on from the adopted workers' commit (``engine.group.Adopted``: the lost
        driver's state at it or before it, as a checkpoint records it, and what the calls of
        steps since logged) where it is newer than the checkpoint."""
        if adopted.step < self.step:
            return
        self.adopted, self._as_it_is = adopted.step, adopted.as_it_is
        self._go_on_from(adopted.step, adopted.state)
        for _, chunk in adopted.chunks:  # their step rows go to the loggers (``unwritten``)
            self.logged = self.logged.merge(dataclasses.replace(chunk, steps={}, rows=[]))
        self.unwritten = adopted.chunks

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
            group.call(Worker.go_on_from, self.adopted, as_it_is=self._as_it_is)
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
