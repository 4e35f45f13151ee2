"""``train-pipeline``: preprocess, tune, train on Ray workers, evaluate, promote and serve.

Run it locally with no server: ``python -m ringflow.flows.train_pipeline --help``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Failed
from pydantic import Field

from ringflow.storage import CheckpointStore, join
from ringflow.storage.fs import absolute
from ringflow.tasks import (
    demo_data,
    evaluate,
    preprocess,
    promote,
    register,
    report_resume,
    serve_production,
    train,
    tune,
    warm_start_checkpoint,
)

Positive = Annotated[int, Field(ge=1, le=1_000_000)]


@flow(
    name="train-pipeline",
    retries=1,
    retry_delay_seconds=10,
    persist_result=True,
    result_serializer="json",
)
def train_pipeline(
    data_url: str | None = None,
    storage_url: str = ".ringflow/storage",
    workers: Annotated[int, Field(ge=1, le=1024)] = 2,
    epochs: Annotated[int, Field(ge=1, le=100_000)] = 20,
    batch_size: Positive = 64,
    learning_rate: Annotated[float, Field(gt=0, le=10)] = 0.01,
    hidden: Annotated[int, Field(ge=1, le=65_536)] = 128,
    tune_trials: Annotated[int, Field(ge=0, le=1000)] = 8,
    tune_epochs: Annotated[int, Field(ge=1, le=100_000)] = 4,
    tune_space: dict | None = None,
    tune_algorithm: Literal["random", "evolution"] = "random",
    tune_max_concurrent: Annotated[int | None, Field(ge=1, le=1024)] = None,
    use_best_checkpoint: bool = False,
    serve: bool = True,
    serve_port: Annotated[int, Field(ge=1, le=65_535)] = 8000,
    seed: Annotated[int, Field(ge=0)] = 0,
    checkpoint_every: Annotated[int, Field(ge=0)] = 0,
    run_key: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")] = None,
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 3,
    min_workers: Annotated[int | None, Field(ge=1, le=1024)] = None,
    commit_every: Positive = 10,
    placement: Literal["pack", "spread", "strict_spread"] = "pack",
    cpus_per_worker: Annotated[float | None, Field(gt=0, le=1024)] = None,
    gpus_per_worker: Annotated[int, Field(ge=0, le=64)] = 0,
    pipeline_stages: Annotated[int, Field(ge=1, le=64)] = 1,
    micro_batches: Positive = 4,
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b",
    warm_start: bool = False,
    promotion_tolerance: Annotated[float, Field(ge=0, le=1)] = 0.0,
) -> dict:
    """Train the digits classifier end to end, promote it if it beats production, serve it.

    Args:
        data_url: CSV or Parquet file (any fsspec URL) with columns p0..p63 and label; empty
            means the bundled digits, dropped as a raw CSV under storage_url.
        storage_url: where datasets, checkpoints and the model registry go (any fsspec URL).
        workers: data-parallel Ray workers for training (pipeline replicas with stages).
        epochs: training epochs.
        batch_size: global batch size, split across the workers.
        learning_rate: Adam learning rate (the search starts from it).
        hidden: hidden-layer width (the search starts from it).
        tune_trials: hyperparameter-search trials; 0 skips the search.
        tune_epochs: epochs of each search trial (bad trials stop earlier).
        tune_space: the search space as JSON, e.g. {"lr": {"loguniform": [0.001, 0.1]},
            "hidden": [64, 128, 256]}; empty searches lr, hidden and batch_size around the
            values above.
        tune_algorithm: how trials are chosen: random (the base configuration first) or
            evolution (mutates the best so far).
        tune_max_concurrent: trials at once; empty means as many as the Ray cluster's CPUs.
        use_best_checkpoint: use the best trial's model as it is instead of training again.
        serve: serve the production model over HTTP with Ray Serve.
        serve_port: HTTP port of the served model on 127.0.0.1.
        seed: seeds data splits, weight initialisation and shuffling.
        checkpoint_every: checkpoint the training state every this many steps (0: at epoch
            ends only); a retried run resumes from the newest checkpoint.
        run_key: what checkpoints are kept under; empty means this flow run's id, which
            stays the same across its retries. Give the key of a killed local run to resume it.
        max_restarts: how often this flow run may start again after a failure or a crash
            (flow retries and automatic rescheduling together); a run started more often
            fails at once without training, which ends any crash loop.
        min_workers: training goes on after losing workers while this many remain; empty
            means all of them (a lost worker is replaced first).
        commit_every: steps between in-memory commits; a lost worker costs at most these.
        placement: workers on as few Ray nodes as possible (pack), on as many as possible
            (spread), or one per node (strict_spread).
        cpus_per_worker: CPUs each worker reserves; empty means 1 (a fair share of the
            cluster per pipeline stage).
        gpus_per_worker: GPUs each worker reserves; it trains on the first of them and
            gradients travel over NCCL. 0 trains on CPU. With pipeline_stages, each stage
            of each replica is a worker: workers x pipeline_stages x this many GPUs.
        pipeline_stages: split the model into this many pipeline stages (1: no pipeline).
        micro_batches: micro-batches per global batch and replica, with pipeline stages.
        pipeline_schedule: 1f1b (at most as many micro-batches in flight as stages) or gpipe.
        warm_start: start training from the production model's weights, if there is one.
        promotion_tolerance: promote a model whose test accuracy is at most this much below
            production's; otherwise production keeps its model.
    """
    attempt = flow_run.get_run_count() or 1
    if attempt > max_restarts + 1:
        return Failed(
            message=f"Not started again: this is start {attempt} of a run allowed "
            f"{max_restarts} restarts (raise max_restarts to allow more)"
        )
    _check(workers, batch_size, min_workers, pipeline_stages, micro_batches)
    storage_url = absolute(storage_url)
    run_key = run_key or str(flow_run.get_id() or "local")
    source = absolute(data_url) if data_url else demo_data(storage_url)
    dataset = preprocess(source, storage_url, seed=seed)
    hparams = {"lr": learning_rate, "hidden": hidden}
    common = {"run_key": run_key, "batch_size": batch_size, "seed": seed}
    best = None
    if tune_trials:
        best = tune(
            dataset["dataset_url"],
            storage_url,
            base_hparams=hparams,
            trials=tune_trials,
            epochs=tune_epochs,
            space=tune_space,
            algorithm=tune_algorithm,
            max_concurrent=tune_max_concurrent,
            **common,
        )
        hparams = best["best_hparams"]
        common.update({k: v for k, v in best["best_train"].items() if k in ("batch_size", "seed")})
        _check(
            workers,
            common["batch_size"],
            min_workers,
            pipeline_stages,
            micro_batches,
        )
    if use_best_checkpoint and best is not None:
        trained = {"checkpoint": best["best_checkpoint"], "resumed_from_step": None}
    else:
        # Listed before training, which may delete some (retention): the resume report uses them.
        checkpoints = CheckpointStore(join(storage_url, "checkpoints")).checkpoints(run_key)
        engine = {
            "workers": workers,
            "epochs": epochs,
            "batch_size": common["batch_size"],
            "seed": common["seed"],
            "checkpoint_every": checkpoint_every,
            "min_workers": min_workers,
            "commit_every": commit_every,
            "placement": placement,
            **({"cpus_per_worker": cpus_per_worker} if cpus_per_worker else {}),
            **({"gpus_per_worker": gpus_per_worker} if gpus_per_worker else {}),
        }
        pipeline = {
            "stages": pipeline_stages,
            "micro_batches": micro_batches,
            "schedule": pipeline_schedule,
        }
        trained = train(
            dataset["dataset_url"],
            storage_url,
            run_key=run_key,
            hparams=hparams,
            engine=engine,
            pipeline=pipeline if pipeline_stages > 1 else None,
            init_from=warm_start_checkpoint(storage_url) if warm_start else None,
        )
        if trained["resumed_from_step"] is not None:
            report_resume(checkpoints, run_key, trained["resumed_from_step"], attempt)
    test = evaluate(trained["checkpoint"], dataset["dataset_url"])
    version = register(
        trained["checkpoint"],
        storage_url,
        metrics=test,
        dataset_url=dataset["dataset_url"],
        run_key=run_key,
    )
    gate = promote(version["version"], storage_url, tolerance=promotion_tolerance)
    result = {
        "test_accuracy": test["test_accuracy"],
        "test_loss": test["test_loss"],
        "checkpoint": trained["checkpoint"],
        "model_uri": version["uri"],
        "model_version": version["version"],
        "promoted": gate["promoted"],
        "gate_reason": gate["reason"],
        "hparams": hparams,
        "dataset_url": dataset["dataset_url"],
        "rejected_rows": dataset["rejected_rows"],
        "run_key": run_key,
        "resumed_from_step": trained["resumed_from_step"],
        "run_count": attempt,
    }
    if best is not None:
        result["tune"] = {k: best[k] for k in ("best_metric", "base_metric", "best_trial")}
    if serve:
        served = serve_production(storage_url, dataset["dataset_url"], port=serve_port)
        served["served_version"] = served.pop("model_version")
        result.update(served)
    create_markdown_artifact(
        key="run-summary",
        markdown="| | |\n|---|---|\n" + "".join(f"| {k} | `{v}` |\n" for k, v in result.items()),
        description="What this run produced",
    )
    return result


def _check(
    workers: int,
    batch_size: int,
    min_workers: int | None,
    stages: int,
    micro_batches: int,
) -> None:
    """Combinations of parameters that no single parameter's bounds can refuse."""
    if batch_size < workers:
        raise ValueError(f"batch_size ({batch_size}) must be at least workers ({workers})")
    if min_workers is not None and min_workers > workers:
        raise ValueError(f"min_workers ({min_workers}) must not exceed workers ({workers})")
    if stages > 1 and batch_size < micro_batches * workers:
        raise ValueError(
            f"batch_size ({batch_size}) must be at least micro_batches x workers "
            f"({micro_batches} x {workers}): every micro-batch needs a sample"
        )


if __name__ == "__main__":
    from ringflow.flows.cli import main

    raise SystemExit(main(train_pipeline))
