"""Hyperparameter search with Ray Tune; every trial trains through ``engine.fit``.

A search is identified by its run key and keeps everything under ``storage_url``::

    {storage_url}/tune/{run_key}/                        Ray Tune's experiment state
    {storage_url}/tune/{run_key}/trials/{trial}/starts/  one file per execution of the trial,
                                                         with the step it resumes from
    {storage_url}/tune/{run_key}/trials/{trial}/epochs/  the metrics of every epoch it trained
    {storage_url}/tune/{run_key}/trials/{trial}/done.json  written once its training finished
    {storage_url}/checkpoints/{run_key}-trial-{trial}/   its training state (``CheckpointStore``)
    {storage_url}/runs/{run_key}/trials/{trial}/model    its trained model

Calling :func:`search` again with the same run key continues the search: finished trials are
kept, unfinished ones resume from their newest checkpoint, and the early-stopping scheduler
is given back every result it had seen, so it decides as if the search had never stopped.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import pickle
import random
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ringflow.engine.config import DataSpec, TrainConfig
from ringflow.engine.spec import model_hparams
from ringflow.engine.trainer import EpochMetrics, fit
from ringflow.storage.fs import atomic_write, join, read_bytes, resolve
from ringflow.storage.layout import Workspace
from ringflow.storage.store import CheckpointStore

__all__ = [
    "SEARCH_ALGORITHMS",
    "SearchConfig",
    "SearchResult",
    "TrialSummary",
    "parse_space",
    "search",
]

log = logging.getLogger("ringflow.engine")

_SEARCH_OWNED = ("workers", "epochs", "cpus_per_worker", "checkpoint_every")
TUNABLE_CONFIG = tuple(
    f.name for f in dataclasses.fields(TrainConfig) if f.name not in _SEARCH_OWNED
)
"""``TrainConfig`` fields a search space may name besides the model's keywords (batch size,
seed, collective, compression, bucket size...). Workers, epochs, CPUs and checkpointing are
the search's own settings (:class:`SearchConfig`)."""

_KINDS = ("choice", "uniform", "loguniform", "randint")
_EPOCH = "epoch"
"""Reported with every result (1-based); the scheduler's clock, so a resumed trial that
skips the epochs restored from its checkpoint still reports consistent times."""


# --------------------------------------------------------------------------- settings


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
    grace_period: int = 1
    """Epochs every trial runs before it may be stopped early."""
    reduction_factor: float = 2.0
    """ASHA's halving rate: about ``1/reduction_factor`` of the trials reach each next rung."""
    checkpoint_every: int = 0
    """Checkpoint a trial every this many steps besides epoch ends (0: epoch ends only)."""

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


# --------------------------------------------------------------------------- search spaces


@dataclass(frozen=True)
class _Dimension:
    """One searched name: a list of choices or a numeric range."""

    name: str
    kind: str
    values: tuple[Any, ...]
    """The choices, or ``(low, high)`` (``high`` excluded for ``randint``)."""

    def tune_domain(self) -> Any:
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.values))
        return getattr(tune, self.kind)(*self.values)

    def samples(self) -> list[Any]:
        """Values that probe the range's ends, for validation."""
        if self.kind == "choice":
            return list(self.values)
        low, high = self.values
        return [low, high - 1] if self.kind == "randint" else [low, high]

    def sample(self, rng: random.Random) -> Any:
        low, high = self.values if self.kind != "choice" else (0, 0)
        if self.kind == "choice":
            return rng.choice(self.values)
        if self.kind == "uniform":
            return rng.uniform(low, high)
        if self.kind == "loguniform":
            return math.exp(rng.uniform(math.log(low), math.log(high)))
        return rng.randrange(low, high)

    def mutate(self, rng: random.Random, value: Any) -> Any:
        """A neighbour of ``value``: the next choice, or a step of a quarter of the range."""
        if self.kind == "choice":
            if value not in self.values or len(self.values) == 1:
                return rng.choice(self.values)
            i = self.values.index(value) + rng.choice((-1, 1))
            return self.values[min(max(i, 0), len(self.values) - 1)]
        low, high = self.values
        if self.kind == "loguniform":
            moved = math.exp(math.log(value) + rng.gauss(0, 0.25 * math.log(high / low)))
            return min(max(moved, low), high)
        moved = value + rng.gauss(0, 0.25 * (high - low))
        if self.kind == "randint":
            return min(max(round(moved), low), high - 1)
        return min(max(moved, low), high)


def parse_space(space: dict[str, Any]) -> list[_Dimension]:
    """Read a JSON search space: name to a list of choices or ``{kind: [low, high]}``.

    Kinds: ``{"choice": [...]}`` (a bare list means the same), ``{"uniform": [low, high]}``,
    ``{"loguniform": [low, high]}`` (low > 0), ``{"randint": [low, high]}`` (high excluded).

    Raises:
        ValueError: an empty space or an entry of another shape.
    """
    if not isinstance(space, dict) or not space:
        raise ValueError(
            "the search space is empty: give at least one name, e.g. "
            '{"lr": {"loguniform": [0.001, 0.1]}, "hidden": [32, 64, 128]}'
        )
    return [_dimension(name, spec) for name, spec in space.items()]


def _dimension(name: str, spec: Any) -> _Dimension:
    if isinstance(spec, list):
        spec = {"choice": spec}
    if isinstance(spec, dict) and len(spec) == 1:
        kind, values = next(iter(spec.items()))
        if kind == "choice" and isinstance(values, list) and values:
            return _Dimension(name, kind, tuple(values))
        if kind in _KINDS and _is_range(kind, values):
            return _Dimension(name, kind, (values[0], values[1]))
    raise ValueError(
        f"search space entry {name!r} must be a non-empty list of choices or one of "
        "{'choice': [...]}, {'uniform' | 'loguniform' | 'randint': [low, high]} with "
        f"low < high (low > 0 for loguniform, integers for randint); got {spec!r}"
    )


def _is_range(kind: str, values: Any) -> bool:
    if not (isinstance(values, list | tuple) and len(values) == 2):
        return False
    low, high = values
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if not numbers or not low < high:
        return False
    if kind == "loguniform":
        return low > 0
    return kind != "randint" or all(isinstance(v, int) for v in values)


# --------------------------------------------------------------------------- algorithms


def _random_search(dims: list[_Dimension], base: dict[str, Any], cfg: SearchConfig, seed: int):
    """Ray Tune's random sampling, with the base configuration evaluated first."""
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(
        points_to_evaluate=[base], random_state=seed, max_concurrent=cfg.max_concurrent or 0
    )


def _evolution_search(dims: list[_Dimension], base: dict[str, Any], cfg: SearchConfig, seed: int):
    """Seeded mutation of the best trial so far (see ``EvolutionSearcher``)."""
    from ray.tune.search import ConcurrencyLimiter

    searcher = _evolution_searcher_cls()(dims, base, metric=cfg.metric, mode=cfg.mode, seed=seed)
    return ConcurrencyLimiter(searcher, max_concurrent=cfg.max_concurrent or 1)


SEARCH_ALGORITHMS: dict[str, Callable[..., Any]] = {
    "random": _random_search,
    "evolution": _evolution_search,
}
"""Search algorithms by name. Both need nothing beyond Ray Tune: the Ray searchers that
model the metric (Optuna, HyperOpt, BayesOpt, ...) each need a package not installed here."""


class _Evolution:
    """The base configuration, then ``initial`` random ones, then mutations of the best.

    "Best" ranks trials by how far the early-stopping scheduler let them go, then by the
    metric there, so a trial stopped early never outranks one that outlived it. Seeded: the
    same results give the same proposals. Plain Python, so it is tested without Ray.
    """

    def __init__(self, dims, base, *, metric: str, mode: str, seed: int, initial: int = 3):
        self.dims, self.queue, self.initial = dims, [dict(base)], initial
        self.metric, self.sign = metric, 1.0 if mode == "max" else -1.0
        self.rng = random.Random(seed)
        self.configs: dict[str, dict[str, Any]] = {}
        self.scores: dict[str, tuple[int, float]] = {}

    def suggest(self, trial_id: str) -> dict[str, Any]:
        if self.queue:
            config = self.queue.pop(0)
        elif len(self.configs) <= self.initial or not self.scores:
            config = {d.name: d.sample(self.rng) for d in self.dims}
        else:
            config = self._mutate(self.configs[max(self.scores, key=self.scores.__getitem__)])
        self.configs[trial_id] = config
        return dict(config)

    def _mutate(self, parent: dict[str, Any]) -> dict[str, Any]:
        child = dict(parent)
        changed = [d for d in self.dims if self.rng.random() < 1 / len(self.dims)]
        for dim in changed or [self.rng.choice(self.dims)]:
            child[dim.name] = dim.mutate(self.rng, parent[dim.name])
        return child

    def observe(self, trial_id: str, result: dict) -> None:
        value = result.get(self.metric)
        if trial_id in self.configs and _EPOCH in result and _finite(value):
            self.scores[trial_id] = (int(result[_EPOCH]), self.sign * float(value))


def _evolution_searcher_cls() -> type:
    """Ray's ``Searcher`` around :class:`_Evolution`; built on first use, as Ray is imported
    only when a search runs. Its state is saved with the experiment and restored with it."""
    from ray.tune.search import Searcher

    class EvolutionSearcher(Searcher):
        def __init__(self, dims, base, *, metric, mode, seed):
            super().__init__(metric=metric, mode=mode)
            self.evolution = _Evolution(dims, base, metric=metric, mode=mode, seed=seed)

        def set_search_properties(self, metric, mode, config, **spec) -> bool:
            return True  # metric, mode and space were given to the constructor

        def suggest(self, trial_id: str) -> dict[str, Any]:
            return self.evolution.suggest(trial_id)

        def on_trial_result(self, trial_id: str, result: dict) -> None:
            self.evolution.observe(trial_id, result)

        def on_trial_complete(self, trial_id: str, result=None, error: bool = False) -> None:
            if result and not error:
                self.evolution.observe(trial_id, result)

        def save(self, checkpoint_path: str) -> None:
            with open(checkpoint_path, "wb") as f:
                pickle.dump(self.evolution, f)

        def restore(self, checkpoint_path: str) -> None:
            with open(checkpoint_path, "rb") as f:
                self.evolution = pickle.load(f)

    return EvolutionSearcher


def _resumable_asha(
    cfg: SearchConfig,
    seen: dict[str, list[tuple[int, float]]],
    base: dict[str, Any] | None = None,
) -> Any:
    """ASHA on the ``epoch`` clock that, as restored trials are added, replays their results.

    Ray Tune does not save its scheduler with the experiment, so a restored search would
    otherwise forget every rung and let a resumed trial pass where it would have stopped.
    The base configuration's trial is never stopped early (its results still set the rungs):
    it is the reference the search must match, so it always trains every epoch.
    """
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    class ResumableASHA(ASHAScheduler):
        def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
            super().on_trial_add(tune_controller, trial)
            bracket = self._trial_info[trial.trial_id]
            for epoch, value in seen.get(trial.trial_id, []):
                bracket.on_result(trial, epoch, self._metric_op * value)

        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
            decision = super().on_trial_result(tune_controller, trial, result)
            config = getattr(trial, "config", None) or {}
            is_base = base is not None and all(config.get(k) == v for k, v in base.items())
            if is_base and result.get(_EPOCH, 0) < cfg.epochs:
                return TrialScheduler.CONTINUE
            return decision

    return ResumableASHA(
        time_attr=_EPOCH,
        metric=cfg.metric,
        mode=cfg.mode,
        max_t=cfg.epochs,
        grace_period=cfg.grace_period,
        reduction_factor=cfg.reduction_factor,
    )


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class _TrialRecords:
    """What one trial wrote under ``{tune dir}/trials/{trial}``: ours, on any fsspec URL."""

    url: str

    def started(self, **info: Any) -> None:
        atomic_write(join(self.url, "starts", f"{uuid.uuid4().hex}.json"), _dumps(info))

    def executions(self) -> int:
        return len(_list(join(self.url, "starts")))

    def epoch(self, metrics: dict[str, float]) -> None:
        atomic_write(join(self.url, "epochs", f"{int(metrics[_EPOCH]):06d}.json"), _dumps(metrics))

    def epochs(self) -> list[dict[str, float]]:
        return [json.loads(read_bytes(u)) for u in sorted(_list(join(self.url, "epochs")))]

    def finish(self, **info: Any) -> None:
        atomic_write(join(self.url, "done.json"), _dumps(info))

    def done(self) -> dict[str, Any] | None:
        urls = _list(self.url)
        done = join(self.url, "done.json")
        return json.loads(read_bytes(done)) if done in urls else None


def _list(url: str) -> list[str]:
    fs, path = resolve(url)
    if not fs.exists(path):
        return []
    prefix = url[: len(url) - len(path)] if url.endswith(path) else ""
    return [prefix + p for p in fs.ls(path, detail=False)]


def _dumps(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


@dataclass(frozen=True, kw_only=True)
class _Layout:
    storage_url: str
    run_key: str

    @property
    def tune_dir(self) -> str:
        return Workspace(self.storage_url).tune(self.run_key)

    @property
    def checkpoints(self) -> str:
        return Workspace(self.storage_url).checkpoints

    def trial(self, trial_id: str) -> _TrialRecords:
        return _TrialRecords(join(self.tune_dir, "trials", trial_id))

    def trial_run_key(self, trial_id: str) -> str:
        return f"{self.run_key}-trial-{re.sub(r'[^A-Za-z0-9.=-]', '-', trial_id)}"

    def model(self, trial_id: str) -> str:
        return Workspace(self.storage_url).trial_model(self.run_key, trial_id)

    def trial_ids(self) -> list[str]:
        return [u.rstrip("/").rsplit("/", 1)[-1] for u in _list(join(self.tune_dir, "trials"))]


# --------------------------------------------------------------------------- the trial


@dataclass(frozen=True, kw_only=True)
class _Trial:
    """The Tune trainable: one ``fit`` of a configuration, resumed from its own checkpoint."""

    module_cls: type
    base_hparams: dict[str, Any]
    data: DataSpec
    train_config: TrainConfig
    cfg: SearchConfig
    layout: _Layout

    def __call__(self, params: dict[str, Any]) -> None:
        from ray import tune

        trial_id = tune.get_context().get_trial_id()
        records = self.layout.trial(trial_id)
        done = records.done()
        if done is not None:
            # Finished before a crash that Tune's saved state missed: nothing to train again.
            tune.report(done["last"])
            return
        run_key = self.layout.trial_run_key(trial_id)
        latest = CheckpointStore(self.layout.checkpoints).latest(run_key)
        records.started(params=params, resumes_from_step=latest.step if latest else None)
        hparams, config = self.configure(params)

        def on_epoch(m: EpochMetrics) -> None:
            metrics = {**m.metrics, _EPOCH: m.epoch + 1}
            records.epoch(metrics)
            if m.epoch + 1 < config.epochs:  # the last is reported once the model is saved
                tune.report(metrics)

        result = fit(
            self.module_cls,
            hparams=hparams,
            data=self.data,
            config=config,
            checkpoint_uri=self.layout.model(trial_id),
            in_process=config.workers == 1,
            on_epoch=on_epoch,
            store_url=self.layout.checkpoints,
            run_key=run_key,
            meta={"tune_trial": trial_id},
        )
        last = {**result.metrics, _EPOCH: len(result.history)}
        records.finish(checkpoint=result.checkpoint, last=last, resumed_from=result.resumed_from)
        tune.report(last)

    def configure(self, params: dict[str, Any]) -> tuple[dict[str, Any], TrainConfig]:
        """Split a trial's parameters into model keywords and ``TrainConfig`` fields."""
        overrides = {k: v for k, v in params.items() if k in TUNABLE_CONFIG}
        hparams = {**self.base_hparams, **{k: v for k, v in params.items() if k not in overrides}}
        config = dataclasses.replace(
            self.train_config,
            workers=self.cfg.workers_per_trial,
            epochs=self.cfg.epochs,
            cpus_per_worker=self.cfg.cpus_per_worker,
            checkpoint_every=self.cfg.checkpoint_every,
            **overrides,
        )
        return hparams, config


# --------------------------------------------------------------------------- search


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
        storage_url: root URL of checkpoints and the search's state.
        run_key: the search's identity, stable across retries of the flow run.
        config: trials, epochs, metric, algorithm, concurrency and resources.

    Returns:
        The best completed trial's parameters, metric and model, and every trial.

    Raises:
        ValueError: an empty or malformed space, a name the model does not take, a value
            it rejects, or a metric it does not report; all before any trial starts.
        RuntimeError: no trial completed.
    """
    cfg = config or SearchConfig()
    dims = parse_space(space)
    base_hparams = model_hparams(module_cls, base_hparams, data.schema)
    base = _check_names(module_cls, base_hparams, train_config, dims)
    _check_metric(module_cls, base_hparams, data, train_config, cfg.metric)
    layout = _Layout(storage_url=storage_url, run_key=run_key)
    trainable = _Trial(
        module_cls=module_cls,
        base_hparams=base_hparams,
        data=data,
        train_config=train_config,
        cfg=cfg,
        layout=layout,
    )
    results, resumed = _run_tuner(trainable, dims, base, layout, cfg, seed=train_config.seed)
    trials = _summaries(results, layout, cfg, base)
    return _best(trials, cfg, resumed=resumed, path=layout.tune_dir)


def _run_tuner(
    trainable: _Trial,
    dims: list[_Dimension],
    base: dict[str, Any],
    layout: _Layout,
    cfg: SearchConfig,
    *,
    seed: int,
) -> tuple[Any, bool]:
    from ray import tune

    per_trial, concurrent = _packing(cfg)
    cfg = dataclasses.replace(cfg, max_concurrent=concurrent)
    fs_path = _tune_path(layout.tune_dir)
    base = dict(base)
    seen = {t: _rung_results(layout.trial(t), cfg.metric) for t in layout.trial_ids()}

    def trial(params: dict[str, Any]) -> None:  # Tune wants a plain function to annotate
        trainable(params)

    resources = tune.with_resources(trial, {"cpu": per_trial})
    resumed = tune.Tuner.can_restore(fs_path)
    with _experiment_saved_every(seconds=1):
        if resumed:
            log.info("search %s continues from %s", layout.run_key, fs_path)
            tuner = tune.Tuner.restore(
                fs_path, resources, resume_unfinished=True, restart_errored=True
            )
            # Not saved with the experiment: give it back, with every result seen so far.
            tuner._local_tuner._tune_config.scheduler = _resumable_asha(cfg, seen, base)
        else:
            tuner = tune.Tuner(
                resources,
                param_space={} if cfg.algorithm != "random" else _param_space(dims),
                tune_config=tune.TuneConfig(
                    num_samples=cfg.trials,
                    scheduler=_resumable_asha(cfg, {}, base),
                    search_alg=SEARCH_ALGORITHMS[cfg.algorithm](dims, base, cfg, seed),
                ),
                run_config=tune.RunConfig(
                    storage_path=fs_path.rsplit("/", 1)[0], name=layout.run_key, verbose=0
                ),
            )
        return tuner.fit(), resumed


def _param_space(dims: list[_Dimension]) -> dict[str, Any]:
    return {d.name: d.tune_domain() for d in dims}


def _packing(cfg: SearchConfig) -> tuple[float, int]:
    """CPUs a trial reserves and how many trials run at once without oversubscribing."""
    import ray

    cpus = max(1.0, float(ray.cluster_resources().get("CPU", 1)))
    training = cfg.workers_per_trial * cfg.cpus_per_worker
    # One worker trains in the trial's process; more start actors in their own placement
    # group, so the trial itself holds only a token share of a CPU.
    per_trial = cfg.cpus_per_worker if cfg.workers_per_trial == 1 else 0.01
    fits = max(1, int((cpus + 1e-9) // (training + (0 if cfg.workers_per_trial == 1 else 0.01))))
    if cfg.max_concurrent is not None and cfg.max_concurrent > fits:
        log.warning(
            "max_concurrent=%d trials of %g CPUs do not fit the cluster's %g CPUs; running %d",
            cfg.max_concurrent,
            training,
            cpus,
            fits,
        )
    return per_trial, min(cfg.max_concurrent or fits, fits)


@contextmanager
def _experiment_saved_every(*, seconds: float) -> Iterator[None]:
    """Save Tune's experiment state often (its default waits 10 s or more between saves), so
    a crash right after a trial finished keeps it finished. Tune reads this variable only."""
    key = "TUNE_GLOBAL_CHECKPOINT_S"
    old = os.environ.get(key)
    os.environ.setdefault(key, str(seconds))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)


def _tune_path(url: str) -> str:
    """Ray Tune takes a local path or a URL that pyarrow opens (``s3://``, ``gs://``)."""
    fs, path = resolve(url)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return path
    if {"s3", "s3a", "gs", "gcs"} & set(protocols):
        return url
    raise ValueError(
        f"Ray Tune cannot keep its search state at {url!r} (protocol {protocols[0]!r}); "
        "use a local path, s3:// or gs:// for storage_url"
    )


def _rung_results(records: _TrialRecords, metric: str) -> list[tuple[int, float]]:
    return [
        (int(m[_EPOCH]), float(m[metric]))
        for m in records.epochs()
        if _EPOCH in m and _finite(m.get(metric))
    ]


# --------------------------------------------------------------------------- validation


def _check_names(
    module_cls: type, base_hparams: dict, train_config: TrainConfig, dims: list[_Dimension]
) -> dict[str, Any]:
    """Every searched name is taken by the model or the config and accepts its values.

    Returns:
        The base configuration's value of every searched name.
    """
    params = inspect.signature(module_cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    model_names = {n for n in params if n != "self"}
    base: dict[str, Any] = {}
    for dim in dims:
        if dim.name in TUNABLE_CONFIG:
            base[dim.name] = getattr(train_config, dim.name)
            for value in dim.samples():
                _try(dim, value, lambda v, d=dim: dataclasses.replace(train_config, **{d.name: v}))
        elif dim.name in model_names or takes_any:
            if dim.name not in base_hparams and dim.name in params:
                default = params[dim.name].default
                if default is inspect.Parameter.empty:
                    raise ValueError(f"{dim.name!r} has no base value: add it to base_hparams")
                base[dim.name] = default
            else:
                base[dim.name] = base_hparams[dim.name]
            for value in dim.samples():
                _try(dim, value, lambda v, d=dim: module_cls(**{**base_hparams, d.name: v}))
        else:
            raise ValueError(
                f"search space names {dim.name!r}, which {module_cls.__name__} does not take; "
                f"it takes {sorted(model_names)}, and the search may also set {TUNABLE_CONFIG}"
            )
    return base


def _try(dim: _Dimension, value: Any, build: Callable[[Any], Any]) -> None:
    try:
        build(value)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"search space entry {dim.name!r} allows {value!r}, which is rejected: {err}"
        ) from err


def reported_metrics(
    module_cls: type, hparams: dict[str, Any], data: DataSpec, config: TrainConfig
) -> list[str]:
    """The metrics a trial of ``module_cls`` reports: what its ``validation_step`` logs
    (found by evaluating an untrained module once, in this process) and ``train_loss``."""
    from ringflow.engine.worker import RankWorker

    hparams = model_hparams(module_cls, hparams, data.schema)
    one = dataclasses.replace(config, workers=1, epochs=1)
    worker = RankWorker(module_cls, hparams=hparams, data=data, config=one, rank=0)
    reported, _ = worker.evaluate("validation")
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


# --------------------------------------------------------------------------- results


def _summaries(
    results: Any, layout: _Layout, cfg: SearchConfig, base: dict[str, Any]
) -> list[TrialSummary]:
    summaries = []
    for result in results:
        trial_id = result.metrics.get("trial_id") or _trial_id_from_path(result.path)
        summaries.append(_summary(trial_id, result, layout.trial(trial_id), cfg, base))
    return summaries


def _summary(
    trial_id: str,
    result: Any,
    records: _TrialRecords,
    cfg: SearchConfig,
    base: dict[str, Any],
) -> TrialSummary:
    epochs = records.epochs()
    done = records.done()
    curve = [float(m.get(cfg.metric, math.nan)) for m in epochs]
    if done is not None:
        state = "completed"
    elif result.error is not None:
        state = "failed"
    else:
        state = "stopped early" if epochs else "not started"
    params = {name: result.config[name] for name in base if name in result.config}
    return TrialSummary(
        trial_id=trial_id,
        params=params,
        metric=curve[-1] if curve and _finite(curve[-1]) else None,
        epochs=len(epochs),
        state=state,
        curve=curve,
        executions=records.executions(),
        checkpoint=done["checkpoint"] if done else None,
        is_base=params == base,
    )


def _trial_id_from_path(path: str) -> str:
    match = re.search(r"_([0-9a-f]{5}_\d{5})(_|$)", path.rstrip("/").rsplit("/", 1)[-1])
    return match.group(1) if match else path.rstrip("/").rsplit("/", 1)[-1]


def _best(trials: list[TrialSummary], cfg: SearchConfig, *, resumed: bool, path: str):
    sign = 1.0 if cfg.mode == "max" else -1.0
    completed = [t for t in trials if t.state == "completed" and t.metric is not None]
    if not completed:
        states = {t.trial_id: t.state for t in trials}
        raise RuntimeError(f"no trial of the search completed: {states}; see the logs in {path}")
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
    )


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
