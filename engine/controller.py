"""The driver of a run as named states, over a worker group (``engine.group``):

    starting -> running <-> recovering -> finishing -> done

- **starting**: lease or start the workers (adopting those a lost driver of the run left),
  warm-start or restore them, make the first commit and call the fit-start hooks;
- **running**: one chunk of steps (to the next commit, checkpoint or epoch end), and at an
  epoch's end its validation, loggers' rows, ``on_epoch`` and callbacks;
- **recovering**: the worker group carries out its membership's decision on a lost worker
  (``engine.elastic.membership``), and training goes on from the step it names;
- **finishing**: pending checkpoints, the fit-end hooks, the timeline, the whole model.

Every failure met on the way is decided once, by ``engine.failures.decide``: a lost worker
while starting starts the group again and while running recovers, both within
``config.max_failures``; the module's code fails the run at once as ``ModelError``;
anything else ends it as the one-line error it is, never as a Ray exception. The controller
never asks which layout it runs: the layout (``engine.layout``) and its membership do.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ringflow.engine.cluster import dashboard_url
from ringflow.engine.config import TrainConfig
from ringflow.engine.epochs import Epochs
from ringflow.engine.errors import MembershipLost
from ringflow.engine.failures import Decision, decide
from ringflow.engine.group import Steps, WorkerGroup
from ringflow.engine.layout import Layout
from ringflow.engine.metrics import Logged, logger_rows
from ringflow.engine.phases import mark
from ringflow.engine.timeline import TimelineSummary, chrome_trace, summarize, trace_bytes
from ringflow.engine.worker import Worker
from ringflow.storage.fs import atomic_write, join

if TYPE_CHECKING:
    from ringflow.engine.callbacks import Callbacks

__all__ = ["Controller", "EpochMetrics", "State", "Trained"]

log = logging.getLogger("ringflow.engine")
progress = logging.getLogger("ringflow.engine.progress")
"""Epoch lines: a caller with a display of its own (the flow's progress bar) may leave them."""


@dataclass(frozen=True, kw_only=True)
class EpochMetrics:
    """Metrics of one epoch, averaged over every sample of every worker."""

    epoch: int
    metrics: dict[str, float]
    seconds: float
    batch_size: int | None = None
    """The global batch it trained at (under weak scaling with elastic workers, the batch
    per worker times the workers that started it)."""


EpochCallback = Callable[[EpochMetrics], None]


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    ENDING_EPOCH = "ending an epoch"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    DONE = "done"


@dataclass(frozen=True, kw_only=True)
class Trained:
    """What a finished run hands back to ``fit``, which saves the model."""

    history: list[EpochMetrics]
    resumed_from: int | None
    """The step the run went on from (a checkpoint, or adopted workers' commit)."""
    state: dict[str, torch.Tensor]
    environment: dict[str, Any]
    events: list[Any]
    timeline: TimelineSummary | None
    dashboard: str | None
    worker_logs: list[dict[str, Any]]


@dataclass
class _Ending:
    """An epoch whose last steps ran (from ``step``), its end to come: what the epoch had
    logged and taken before those steps (kept where a loss takes the run back before them),
    and what they logged (``None`` where workers a lost driver left had run them)."""

    epoch: int
    step: int
    logged: Logged
    seconds: float
    chunk: Logged | None


@dataclass
class _Lost:
    """A loss the recovering state carries out: where it struck, and the chunk's epoch and
    start (what the survivors logged before it goes to that epoch's rows)."""

    lost: MembershipLost
    at_step: int
    epoch: int
    started: float


class Controller:
    """One run's driver; :meth:`run` goes through the states in the module docstring.

    ``start`` starts the worker group (``engine.group``), given the run's identity (``run``:
    whose workers a lost driver left, to adopt); ``resume`` is
    where the run starts (``engine.trainer._Resume``), found again by ``find_resume`` for
    each new start (adopted workers lost while starting leave nothing to go on from);
    ``callbacks`` and ``loggers`` are the driver's (``engine.callbacks``,
    ``engine.trainer._Loggers``).
    """

    def __init__(
        self,
        *,
        start: Callable[..., WorkerGroup],
        resume: Any,
        find_resume: Callable[[], Any],
        layout: Layout,
        config: TrainConfig,
        callbacks: Callbacks,
        loggers: Any,
        logged_hparams: tuple[Any, Any] | None,
        init_from: str | None,
        on_epoch: EpochCallback | None,
        timeline_url: str,
        on_ray: bool,
    ) -> None:
        self._start, self._find_resume = start, find_resume
        self.layout, self.config = layout, config
        self.callbacks, self.loggers = callbacks, loggers
        self._logged_hparams = logged_hparams
        self._init_from, self._on_epoch = init_from, on_epoch
        self._timeline_url, self._on_ray = timeline_url, on_ray
        self.state = State.STARTING
        self.group: WorkerGroup | None = None
        self.resume = resume
        self.history: list[EpochMetrics] = []
        self.logged, self.seconds = Logged(), 0.0
        self.step, self.probe = 0, False
        """Where training is, and whether the next chunk is one step (after a loss: the new
        ring is proven at once)."""
        self._starts = 0
        self._lost: _Lost | None = None
        self._ending: _Ending | None = None
        self._chunks: _Chunks | None = None
        self._dashboard: str | None = None
        self._worker_logs: list[dict[str, Any]] = []
        self._trained: Trained | None = None

    def run(self) -> Trained:
        """Train to the end; the group's workers go back to the pool warm where it ended well.

        Raises:
            ModelError: the module's code raised (naming the hook).
            EngineError: the workers could not start, the failure budget is spent, or
                anything else ended the run (one line).
        """
        states = {
            State.STARTING: self._starting,
            State.RUNNING: self._running,
            State.ENDING_EPOCH: self._ending_epoch,
            State.RECOVERING: self._recovering,
            State.FINISHING: self._finishing,
        }
        try:
            while self.state is not State.DONE:
                self.state = states[self.state]()
        except BaseException as err:
            self.loggers.finish("failed")
            if self.group is not None:
                self.group.shutdown()
            decision = decide(err, while_=self.state.value)
            if decision.error is not err:
                raise decision.error from err
            raise
        self.loggers.finish("success")
        self.group.shutdown(reuse=True)  # pooled workers go back warm for the next run
        mark("workers given back")
        return self._trained

    # --------------------------------------------------------------------------- states

    def _starting(self) -> State:
        """Start the workers and bring them to where the run starts; a worker lost on the
        way starts them again (nothing is committed yet), within ``max_failures``."""
        if self._starts:
            self.resume = self._find_resume()
        resume = self.resume
        try:
            self.group = group = self._start(run=resume.identity())
            mark("workers connected")
            if group.adopted is not None:
                resume.adopt(group.adopted)
            self._dashboard = dashboard_url() if self._on_ray else None
            self._worker_logs = _worker_logs(group, [], self._dashboard)
            if self._init_from is not None and not resume.resumed:
                group.call(Worker.warm_start, self._init_from)
                log.info("warm start from %s", self._init_from)
            self.layout.attach_callbacks(self.callbacks, group, loggers=bool(self.loggers.loggers))
            epochs = Epochs(
                group.call_rank0(Worker.train_samples),
                (self.config.batch_size,),
                self.config.accumulate_grad_batches,
            )
            self.callbacks.trainer.count_batches(epochs.steps(0))
            self._chunks = _Chunks(self.config, resume.restore(group, epochs))
            group.commit(resume.step)
            self.callbacks.load_state_dict(resume.callbacks)
            group.call(Worker.fit_start)
        except MembershipLost as lost:
            return self._start_again(lost)
        self.history = list(resume.history)
        self.logged, self.seconds, self.step = resume.logged, resume.seconds, resume.step
        if self._logged_hparams is not None:
            self.loggers.start(*self._logged_hparams)
        for start, chunk in resume.unwritten:  # trained by adopted workers, never written
            _write_rows(self.loggers, chunk, self._chunks.epochs.locate(start)[0])
        self.callbacks.fit_start()
        epoch, first = self._chunks.epochs.locate(self.step)
        if first == 0 and len(self.history) < epoch:  # adopted where an epoch's steps ended
            self._ending = _Ending(epoch - 1, self.step, self.logged, self.seconds, None)
            return State.ENDING_EPOCH
        return State.RUNNING

    def _start_again(self, lost: MembershipLost) -> State:
        decision = decide(
            lost, while_="starting", attempt=self._starts, max_failures=self.config.max_failures
        )
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if decision.action is not Decision.RESTART:
            raise decision.error from lost
        self._starts += 1
        log.warning("a worker was lost while the group started (%s); starting again", lost)
        return State.STARTING

    def _running(self) -> State:
        """One chunk of steps; the epoch's end next where it ends one."""
        group, config, chunks = self.group, self.config, self._chunks
        if self.step >= chunks.epochs.start(config.epochs) or self.callbacks.should_stop:
            return State.FINISHING
        chunks.follow_workers(self.step, group.size)
        steps = chunks.at(self.step, probe=self.probe)
        epoch, first, count = steps.epoch, steps.first, steps.count
        if first == 0:
            self.callbacks.epoch_start(epoch)
        started = time.perf_counter()
        try:
            # Within an epoch the next steps follow at once, unless a checkpoint is taken
            # between (of these steps' state) or these are a probe of a new ring.
            store_url = self.resume.store_url
            follows = not self.probe and chunks.follows(steps, store_url)
            then = chunks.at(self.step + count, probe=False) if follows else None
            chunk = _merged(
                group.train_steps(
                    epoch,
                    first,
                    count,
                    commit_at=steps.commit_at,
                    then=then,
                    then_runs_next=then is not None and chunks.follows(then, store_url),
                    epochs=steps.epochs,
                )
            )
            mark("steps", to=self.step + count)
            self.layout.settle(group)  # a checkpoint whose files its workers wrote is committed
        except MembershipLost as lost:
            # The members go back to the commit of ``step``, nothing of this chunk kept, or
            # on from the step that failed, keeping the steps before it.
            return self._recover(lost, at_step=self.step + count, epoch=epoch, started=started)
        self.probe = False
        if steps.commit_at is None:  # the epoch's last steps: its end decides what is kept
            self._ending = _Ending(epoch, self.step, self.logged, self.seconds, chunk)
        else:
            _write_rows(self.loggers, chunk, epoch)
        self.step += count
        self.seconds += time.perf_counter() - started
        # The epoch so far; the chunk's step rows and callbacks' rows went to the loggers.
        self.logged = self.logged.merge(dataclasses.replace(chunk, steps={}, rows=[]))
        return State.ENDING_EPOCH if self._ending is not None else self._committed(epoch)

    def _ending_epoch(self) -> State:
        """The end of the epoch whose last steps ran: its validation, the module's and the
        schedulers' epoch-end steps and the commit; then its rows, history entry and
        callbacks. A worker lost meanwhile takes the run back to the last commit."""
        group, ending = self.group, self._ending
        epoch, started = ending.epoch, time.perf_counter()
        try:
            validation = _merged(group.call(Worker.evaluate, "validation"))
            mark("validated")
            so_far = self.logged.merge(_merged(group.call(Worker.train_epoch_end, epoch)))
            metrics = {**so_far.results(), **validation.results()}
            group.call(Worker.end_epoch, epoch, metrics)  # schedulers waiting for the metrics
            group.commit(self.step)
            mark("epoch ended", epoch=epoch)
        except MembershipLost as lost:
            return self._recover(lost, at_step=self.step, epoch=epoch, started=started)
        self._ending = None
        if ending.chunk is not None:
            _write_rows(self.loggers, ending.chunk, epoch)
        self.seconds += time.perf_counter() - started
        self.logged = so_far
        self._end_epoch(epoch, validation, metrics)
        return self._committed(epoch)

    def _end_epoch(self, epoch: int, validation: Logged, metrics: dict[str, float]) -> None:
        """The epoch's rows to the loggers, its entry in the history, ``on_epoch`` and the
        callbacks' epoch end (``EarlyStopping`` may stop the run here)."""
        epochs = self._chunks.epochs
        last = epochs.optimizer_start(epoch + 1) - 1  # Trainer's step for epoch-end rows
        validation_steps, validation_row = logger_rows(validation, epoch_end=True)
        for at, row in validation_steps.items():  # at each batch's index, as Trainer's
            self.loggers.write(row, step=at, epoch=None)
        epoch_row = logger_rows(self.logged, epoch_end=True)[1]
        self.loggers.write(validation_row, step=last, epoch=epoch)
        self.loggers.write(epoch_row, step=last, epoch=epoch)
        entry = EpochMetrics(
            epoch=epoch, metrics=metrics, seconds=self.seconds, batch_size=epochs.batch(epoch)
        )
        self.history.append(entry)
        progress.info("epoch %d/%d %s", epoch + 1, self.config.epochs, _fmt(metrics))
        self.logged, self.seconds = Logged(), 0.0
        if self._on_epoch is not None:
            self._on_epoch(entry)
        self.callbacks.epoch_end(epoch, last + 1, {**metrics, **validation_row, **epoch_row})

    def _committed(self, epoch: int) -> State:
        """After the commit of ``step``: the driver's state kept beside it (a driver that
        adopts the workers goes on from there), and the checkpoint due there taken."""
        group, resume, step = self.group, self.resume, self.step
        checkpoint = bool(resume.store_url and self._chunks.checkpoint_due(step))
        if not (checkpoint or group.remembers):
            return State.RUNNING
        meta = resume.metadata(step, self._chunks.epochs, self.history, self.logged, self.seconds)
        meta["callbacks"] = self.callbacks.state_dict()
        group.remember(step, meta)
        if not checkpoint:
            return State.RUNNING
        log.info("checkpoint of step %d of run %s: saving", step, resume.run_key)
        try:
            self.layout.checkpoint(
                group,
                resume.store_url,
                resume.run_key,
                step=step,
                metadata=meta,
                metrics=self.history[-1].metrics if self.history else {},
            )
        except MembershipLost as lost:  # rank 0 went: the next checkpoint is taken as usual
            return self._recover(lost, at_step=step, epoch=epoch, started=time.perf_counter())
        return State.RUNNING

    def _recover(self, lost: MembershipLost, *, at_step: int, epoch: int, started: float) -> State:
        self._lost = _Lost(lost, at_step, epoch, started)
        return State.RECOVERING

    def _recovering(self) -> State:
        """The group's membership decides (``engine.elastic.membership``); training goes on
        from the step it names, or the run ends with why."""
        lost, self._lost = self._lost, None
        recovery = self.group.recover(lost.lost, at_step=lost.at_step)
        ending, self._ending = self._ending, None
        if ending is not None and recovery.step == self.step:
            self._ending = ending  # back at the epoch's last steps: its end again
            return State.ENDING_EPOCH
        if ending is not None:  # back before the epoch's last steps: what they logged goes
            self.logged, self.seconds = ending.logged, ending.seconds
        if recovery.logged is not None:
            self.logged = self.logged.merge(dataclasses.replace(recovery.logged, steps={}, rows=[]))
            _write_rows(self.loggers, recovery.logged, lost.epoch)
            self.seconds += time.perf_counter() - lost.started
        self.step, self.probe = recovery.step, True
        return State.RUNNING

    def _finishing(self) -> State:
        mark("trained")
        group, resume = self.group, self.resume
        if resume.store_url is not None:
            for error in self.layout.flush(group):
                log.warning("a checkpoint of run %s was not saved: %s", resume.run_key, error)
        group.call(Worker.fit_end, self._chunks.epochs.locate(self.step)[0])
        self.callbacks.fit_end()
        timeline = _write_timeline(group, self.config, self._timeline_url)
        state = self.layout.model_state(group)
        mark("weights fetched")
        self._trained = Trained(
            history=self.history,
            resumed_from=resume.step if resume.resumed else None,
            state=state,
            environment=group.call_rank0(Worker.environment),
            events=resume.events() + group.events,
            timeline=timeline,
            dashboard=self._dashboard,
            worker_logs=_worker_logs(group, self._worker_logs, self._dashboard),
        )
        return State.DONE


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


def trace_url(checkpoint_uri: str) -> str:
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


def _write_rows(loggers: Any, chunk: Logged, epoch: int) -> None:
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


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


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
