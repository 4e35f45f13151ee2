"""Hyperparameter search over a declared space with Ray Tune, resumable under the run key."""

from __future__ import annotations

import inspect
from typing import Any

from prefect import task
from prefect.logging import get_run_logger

from ringflow.engine import DataSpec, TrainConfig
from ringflow.engine.cluster import connect
from ringflow.engine.spec import ModelRef
from ringflow.tasks.report import best_configuration, trial_curves, trial_table
from ringflow.tuning.run import SearchConfig, reported_metrics, search
from ringflow.tuning.space import TUNABLE_CONFIG


def default_space(model: ModelRef, config: TrainConfig) -> dict[str, Any]:
    """The model's own ``search_space`` if it declares one, else its learning rate (a
    constructor keyword ``lr``) around its value; always the batch size around the base (the
    batch per worker under weak scaling, ``per_worker_batch_size``)."""
    cls = model.resolve()
    declared = getattr(cls, "search_space", None)
    space: dict[str, Any] = dict(declared) if isinstance(declared, dict) else {}
    lr = inspect.signature(cls).parameters.get("lr")
    if not space and lr is not None:
        base = model.hparams.get("lr", lr.default)
        if isinstance(base, int | float) and base > 0:
            space["lr"] = {"loguniform": [base / 10, base * 10]}
    name = "batch_size" if config.per_worker_batch_size is None else "per_worker_batch_size"
    batch = getattr(config, name)
    if "batch_size" not in space and "per_worker_batch_size" not in space:
        space[name] = sorted({max(1, batch // 2), batch, batch * 2})
    return space


@task(name="tune")
def tune(
    model: ModelRef,
    dataset_url: str,
    storage_url: str,
    *,
    run_key: str,
    config: TrainConfig,
    trials: int,
    epochs: int,
    space: dict | None = None,
    algorithm: str = "random",
    metric: str | None = None,
    mode: str | None = None,
    max_concurrent: int | None = None,
    workers_per_trial: int = 1,
    cpus_per_trial: float | None = None,
    gpus_per_trial: float = 0.0,
) -> dict:
    """Search ``space`` (default: :func:`default_space`) around ``model`` and ``config``.

    ``space`` names constructor keywords of the model and ``TrainConfig`` fields alike. The
    metric defaults to ``val_accuracy`` (max) for a classification whose model logs it, else
    ``val_loss`` (min). A retried flow run (same run key) continues the search it started.

    Returns:
        ``best_params`` (every searched name), split into ``best_hparams`` (model keywords,
        merged over ``model.hparams``) and ``best_train`` (``TrainConfig`` fields, to apply
        with ``dataclasses.replace``); ``best_metric``, ``base_metric``, ``best_checkpoint``
        (the best trial's trained model) and ``trials`` (one row per trial).
    """
    data = DataSpec(dataset_url=dataset_url)
    metric, mode = _metric(model, data, config, metric, mode)
    space = space or default_space(model, config)
    search_config = SearchConfig(
        trials=trials,
        epochs=epochs,
        metric=metric,
        mode=mode,
        algorithm=algorithm,
        max_concurrent=max_concurrent,
        workers_per_trial=workers_per_trial,
        cpus_per_trial=cpus_per_trial,
        gpus_per_trial=gpus_per_trial,
        checkpoint_every=config.checkpoint_every,
    )
    connect(model=model.path)
    logger = get_run_logger()
    result = search(
        model.resolve(),
        base_hparams=model.hparams,
        space=space,
        data=data,
        train_config=config.with_workers(1),
        storage_url=storage_url,
        run_key=run_key,
        config=search_config,
        progress=logger.info,
    )
    if result.ignored_files:
        logger.warning(
            "ignored %d files under %s that ringflow did not write (it never unpickles what "
            "storage holds; someone with write access to the bucket may have put them there): %s",
            len(result.ignored_files),
            result.experiment_path,
            ", ".join(result.ignored_files),
        )
    if result.resumed:
        logger.warning("continued the interrupted search of run %s", run_key)
    logger.info("best %s=%.4f with %s", metric, result.best_metric, result.best_params)
    trial_table(result.trials, metric=metric, key="tuning-trials")
    trial_curves(result.trials, metric=metric, key="tuning-curves")
    best_configuration(result, metric=metric, key="best-hyperparameters")
    return {
        "best_params": result.best_params,
        "best_hparams": {
            **model.hparams,
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


def _metric(
    model: ModelRef, data: DataSpec, config: TrainConfig, metric: str | None, mode: str | None
) -> tuple[str, str]:
    """The search's metric: given, else ``val_accuracy`` for a classification whose model
    logs it, else ``val_loss``; maximised for accuracy, minimised for a loss."""
    if metric is None:
        metric = "val_loss"
        if data.schema.task == "classification":
            known = reported_metrics(model.resolve(), model.hparams, data, config)
            metric = "val_accuracy" if "val_accuracy" in known else "val_loss"
    if mode is None:
        mode = "min" if metric.endswith("loss") else "max"
    return metric, mode
