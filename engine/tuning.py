"""Hyperparameter search with Ray Tune; every trial trains through ``engine.fit``."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from typing import Any

from engine.config import DataSpec, TrainConfig
from engine.trainer import fit
from storage.fs import join, resolve

__all__ = ["SearchResult", "TrialSummary", "search"]


@dataclass(frozen=True, kw_only=True)
class TrialSummary:
    """One trial as the search ended it."""

    trial_id: str
    params: dict[str, Any]
    metric: float | None
    """The last value of the searched metric the trial reported."""
    epochs: int
    """Epochs the trial ran before it finished or was stopped."""
    state: str
    """``completed``, ``stopped early`` or ``failed``."""
    curve: list[float] = field(default_factory=list)
    """The metric after every epoch."""


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    best_params: dict[str, Any]
    best_metric: float
    trials: list[TrialSummary]


def search(
    module_cls: type,
    *,
    base_hparams: dict[str, Any],
    space: dict[str, Any],
    data: DataSpec,
    trials: int,
    epochs: int,
    batch_size: int,
    storage_url: str,
    metric: str = "val_accuracy",
    mode: str = "max",
    seed: int = 0,
    max_concurrent: int | None = None,
) -> SearchResult:
    """Search ``space`` with ASHA early stopping; each trial is a one-worker ``fit``.

    Args:
        space: hyperparameter name to a list of choices, ``{"loguniform": [low, high]}`` or
            ``{"uniform": [low, high]}``. Every name must be a keyword ``module_cls`` takes.
        trials: number of sampled configurations.
        metric, mode: what to optimise; ``metric`` must be one the module logs.
        max_concurrent: trials at once; defaults to the Ray cluster's CPUs, so trials never
            oversubscribe the machine.

    Raises:
        ValueError: an empty space, an unknown hyperparameter or metric, a bad ``mode``.
    """
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    _check_search(module_cls, base_hparams, space, trials, mode)
    config = TrainConfig(workers=1, epochs=epochs, batch_size=batch_size, seed=seed)
    _check_metric(module_cls, base_hparams, data, config, metric)
    trial_root = join(storage_url, "trials")

    def trainable(params: dict[str, Any]) -> None:
        trial_id = tune.get_context().get_trial_id()
        fit(
            module_cls,
            hparams={**base_hparams, **params},
            data=data,
            config=config,
            checkpoint_uri=join(trial_root, trial_id),
            in_process=True,
            on_epoch=lambda m: tune.report(m.metrics),
        )

    tuner = tune.Tuner(
        trainable,
        param_space={name: _domain(tune, name, spec) for name, spec in space.items()},
        tune_config=tune.TuneConfig(
            metric=metric,
            mode=mode,
            num_samples=trials,
            scheduler=ASHAScheduler(max_t=epochs, grace_period=1, reduction_factor=2),
            # The base configuration is always one of the trials, so the search can only
            # match or beat what the user would have trained without it.
            search_alg=BasicVariantGenerator(
                points_to_evaluate=[
                    {name: base_hparams[name] for name in space if name in base_hparams}
                ],
                random_state=seed,
                max_concurrent=max_concurrent or _cluster_cpus(),
            ),
        ),
        run_config=tune.RunConfig(storage_path=_tune_dir(storage_url), verbose=0),
    )
    results = tuner.fit()
    summaries = [_summary(r, metric, epochs) for r in results]
    best = results.get_best_result(metric=metric, mode=mode, scope="last")
    return SearchResult(
        best_params={name: best.config[name] for name in space},
        best_metric=float(best.metrics[metric]),
        trials=summaries,
    )


def _check_search(module_cls: type, base: dict, space: dict, trials: int, mode: str) -> None:
    if not space:
        raise ValueError("the search space is empty: give at least one hyperparameter to search")
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    for name, spec in space.items():
        sample = spec[0] if isinstance(spec, list) else next(iter(spec.values()))[0]
        try:
            module_cls(**{**base, name: sample})
        except TypeError as err:
            raise ValueError(
                f"search space names {name!r}, which {module_cls.__name__} does not take: {err}"
            ) from err


def _check_metric(
    module_cls: type, base: dict, data: DataSpec, config: TrainConfig, metric: str
) -> None:
    """Evaluate an untrained module once, so a metric no trial reports fails before trials."""
    from engine.worker import RankWorker

    worker = RankWorker(module_cls, hparams=base, data=data, config=config, rank=0)
    reported, _ = worker.evaluate("validation")
    if metric not in reported and metric not in ("train_loss",):
        raise ValueError(
            f"metric {metric!r} is not reported by {module_cls.__name__}; "
            f"it reports {sorted(reported) + ['train_loss']}"
        )


def _domain(tune: Any, name: str, spec: Any) -> Any:
    if isinstance(spec, list) and spec:
        return tune.choice(spec)
    if isinstance(spec, dict) and len(spec) == 1:
        kind, bounds = next(iter(spec.items()))
        if kind in ("uniform", "loguniform") and len(bounds) == 2 and bounds[0] < bounds[1]:
            return getattr(tune, kind)(*bounds)
    raise ValueError(
        f"search space entry {name!r} must be a non-empty list of choices or "
        f"{{'uniform' | 'loguniform': [low, high]}} with low < high; got {spec!r}"
    )


def _summary(result: Any, metric: str, epochs: int) -> TrialSummary:
    frame = result.metrics_dataframe
    curve = [] if frame is None or metric not in frame else [float(v) for v in frame[metric]]
    ran = len(curve)
    state = "failed" if result.error else "completed" if ran >= epochs else "stopped early"
    value = curve[-1] if curve else None
    return TrialSummary(
        trial_id=str(result.metrics.get("trial_id", result.path.rsplit("/", 1)[-1])),
        params=dict(result.config),
        metric=None if value is None or math.isnan(value) else value,
        epochs=ran,
        state=state,
        curve=curve,
    )


def _cluster_cpus() -> int:
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _tune_dir(storage_url: str) -> str:
    """Ray Tune keeps its experiment state on a local path; object stores get a temp dir."""
    fs, path = resolve(storage_url)
    if "local" in fs.protocol or "file" in fs.protocol:
        return join(path, "tune")
    return tempfile.mkdtemp(prefix="ringflow-tune-")
