"""Hyperparameter search over a declared space with Ray Tune, resumable under the run key."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.logging import get_run_logger

from ringflow.engine import DataSpec, TrainConfig
from ringflow.engine.cluster import connect
from ringflow.engine.tuning import TUNABLE_CONFIG, SearchConfig, search
from ringflow.models.digits import SCHEMA, DigitsClassifier
from ringflow.tasks.report import best_configuration, trial_curves, trial_table


def default_space(base_hparams: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """What a user of the digits demo tunes: learning rate, width and batch around the base."""
    lr, hidden = base_hparams["lr"], base_hparams["hidden"]
    return {
        "lr": {"loguniform": [lr / 10, lr * 10]},
        "hidden": sorted({max(1, hidden // 2), hidden, hidden * 2}),
        "batch_size": sorted({max(1, batch_size // 2), batch_size, batch_size * 2}),
    }


@task(name="tune")
def tune(
    dataset_url: str,
    storage_url: str,
    *,
    run_key: str,
    base_hparams: dict,
    trials: int,
    epochs: int,
    batch_size: int,
    seed: int,
    space: dict | None = None,
    algorithm: str = "random",
    metric: str = "val_accuracy",
    mode: str = "max",
    max_concurrent: int | None = None,
    workers_per_trial: int = 1,
) -> dict:
    """Search ``space`` (default: :func:`default_space`) around ``base_hparams``.

    A retried flow run (same run key) continues the search it started: finished trials are
    kept and unfinished ones resume from their checkpoints.

    Returns:
        ``best_params`` (every searched name), split into ``best_hparams`` (model keywords,
        merged over ``base_hparams``) and ``best_train`` (``TrainConfig`` fields such as
        ``batch_size``); ``best_metric``, ``base_metric``, ``best_checkpoint`` (the best
        trial's trained model) and ``trials`` (one row per trial).
    """
    space = space or default_space(base_hparams, batch_size)
    config = SearchConfig(
        trials=trials,
        epochs=epochs,
        metric=metric,
        mode=mode,
        algorithm=algorithm,
        max_concurrent=max_concurrent,
        workers_per_trial=workers_per_trial,
    )
    connect()
    result = search(
        DigitsClassifier,
        base_hparams=base_hparams,
        space=space,
        data=DataSpec(dataset_url=dataset_url, schema=SCHEMA),
        train_config=TrainConfig(workers=1, batch_size=batch_size, seed=seed),
        storage_url=storage_url,
        run_key=run_key,
        config=config,
    )
    logger = get_run_logger()
    if result.resumed:
        logger.warning("continued the interrupted search of run %s", run_key)
    logger.info("best %s=%.4f with %s", metric, result.best_metric, result.best_params)
    trial_table(result.trials, metric=metric, key="tuning-trials")
    trial_curves(result.trials, metric=metric, key="tuning-curves")
    best_configuration(result, metric=metric, key="best-hyperparameters")
    return {
        "best_params": result.best_params,
        "best_hparams": {
            **base_hparams,
            **{k: v for k, v in result.best_params.items() if k not in TUNABLE_CONFIG},
        },
        "best_train": {k: v for k, v in result.best_params.items() if k in TUNABLE_CONFIG},
        "best_metric": result.best_metric,
        "base_metric": result.base_metric,
        "best_checkpoint": result.best_checkpoint,
        "best_trial": result.best_trial,
        "resumed": result.resumed,
        "trials": [
            {"trial": t.trial_id, "state": t.state, "epochs": t.epochs, "metric": t.metric}
            for t in result.trials
        ],
    }
