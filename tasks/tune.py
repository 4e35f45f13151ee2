"""A small hyperparameter search over learning rate and width, with Ray Tune."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger

from engine import DataSpec
from engine.cluster import connect
from engine.tuning import search
from models.digits import SCHEMA, DigitsClassifier
from storage import join
from tasks.report import trial_curves, trial_table

METRIC = "val_accuracy"


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
) -> dict:
    """Search around ``base_hparams``; return the best hyperparameters and their metric."""
    connect()
    lr, hidden = base_hparams["lr"], base_hparams["hidden"]
    result = search(
        DigitsClassifier,
        base_hparams=base_hparams,
        space={
            "lr": {"loguniform": [lr / 10, lr * 3]},
            "hidden": sorted({max(1, hidden // 2), hidden, hidden * 2}),
        },
        data=DataSpec(dataset_url=dataset_url, schema=SCHEMA),
        trials=trials,
        epochs=epochs,
        batch_size=batch_size,
        storage_url=join(storage_url, "runs", run_key),
        metric=METRIC,
        seed=seed,
    )
    get_run_logger().info("best %s=%.4f with %s", METRIC, result.best_metric, result.best_params)
    trial_table(result.trials, metric=METRIC, key="tuning-trials")
    trial_curves(result.trials, metric=METRIC, key="tuning-curves")
    create_markdown_artifact(
        key="best-hyperparameters",
        markdown="| hyperparameter | value |\n|---|---|\n"
        + "".join(f"| {k} | {v} |\n" for k, v in result.best_params.items())
        + f"| {METRIC} | {result.best_metric:.4f} |\n",
        description="The configuration the search chose",
    )
    return {"best_params": result.best_params, "best_metric": result.best_metric}
