"""Running a search on Ray Tune: :func:`search` with its :class:`SearchConfig`, each trial
training through ``engine.fit``, the early-stopping scheduler given back its recorded
decisions, a line per trial as it starts and ends, and the :class:`SearchResult`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ringflow.engine.config import DataSpec, TrainConfig
from ringflow.engine.spec import model_hparams
from ringflow.engine.trainer import EpochMetrics, fit
from ringflow.storage.retry import RetryPolicy
from ringflow.storage.store import CheckpointStore
from ringflow.tuning.records import (
    EPOCH,
    RecordedTrial,
    RecordStorage,
    SearchLayout,
    is_finite,
    is_number,
    trial_id_of,
)
from ringflow.tuning.space import SEARCH_ALGORITHMS, TUNABLE_CONFIG, check_names, parse_space

if TYPE_CHECKING:
    from ringflow.tuning.records import History
    from ringflow.tuning.space import Dimension

log = logging.getLogger("ringflow.engine")


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """How a search runs, independent of the model. Validated on construction."""

    trials: int = 8
    """Configurations to try, the base configuration included."""
    epochs: int = 4
    """Epochs of a trial that is not stopped early (the scheduler's ``max_t``)."""
    metric: str = "val_accuracy"
    """The metric to optimise; one the module logs on validation, or ``train_loss``."""
    mode: str = "max"
    """``max`` or ``min``."""
    algorithm: str = "random"
    """How configurations are proposed, by name: see :data:`SEARCH_ALGORITHMS`."""
    max_concurrent: int | None = None
    """Trials at once; ``None`` packs as many as the Ray cluster's CPUs hold. A larger value
    is lowered to that, so trials never oversubscribe the machine."""
    workers_per_trial: int = 1
    """Data-parallel workers of each trial: 1 trains in the trial's own process, more start
    Ray actors exactly as ``train`` does."""
    cpus_per_worker: float = 1.0
    """Ray CPUs reserved for each worker of a trial."""
    cpus_per_trial: float | None = None
    """CPUs a trial of one worker reserves, fractions allowed (0.5: two trials to a CPU);
    ``None``: ``cpus_per_worker``. Only with ``workers_per_trial=1``."""
    gpus_per_trial: float = 0.0
    """The share of a GPU a trial of one worker reserves and trains on (0.25: four trials to
    a GPU); 0 trains on CPU. Only with ``workers_per_trial=1``."""
    grace_period: int = 1
    """Epochs every trial runs before it may be stopped early."""
    reduction_factor: float = 2.0
    """ASHA's halving rate: about ``1/reduction_factor`` of the trials reach each next rung."""
    checkpoint_every: int = 0
    """Checkpoint a trial every this many steps besides epoch ends (0: epoch ends only)."""
    storage_retry: RetryPolicy = RetryPolicy()
    """Backoff and deadline of every read and write of the search's records."""
    state_dir: str | None = None
    """A local directory for Ray Tune's own experiment state while the search runs, emptied
    when it starts; ``None``: a private temporary directory, removed when it ends. Never read
    back: a resumed search is rebuilt from its records under ``storage_url``."""

    def __post_init__(self) -> None:
        for name in ("trials", "epochs", "workers_per_trial", "grace_period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SearchConfig.{name} must be a positive integer, got {value!r}")
        if self.mode not in ("max", "min"):
            raise ValueError(f"SearchConfig.mode must be 'max' or 'min', got {self.mode!r}")
        if self.algorithm not in SEARCH_ALGORITHMS:
            raise ValueError(
                f"SearchConfig.algorithm must be one of {sorted(SEARCH_ALGORITHMS)}, "
                f"got {self.algorithm!r}"
            )
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(
                f"SearchConfig.max_concurrent must be None or at least 1, got {self.max_concurrent}"
            )
        if self.grace_period > self.epochs:
            raise ValueError(
                f"SearchConfig.grace_period ({self.grace_period}) must not exceed epochs "
                f"({self.epochs})"
            )
        if self.reduction_factor <= 1:
            raise ValueError(
                f"SearchConfig.reduction_factor must be above 1, got {self.reduction_factor}"
            )
        if self.cpus_per_worker <= 0:
            raise ValueError(
                f"SearchConfig.cpus_per_worker must be positive, got {self.cpus_per_worker}"
            )
        if self.checkpoint_every < 0:
            raise ValueError(
                f"SearchConfig.checkpoint_every must be 0 or more, got {self.checkpoint_every}"
            )
        self._check_trial_resources()

    @property
    def trial_cpus(self) -> float:
        """CPUs a trial of one worker reserves and trains with."""
        return self.cpus_per_trial or self.cpus_per_worker

    def _check_trial_resources(self) -> None:
        if self.cpus_per_trial is not None and not self.cpus_per_trial > 0:
            raise ValueError(
                f"SearchConfig.cpus_per_trial must be positive, got {self.cpus_per_trial}"
            )
        if not 0 <= self.gpus_per_trial <= 1:
            raise ValueError(
                "SearchConfig.gpus_per_trial must be from 0 to 1 (a share of one GPU), "
                f"got {self.gpus_per_trial}"
            )
        if self.workers_per_trial > 1 and (self.cpus_per_trial is not None or self.gpus_per_trial):
            raise ValueError(
                "SearchConfig.cpus_per_trial and gpus_per_trial are for trials of one worker "
                "(it trains in the trial's process); with workers_per_trial > 1 each worker "
                "reserves cpus_per_worker (and TrainConfig.gpus_per_worker)"
            )


@dataclass(frozen=True, kw_only=True)
class TrialSummary:
    """One trial as the search ended it."""

    trial_id: str
    params: dict[str, Any]
    metric: float | None
    """The searched metric after the trial's last epoch."""
    epochs: int
    """Epochs the trial ran before it finished or was stopped."""
    state: str
    """``completed``, ``stopped early``, ``failed`` or ``not started``."""
    curve: list[float] = field(default_factory=list)
    """The metric after every epoch."""
    executions: int = 0
    """How often the trial's training started (more than 1 after a resume)."""
    checkpoint: str | None = None
    """The trained model of a completed trial."""
    is_base: bool = False
    """Whether this is the base configuration, the one trained without a search."""
    error: str | None = None
    """Why a failed trial failed, in one line."""


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """What a finished search returns; trials in the order they were created."""

    best_trial: str
    best_params: dict[str, Any]
    """The searched names only, model keywords and ``TrainConfig`` fields together."""
    best_metric: float
    best_checkpoint: str
    """The best trial's trained model (``epochs`` epochs)."""
    base_metric: float | None
    """The base configuration's metric, or ``None`` if it did not complete."""
    trials: list[TrialSummary]
    resumed: bool
    """Whether this call continued an earlier, interrupted search."""
    experiment_path: str
    """The search's records under ``storage_url``."""
    ignored_files: list[str] = field(default_factory=list)
    """Files found under ``experiment_path`` that are not ringflow's JSON records (a planted
    pickle, say), relative to it: reported and never opened."""


def _searcher_cls() -> type:
    """Ray's ``Searcher`` handing out the trials a search still has to run; built on first use,
    as Ray is imported only when a search runs.

    Each configuration carries ringflow's own trial id (``{"trial": ..., "params": ...}``):
    records, checkpoints and the scheduler key trials by it, so a search rebuilt from its
    records, on any machine, finds every trial under the name it had before.
    """
    from ray.tune.search import Searcher

    class TrialQueue(Searcher):
        def __init__(self, queue, proposer, *, metric, mode):
            super().__init__(metric=metric, mode=mode)
            self.queue, self.proposer = list(queue), proposer
            self.ids: dict[str, str] = {}

        def set_search_properties(self, metric, mode, config, **spec) -> bool:
            return True  # metric and mode were given to the constructor; there is no space

        def suggest(self, tune_id: str) -> dict[str, Any] | str:
            if not self.queue:
                return Searcher.FINISHED
            trial_id, params = self.queue.pop(0)
            self.ids[tune_id] = trial_id
            resumed = params is not None
            return {
                "trial": trial_id,
                "params": params or self.proposer.suggest(trial_id),
                "resumed": resumed,
            }

        def on_trial_result(self, tune_id: str, result: dict) -> None:
            if tune_id in self.ids:
                self.proposer.observe(self.ids[tune_id], result)

        def on_trial_complete(self, tune_id: str, result=None, error: bool = False) -> None:
            if result and not error:
                self.on_trial_result(tune_id, result)

        def save(self, checkpoint_path: str) -> None:
            # Tune saves its searcher in its scratch directory; a search never restores it
            # (it is rebuilt from the records), so there is nothing worth keeping.
            with open(checkpoint_path, "w") as f:
                json.dump({"unstarted": [t for t, _ in self.queue]}, f)

        def restore(self, checkpoint_path: str) -> None:
            raise NotImplementedError("a search is rebuilt from its records, never restored")

    return TrialQueue


def _resumable_asha(
    cfg: SearchConfig,
    trials: dict[str, RecordedTrial] | None = None,
    *,
    base_trial: str | None = None,
    on_stop: Callable[[str, dict], None] | None = None,
    on_decision: Callable[[str, dict], None] | None = None,
) -> Any:
    """ASHA on the ``epoch`` clock that knows trials by ringflow's id, records every decision
    it makes and starts from the decisions recorded in ``trials`` (see :class:`_Decisions`).

    The base trial (``base_trial``) is never stopped early (its results still set the rungs):
    it is the reference the search must match, so it always trains every epoch. ``on_stop``
    is told of every trial stopped early, with the result that stopped it; ``on_decision``
    of every decision, before it is returned.
    """
    from ray.tune.schedulers import ASHAScheduler

    def alias(trial: Any) -> Any:
        return _Alias(trial_id=_our_id(trial))

    class ResumableASHA(ASHAScheduler):
        def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
            super().on_trial_add(tune_controller, alias(trial))

        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
            ask = functools.partial(super().on_trial_result, tune_controller, alias(trial), result)
            return self.decisions.on_result(_our_id(trial), result, ask)

        def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
            super().on_trial_complete(tune_controller, alias(trial), result)

        def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
            super().on_trial_remove(tune_controller, alias(trial))

        def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
            super().on_trial_error(tune_controller, alias(trial))

    asha = ResumableASHA(
        time_attr=EPOCH,
        metric=cfg.metric,
        mode=cfg.mode,
        max_t=cfg.epochs,
        grace_period=cfg.grace_period,
        reduction_factor=cfg.reduction_factor,
    )
    (bracket,) = asha._brackets  # one bracket: ASHA's default
    asha.decisions = _Decisions(
        cfg,
        bracket,
        asha._metric_op,
        base_trial=base_trial,
        on_stop=on_stop,
        on_decision=on_decision,
    )
    asha.decisions.rebuild(trials or {})
    return asha


_STOP, _CONTINUE = "STOP", "CONTINUE"
"""Ray's ``TrialScheduler.STOP`` and ``TrialScheduler.CONTINUE``."""


class _Decisions:
    """ASHA's decisions on the trials of a search, each recorded as it is made, and rebuilt
    from the records when the search resumes. Plain Python around Ray's bracket.

    A decision is ASHA putting a trial's result in a rung: the trial reached the rung's
    milestone, its metric is compared with the rung's cutoff, and it continues or stops.
    ``on_decision`` is given each one (``{"epoch", "value", "decision"}``) before it is
    returned, so it is on storage before Tune acts on it. Rebuilt from the records
    (:meth:`rebuild`):

    - every recorded decision's value is in its rung, and a trial reporting the epoch of a
      recorded decision gets that decision back (an earlier epoch: continue), where Ray would
      skip the rung and continue;
    - a finished trial's results fill the rungs it has no recorded decision in, as Ray would
      have placed them: the final result at ``max_t``, and every result of a search recorded
      before decisions were;
    - an unfinished trial's results recorded after its last decision (the search stopped
      before ASHA decided on them) are decided now, in order, on these rungs. A stop makes
      the trial stopped after that epoch (``on_stop``), so it is not run again.
    """

    def __init__(
        self,
        cfg: SearchConfig,
        bracket: Any,
        metric_op: float,
        *,
        base_trial: str | None,
        on_stop: Callable[[str, dict], None] | None,
        on_decision: Callable[[str, dict], None] | None,
    ) -> None:
        self.cfg, self.bracket, self.metric_op = cfg, bracket, metric_op
        self.base_trial, self.on_stop, self.on_decision = base_trial, on_stop, on_decision
        self.decided: dict[str, dict[int, str]] = {}
        """Every decision made on each trial, recorded or made here: epoch to its word."""
        self.stopped_on_resume: list[str] = []
        """Trials stopped while the rungs were rebuilt."""

    def on_result(self, trial_id: str, result: dict, ask: Callable[[], str]) -> str:
        """The decision on ``result``: replayed, or ASHA's (``ask``), recorded."""
        decision = self.replayed(trial_id, result) or self.decide(trial_id, result, ask)
        if decision == _STOP and self.early(result) and self.on_stop is not None:
            self.on_stop(trial_id, result)
        return decision

    def early(self, result: dict) -> bool:
        return result.get(EPOCH, self.cfg.epochs) < self.cfg.epochs

    def replayed(self, trial_id: str, result: dict) -> str | None:
        """The decision made at this result's epoch in an earlier attempt, or ``None``."""
        decided = self.decided.get(trial_id, {})
        epoch = result.get(EPOCH)
        if epoch is None or not decided or epoch > max(decided):
            return None
        return _STOP if decided.get(int(epoch)) == "stop" else _CONTINUE

    def decide(self, trial_id: str, result: dict, ask: Callable[[], str]) -> str:
        """ASHA's answer to ``result``, recorded if ASHA put the result in a rung."""
        placed = [trial_id in recorded for _, recorded in self.bracket._rungs]
        decision = ask()
        if trial_id == self.base_trial and self.early(result):
            decision = _CONTINUE
        if [trial_id in recorded for _, recorded in self.bracket._rungs] != placed:
            epoch = int(result[EPOCH])
            word = "stop" if decision == _STOP else "continue"
            self.decided.setdefault(trial_id, {})[epoch] = word
            if self.on_decision is not None:
                value = float(result[self.cfg.metric])
                self.on_decision(trial_id, {EPOCH: epoch, "value": value, "decision": word})
        return decision

    def place(self, trial_id: str, epoch: int, value: float) -> str:
        """Ray's bracket's answer to a result: it puts it in a rung, or not."""
        return self.bracket.on_result(_Alias(trial_id=trial_id), epoch, self.metric_op * value)

    def rebuild(self, trials: dict[str, RecordedTrial]) -> None:
        """The rungs as the records left them."""
        for trial_id, trial in trials.items():
            # In epoch order, so each value lands in the rung its decision was made in.
            for epoch, decision in sorted(trial.decisions.items()):
                self.place(trial_id, epoch, decision["value"])
            self.decided[trial_id] = {e: d["decision"] for e, d in trial.decisions.items()}
        for trial_id, trial in trials.items():
            for epoch, value in _results(trial, self.cfg.metric) if trial.finished else []:
                self.place(trial_id, epoch, value)  # Ray skips rungs that hold it already
        for trial_id, trial in trials.items():
            last = max(trial.decisions, default=0)
            for epoch, value in [] if trial.finished else _results(trial, self.cfg.metric):
                if last < epoch < self.cfg.epochs and self.cut_off(trial_id, epoch, value):
                    break

    def cut_off(self, trial_id: str, epoch: int, value: float) -> bool:
        """Decide on a result recorded before ASHA saw it; whether the trial is stopped."""
        result = {EPOCH: epoch, self.cfg.metric: value}
        ask = functools.partial(self.place, trial_id, epoch, value)
        if self.decide(trial_id, result, ask) != _STOP:
            return False
        self.stopped_on_resume.append(trial_id)
        if self.on_stop is not None:
            self.on_stop(trial_id, result)
        return True


def _results(trial: RecordedTrial, metric: str) -> list[tuple[int, float]]:
    """The epoch and metric of every result of ``trial`` that reported the metric."""
    return [(int(m[EPOCH]), float(m[metric])) for m in trial.curve() if is_number(m.get(metric))]


@dataclass(frozen=True)
class _Alias:
    """A Tune trial as the scheduler sees it: by ringflow's trial id."""

    trial_id: str


def _our_id(trial: Any) -> str:
    config = getattr(trial, "config", None) or {}
    return config.get("trial", trial.trial_id)


@dataclass(frozen=True, kw_only=True)
class _Trial:
    """The Tune trainable: one ``fit`` of a configuration, resumed from its own checkpoint."""

    module_cls: type
    base_hparams: dict[str, Any]
    data: DataSpec
    train_config: TrainConfig
    cfg: SearchConfig
    layout: SearchLayout

    def __call__(self, config: dict[str, Any]) -> None:
        from ray import tune

        trial_id, params = config["trial"], config["params"]
        records = self.layout.trial(trial_id)
        done = records.done()
        if done is not None:
            # Finished before the driver read the records: nothing to train again.
            tune.report(done["last"])
            return
        run_key = self.layout.trial_run_key(trial_id)
        latest = CheckpointStore(self.layout.checkpoints).latest(run_key)
        records.started(params=params, resumes_from_step=latest.step if latest else None)
        hparams, train_config = self.configure(params)

        def on_epoch(m: EpochMetrics) -> None:
            metrics = {**m.metrics, EPOCH: m.epoch + 1}
            records.epoch(metrics)
            if m.epoch + 1 < train_config.epochs:  # the last is reported once the model is saved
                tune.report(metrics)

        result = fit(
            self.module_cls,
            hparams=hparams,
            data=self.data,
            config=train_config,
            checkpoint_uri=self.layout.model(trial_id),
            in_process=train_config.workers == 1,
            on_epoch=on_epoch,
            store_url=self.layout.checkpoints,
            run_key=run_key,
            meta={"tune_trial": trial_id},
        )
        last = {**result.metrics, EPOCH: len(result.history)}
        records.finish(checkpoint=result.checkpoint, last=last, resumed_from=result.resumed_from)
        tune.report(last)

    def configure(self, params: dict[str, Any]) -> tuple[dict[str, Any], TrainConfig]:
        """Split a trial's parameters into model keywords and ``TrainConfig`` fields."""
        overrides = {k: v for k, v in params.items() if k in TUNABLE_CONFIG}
        hparams = {**self.base_hparams, **{k: v for k, v in params.items() if k not in overrides}}
        fields = {
            "workers": self.cfg.workers_per_trial,
            "epochs": self.cfg.epochs,
            "cpus_per_worker": self.cfg.cpus_per_worker,
            "checkpoint_every": self.cfg.checkpoint_every,
            **overrides,
        }
        if self.cfg.workers_per_trial == 1:  # it trains in the trial's process, on its share
            fields["cpus_per_worker"] = self.cfg.trial_cpus
            fields["gpus_per_worker"] = 1 if self.cfg.gpus_per_trial else 0
        return hparams, self.train_config.with_changes(**fields)


class _Progress:
    """One line as each trial starts and as it ends, through ``emit``, while the search runs."""

    def __init__(self, emit: Callable[[str], None], cfg: SearchConfig, total: int, base: str):
        self.emit, self.cfg, self.total, self.base = emit, cfg, total, base
        self.ended = 0
        self.stopped: dict[str, int] = {}

    def kept(self, trial: RecordedTrial) -> None:
        self.ended += 1
        last = trial.done["last"] if trial.done else (trial.curve() or [{}])[-1]
        how = self._ending(trial.trial_id, last)
        self.emit(f"trial {self._name(trial.trial_id)} {how} in an earlier attempt; kept")

    def started(self, trial_id: str, params: dict[str, Any], resumed: bool) -> None:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in params.items())
        verb = "started again (it was interrupted)" if resumed else "started"
        self.emit(f"trial {self._name(trial_id)} {verb}: {shown}")

    def stop(self, trial_id: str, result: dict) -> None:
        self.stopped[trial_id] = int(result[EPOCH])

    def ended_with(self, trial_id: str, result: dict | None, error: str | None = None) -> None:
        self.ended += 1
        how = f"failed: {error}" if error else self._ending(trial_id, result or {})
        self.emit(f"trial {self._name(trial_id)} {how} ({self.ended}/{self.total} trials ended)")

    def _ending(self, trial_id: str, result: dict) -> str:
        metric = result.get(self.cfg.metric)
        value = f"{self.cfg.metric}={metric:.4f}" if is_finite(metric) else "no metric"
        epoch = result.get(EPOCH, 0)
        if trial_id in self.stopped or epoch < self.cfg.epochs:
            return f"stopped early after epoch {epoch}, {value}"
        return f"completed {epoch} epoch{'' if epoch == 1 else 's'}, {value}"

    def _name(self, trial_id: str) -> str:
        return f"{trial_id}{' (base)' if trial_id == self.base else ''}"

    def callback(self) -> Any:
        """The Ray Tune callback that calls this from the driver's loop."""
        from ray.tune import Callback

        progress = self

        class TrialLines(Callback):
            def on_trial_start(self, iteration, trials, trial, **info) -> None:
                resumed = trial.config.get("resumed", False)
                progress.started(_our_id(trial), trial.config["params"], resumed)

            def on_trial_complete(self, iteration, trials, trial, **info) -> None:
                progress.ended_with(_our_id(trial), trial.last_result)

            def on_trial_error(self, iteration, trials, trial, **info) -> None:
                progress.ended_with(_our_id(trial), None, error=_first_line(trial.error_file))

        return TrialLines()


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _first_line(error_file: str | None) -> str:
    """The exception's last line, from Tune's error file in its (local) scratch directory."""
    try:
        with open(error_file) as f:
            lines = [line.strip() for line in f if line.strip()]
    except (OSError, TypeError):
        return "see the trial's log"
    return lines[-1] if lines else "see the trial's log"


def search(
    module_cls: type,
    *,
    base_hparams: dict[str, Any],
    space: dict[str, Any],
    data: DataSpec,
    train_config: TrainConfig,
    storage_url: str,
    run_key: str,
    config: SearchConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """Search ``space`` with ASHA early stopping; every trial is an ``engine.fit``.

    The base configuration (``base_hparams`` and ``train_config``) is always the first trial,
    so the search can only match or beat what would have been trained without it. A call
    with the run key of an interrupted search continues it (see the module docstring).

    Args:
        module_cls: the ``LightningModule`` class every trial trains.
        base_hparams: its keyword arguments; searched names override them.
        space: JSON search space (see :func:`parse_space`); names are keywords of
            ``module_cls`` or :data:`TUNABLE_CONFIG` fields.
        data: the preprocessed dataset.
        train_config: batch size, seed, collective of every trial (workers, epochs and
            checkpointing come from ``config``).
        storage_url: root URL of checkpoints and the search's records.
        run_key: the search's identity, stable across retries of the flow run.
        config: trials, epochs, metric, algorithm, concurrency and resources.
        progress: called with one line as each trial starts and as it ends; defaults to
            this module's logger.

    Returns:
        The best completed trial's parameters, metric and model, and every trial.

    Raises:
        ValueError: an empty or malformed space, a name the model does not take, a value
            it rejects, or a metric it does not report; all before any trial starts.
        RuntimeError: no trial completed.
        CheckpointStorageError: the storage kept failing past ``config.storage_retry``.
    """
    cfg = config or SearchConfig()
    dims = parse_space(space)
    base_hparams = model_hparams(module_cls, base_hparams, data.schema)
    base = check_names(module_cls, base_hparams, train_config, dims)
    _check_metric(module_cls, base_hparams, data, train_config, cfg.metric)
    layout = SearchLayout(
        storage_url=storage_url, run_key=run_key, storage=RecordStorage(cfg.storage_retry)
    )
    history = layout.history()
    if history.foreign:
        log.warning(
            "ignored %d files under %s that ringflow did not write as its JSON records (it "
            "never unpickles anything from storage): %s",
            len(history.foreign),
            layout.tune_dir,
            ", ".join(history.foreign),
        )
    trainable = _Trial(
        module_cls=module_cls,
        base_hparams=base_hparams,
        data=data,
        train_config=train_config,
        cfg=cfg,
        layout=layout,
    )
    lines = _Progress(progress or log.info, cfg, total=cfg.trials, base=trial_id_of(0))
    errors = _run_trials(trainable, dims, base, history, cfg, lines, seed=train_config.seed)
    trials = _summaries(layout.history(), errors, cfg, base)
    return _best(
        trials, cfg, resumed=history.resumed, path=layout.tune_dir, ignored=history.foreign
    )


def _run_trials(
    trainable: _Trial,
    dims: list[Dimension],
    base: dict[str, Any],
    history: History,
    cfg: SearchConfig,
    lines: _Progress,
    *,
    seed: int,
) -> dict[str, str]:
    """Run with Ray Tune every trial not finished in ``history``, up to ``cfg.trials``.

    Returns:
        The trials that failed, with the last line of their error.
    """
    layout = trainable.layout

    def stop(trial_id: str, result: dict) -> None:
        lines.stop(trial_id, result)
        layout.trial(trial_id).stopped(**{EPOCH: int(result[EPOCH])})

    def decided(trial_id: str, decision: dict[str, Any]) -> None:
        layout.trial(trial_id).decided(decision)

    scheduler = _resumable_asha(
        cfg, history.trials, base_trial=trial_id_of(0), on_stop=stop, on_decision=decided
    )
    if scheduler.decisions.stopped_on_resume:  # decided while it was rebuilt: now finished
        history = layout.history()
    kept = {t: r for t, r in history.trials.items() if r.finished}
    for trial in kept.values():
        lines.kept(trial)
    if kept:
        log.info("search %s continues: %d trials kept", trainable.layout.run_key, len(kept))
    recorded = {t: r.params for t, r in history.trials.items() if not r.finished}
    queue = [(t, recorded.get(t)) for t in _ids(cfg) if t not in kept]
    if not queue:
        return {}
    proposer = SEARCH_ALGORITHMS[cfg.algorithm](
        dims, base, metric=cfg.metric, mode=cfg.mode, seed=seed
    )
    proposer.resume(history, base_trial=trial_id_of(0))
    with _tune_scratch(cfg) as scratch:
        return _fit_tuner(trainable, queue, proposer, scheduler, cfg, lines, scratch)


def _fit_tuner(trainable, queue, proposer, scheduler, cfg, lines, scratch) -> dict[str, str]:
    """Run the trials of ``queue`` with Ray Tune; the failed ones, with why."""
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback

    resources, concurrent = _packing(cfg)
    layout = trainable.layout

    def trial(config: dict[str, Any]) -> None:  # Tune wants a plain function to annotate
        trainable(config)

    searcher = _searcher_cls()(queue, proposer, metric=cfg.metric, mode=cfg.mode)
    tuner = tune.Tuner(
        tune.with_resources(trial, resources),
        tune_config=tune.TuneConfig(
            num_samples=len(queue),
            scheduler=scheduler,
            search_alg=searcher,
            max_concurrent_trials=concurrent,
            # A trial's process serves the next trial (its imports done), as the engine's
            # warm workers serve the next fit; RINGFLOW_WORKER_POOL=0 starts each afresh.
            reuse_actors=os.environ.get("RINGFLOW_WORKER_POOL", "1") != "0",
        ),
        run_config=tune.RunConfig(
            storage_path=scratch,
            name=layout.run_key,
            verbose=0,
            callbacks=[lines.callback(), JsonLoggerCallback()],
        ),
    )
    results = tuner.fit()
    return {
        r.config["trial"]: _one_line(r.error) for r in results if r.error is not None and r.config
    }


def _packing(cfg: SearchConfig) -> tuple[dict[str, float], int]:
    """What a trial reserves and how many trials run at once without oversubscribing."""
    import ray

    cluster = ray.cluster_resources()
    cpus = max(1.0, float(cluster.get("CPU", 1)))
    if cfg.workers_per_trial == 1:  # it trains in the trial's own process, on its share
        cpu = cfg.trial_cpus
        resources = {"cpu": cpu, **({"gpu": cfg.gpus_per_trial} if cfg.gpus_per_trial else {})}
        fits = int((cpus + 1e-9) // cpu)
        if cfg.gpus_per_trial:
            gpus = float(cluster.get("GPU", 0))
            if not gpus:
                raise ValueError(
                    f"gpus_per_trial={cfg.gpus_per_trial:g} but the Ray cluster has no GPU: "
                    "set it to 0, or connect to a cluster with GPUs (RAY_ADDRESS)"
                )
            fits = min(fits, int((gpus + 1e-9) // cfg.gpus_per_trial))
        what = f"{cpu:g} CPUs" + (f" and {cfg.gpus_per_trial:g} GPUs" if cfg.gpus_per_trial else "")
    else:
        # More workers start actors in their own placement group, so the trial itself holds
        # only a token share of a CPU.
        resources = {"cpu": 0.01}
        fits = int((cpus + 1e-9) // (cfg.workers_per_trial * cfg.cpus_per_worker + 0.01))
        what = f"{cfg.workers_per_trial * cfg.cpus_per_worker:g} CPUs"
    fits = max(1, fits)
    if cfg.max_concurrent is not None and cfg.max_concurrent > fits:
        log.warning(
            "max_concurrent=%d trials of %s do not fit the cluster's resources; running %d",
            cfg.max_concurrent,
            what,
            fits,
        )
    return resources, min(cfg.max_concurrent or fits, fits)


@contextmanager
def _tune_scratch(cfg: SearchConfig) -> Iterator[str]:
    """A local directory for Ray Tune's experiment state, empty at the start of the search,
    and Tune's own output off while it runs.

    Tune's state (``tuner.pkl``, searcher and trial states) is pickled; it stays on the
    machine that drives the search and is never read back: a resumed search is rebuilt from
    the JSON records under ``storage_url``. Tune's status tables, its CSV and TensorBoard
    loggers (the records are ringflow's own) and with them its hint to run TensorBoard on
    that directory are off; the search prints a line per trial instead (:class:`_Progress`).
    """
    path = (
        tempfile.mkdtemp(prefix="ringflow-tune-")
        if cfg.state_dir is None
        else os.path.abspath(cfg.state_dir)
    )
    if cfg.state_dir is not None:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    # Read by Tune when the search starts: the legacy reporter, silent at verbose=0 (the new
    # one prints its configuration table and the scratch path whatever the verbosity), and
    # no default loggers (the JSON one, which the result grid reads, is added explicitly).
    quiet = {"RAY_AIR_NEW_OUTPUT": "0", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1"}
    saved = {key: os.environ.get(key) for key in quiet}
    tune_log = logging.getLogger("ray.tune")
    level = tune_log.level
    os.environ.update(quiet)
    tune_log.setLevel(logging.WARNING)  # "wrote the latest version of all result files"
    try:
        yield path
    finally:
        tune_log.setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if cfg.state_dir is None:
            shutil.rmtree(path, ignore_errors=True)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}".rstrip(": ")


def reported_metrics(
    module_cls: type, hparams: dict[str, Any], data: DataSpec, config: TrainConfig
) -> list[str]:
    """The metrics a trial of ``module_cls`` reports: what its ``validation_step`` logs
    (found by evaluating an untrained module once, in this process) and ``train_loss``."""
    from ringflow.engine.data_parallel import WholeModel
    from ringflow.engine.worker import Worker

    hparams = model_hparams(module_cls, hparams, data.schema)
    one = config.with_workers(1, epochs=1)
    worker = Worker(module_cls, hparams=hparams, data=data, config=one, rank=0, plan=WholeModel())
    reported = worker.evaluate("validation").results()
    return sorted({*reported, "train_loss"})


def _check_metric(
    module_cls: type, base: dict, data: DataSpec, config: TrainConfig, metric: str
) -> None:
    """Evaluate an untrained module once, so a metric no trial reports fails before trials."""
    known = reported_metrics(module_cls, base, data, config)
    if metric not in known:
        raise ValueError(
            f"metric {metric!r} is not reported by {module_cls.__name__}; it reports {known}"
        )


def _summaries(
    history: History, errors: dict[str, str], cfg: SearchConfig, base: dict[str, Any]
) -> list[TrialSummary]:
    return [_summary(t, history.trials.get(t), errors.get(t), cfg, base) for t in _ids(cfg)]


def _ids(cfg: SearchConfig) -> list[str]:
    return [trial_id_of(i) for i in range(cfg.trials)]


def _summary(
    trial_id: str,
    trial: RecordedTrial | None,
    error: str | None,
    cfg: SearchConfig,
    base: dict[str, Any],
) -> TrialSummary:
    trial = trial or RecordedTrial(trial_id=trial_id)
    epochs = trial.curve()
    curve = [float(m.get(cfg.metric, math.nan)) for m in epochs]
    if trial.done is not None:
        state = "completed"
    elif error is not None:
        state = "failed"
    else:
        state = "stopped early" if epochs else "not started"
    params = {name: (trial.params or {})[name] for name in base if name in (trial.params or {})}
    return TrialSummary(
        trial_id=trial_id,
        params=params,
        metric=curve[-1] if curve and is_finite(curve[-1]) else None,
        epochs=len(epochs),
        state=state,
        curve=curve,
        executions=trial.executions,
        checkpoint=trial.done["checkpoint"] if trial.done else None,
        is_base=trial_id == trial_id_of(0),
        error=error,
    )


def _best(
    trials: list[TrialSummary],
    cfg: SearchConfig,
    *,
    resumed: bool,
    path: str,
    ignored: list[str],
) -> SearchResult:
    sign = 1.0 if cfg.mode == "max" else -1.0
    completed = [t for t in trials if t.state == "completed" and t.metric is not None]
    if not completed:
        states = {t.trial_id: t.error or t.state for t in trials}
        raise RuntimeError(f"no trial of the search completed: {states}")
    best = max(completed, key=lambda t: sign * t.metric)
    base = next((t for t in completed if t.is_base), None)
    return SearchResult(
        best_trial=best.trial_id,
        best_params=dict(best.params),
        best_metric=best.metric,
        best_checkpoint=best.checkpoint,
        base_metric=base.metric if base else None,
        trials=trials,
        resumed=resumed,
        experiment_path=path,
        ignored_files=list(ignored),
    )
