"""``train-pipeline``: preprocess, tune, train on Ray workers, evaluate, promote and serve.

The model is named by its import path (``model``) with its constructor's keywords
(``hparams``); the data is any CSV or Parquet (``data_url``) whose schema is read from the
file. Run it locally with no server: ``python -m ringflow.flows.train_pipeline --help``.

The flow's function comes first, undecorated, with only pydantic and the engine's
configuration (``engine.config``, which needs no torch) imported: run as a script,
the command line is checked against its signature before Prefect, Ray and torch are imported
(``flows/cli.py``). Imported as a module, it becomes the Prefect flow below.
"""

# ruff: noqa: E402 (Prefect and the tasks are imported after the command line's checks)
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ringflow.engine.config import TrainConfig

Positive = Annotated[int, Field(ge=1, le=1_000_000)]
DEMO_MODEL = "ringflow.models.digits:DigitsClassifier"
TRAINING = TrainConfig()
"""``training``'s default: TrainConfig's own (frozen, so one instance serves every run)."""


def train_pipeline(
    model: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")] = DEMO_MODEL,
    hparams: dict | None = None,
    model_name: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")] = None,
    data_url: str | None = None,
    label: str | None = None,
    features: list[str] | None = None,
    task: Literal["auto", "classification", "regression"] = "auto",
    bounds: dict | None = None,
    classes: Annotated[int | None, Field(ge=1)] = None,
    categorical: list[str] | None = None,
    preprocess_engine: Literal["auto", "local", "ray"] = "auto",
    storage_url: str = ".ringflow/storage",
    training: TrainConfig = TRAINING,
    tune_trials: Annotated[int, Field(ge=0, le=1000)] = 8,
    tune_epochs: Annotated[int, Field(ge=1, le=100_000)] = 4,
    tune_space: dict | None = None,
    tune_metric: str | None = None,
    tune_algorithm: Literal["random", "evolution"] = "random",
    tune_max_concurrent: Annotated[int | None, Field(ge=1, le=1024)] = None,
    tune_cpus_per_trial: Annotated[float | None, Field(gt=0, le=1024)] = None,
    tune_gpus_per_trial: Annotated[float, Field(ge=0, le=1)] = 0.0,
    use_best_checkpoint: bool = False,
    serve: bool = True,
    serve_port: Annotated[int, Field(ge=1, le=65_535)] = 8000,
    run_key: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")] = None,
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 3,
    pipeline_stages: Annotated[int, Field(ge=1, le=64)] = 1,
    micro_batches: Positive = 4,
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b",
    warm_start: bool = False,
    promotion_tolerance: Annotated[float, Field(ge=0, le=1)] = 0.0,
    allowed_models: list[Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")]]
    | None = None,
    loggers: list[Literal["csv", "tensorboard", "mlflow"]] | None = None,
) -> dict:
    """Train a model end to end, promote it if it beats production, serve it.

    Args:
        model: the LightningModule to train, as an import path 'package.module:ClassName'
            importable where the flow runs (and on the Ray workers).
        hparams: keyword arguments of the model's constructor, as a JSON object; input_dim
            and num_classes are set from the data where the constructor takes them.
        model_name: the model's name in the registry; empty means the class's model_name, or
            its name in snake case.
        data_url: CSV or Parquet file (any fsspec URL); empty means the model's own data
            where it has a train_dataloader() (trained as it is, evaluated on its own
            test_dataloader() or val_dataloader(); then tune_trials 0 and --no-serve), else
            its example data (its example_data hook), dropped under storage_url.
        label: the target column; empty means the model's data_defaults, else 'label'.
        features: the input columns; empty means every other column.
        task: classification or regression; auto reads it from the label column.
        bounds: accepted ranges by column, {"x1": [0, 1]}; rows outside are rejected.
        classes: classification: the number of classes (labels 0..classes-1).
        categorical: columns whose values are categories (strings) rather than numbers.
        preprocess_engine: where preprocessing runs: local (one process), ray (a Ray Data
            job on the cluster) or auto (Ray Data for 1 GiB of data or more, 64 MiB when
            RAY_ADDRESS names a cluster). Both write the same dataset.
        storage_url: where datasets, checkpoints and the model registry go (any fsspec URL).
        training: how the engine trains, as a JSON object of TrainConfig's fields (workers,
            epochs, batch_size, seed, precision, min_workers, checkpoint_every...: the
            reference lists them all); a field not given keeps its default. On the command
            line each field is an option of its own: --workers 4 --epochs 30.
        tune_trials: hyperparameter-search trials; 0 skips the search.
        tune_epochs: epochs of each search trial (bad trials stop earlier).
        tune_space: the search space as JSON over hparams keys and TrainConfig fields, e.g.
            {"lr": {"loguniform": [0.001, 0.1]}, "batch_size": [32, 64]}; empty means the
            model's search_space, else lr and batch_size around their values.
        tune_metric: what the search maximises (accuracy) or minimises (a loss); empty means
            val_accuracy for a classification whose model logs it, else val_loss.
        tune_algorithm: how trials are chosen: random (the base configuration first) or
            evolution (mutates the best so far).
        tune_max_concurrent: trials at once; empty means as many as the Ray cluster's CPUs
            (and GPUs) hold.
        tune_cpus_per_trial: CPUs each trial reserves, fractions allowed (0.5: two trials to
            a CPU); empty means one CPU.
        tune_gpus_per_trial: the share of a GPU each trial reserves and trains on (0.25: four
            trials to a GPU); 0 tunes on CPU.
        use_best_checkpoint: use the best trial's model as it is instead of training again.
        serve: serve the production model over HTTP with Ray Serve.
        serve_port: HTTP port of the served model on 127.0.0.1.
        run_key: what checkpoints are kept under; empty means this flow run's id, which
            stays the same across its retries. Give the key of a killed local run to resume it.
        max_restarts: how often this flow run may start again after a failure or a crash
            (flow retries and automatic rescheduling together); a run started more often
            fails at once without training, which ends any crash loop.
        pipeline_stages: split the model into this many pipeline stages (1: no pipeline).
        micro_batches: micro-batches per global batch and replica, with pipeline stages.
        pipeline_schedule: 1f1b (at most as many micro-batches in flight as stages) or gpipe.
        warm_start: start training from the production model's weights, if there is one.
        promotion_tolerance: promote a model whose test metric is at most this much worse
            than production's; otherwise production keeps its model.
        allowed_models: further model classes (import paths) that the promotion gate and the
            served model may load from the registry, besides model: the classes of earlier
            versions under the same model_name. A registry version naming any other class is
            never imported: the gate keeps production, the server keeps its version.
        loggers: Lightning loggers for what the model logs: csv and tensorboard write under
            storage_url's runs/<run key>/logs/, mlflow to MLFLOW_TRACKING_URI (needs mlflow).
    """
    refused = too_many_starts(max_restarts)
    if refused is not None:
        return refused
    attempt = flow_run.get_run_count() or 1
    parameters = {k: v for k, v in locals().items() if k not in ("attempt", "refused")}
    # The flow run's id stays the same across its retries and restarts.
    parameters["run_key"] = run_key or str(flow_run.get_id() or "local")
    try:
        spec = RunSpec.build(**parameters)
        spec.check_data()
        return _run(spec, attempt)
    except (ValueError, TypeError) as err:  # bad input (ModelError, DataError...): final
        return fail_at_once(err)


def preflight(parameters: dict) -> None:
    """The command line's second check, before Prefect or Ray starts: the run's parts built
    together (training options, the model and its keywords) and the data file's header
    against the label and features the run will use.

    Raises:
        ValueError: naming the parameter, the model or the file, and what to change.
    """
    from ringflow.flows.spec import RunSpec

    RunSpec.build(**parameters).check_data()


if __name__ == "__main__":
    from ringflow.flows.cli import main

    raise SystemExit(main(train_pipeline))

import logging
import os

from prefect import flow, get_client
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import FlowRunPolicy
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.states import Failed, State

from ringflow.engine.cluster import quiet_environment

# Before the tasks import Ray, which reads some settings only then. A private local Ray (no
# RAY_ADDRESS) gets token authentication, Ray's default, asked for by name: Ray then starts
# it without a warning on every run.
quiet_environment(**({} if os.environ.get("RAY_ADDRESS") else {"RAY_AUTH_MODE": "token"}))
# Serve says this at INFO whenever a run serves into the Serve instance an earlier run
# started; the options it keeps are the ones the run asked for (a different port is a
# separate warning, which stays).
logging.getLogger("ray.serve").addFilter(
    lambda record: "http_options/controller_options will not be applied" not in record.getMessage()
)

from ringflow.flows.logs import one_error_per_failure
from ringflow.flows.result import describe
from ringflow.flows.spec import RunSpec
from ringflow.storage import CheckpointStore
from ringflow.tasks import (
    evaluate,
    example_data,
    preprocess,
    promote,
    register,
    report_resume,
    serve_production,
    train,
    tune,
    warm_start_checkpoint,
)

one_error_per_failure()  # a failed run says why once, at ERROR
train_pipeline = flow(
    name="train-pipeline",
    retries=1,
    retry_delay_seconds=10,
    persist_result=True,
    result_serializer="json",
)(train_pipeline)


def too_many_starts(max_restarts: int) -> State | None:
    """A final Failed state for a flow run started more than ``max_restarts`` times again
    (flow retries and automatic rescheduling together), which ends any crash loop."""
    attempt = flow_run.get_run_count() or 1
    if attempt <= max_restarts + 1:
        return None
    return Failed(
        message=f"Not started again: this is start {attempt} of a run allowed "
        f"{max_restarts} restarts (raise max_restarts to allow more)"
    )


def fail_at_once(err: Exception) -> State:
    """A final Failed state saying why in one line: bad input, which no retry can fix.

    The flow run's retries are set to 0 first, so the server does not retry it.
    """
    message = " ".join(f"{type(err).__name__}: {err}".split())
    run_id = flow_run.get_id()
    if run_id is not None:
        with get_client(sync_client=True) as client:
            client.update_flow_run(run_id, empirical_policy=FlowRunPolicy(retries=0))
    get_run_logger().error("%s", message)
    return Failed(message=message)


def publish_summary(result: dict[str, Any]) -> None:
    """The run's result as a ``run-summary`` artifact."""
    create_markdown_artifact(
        key="run-summary",
        markdown="| | |\n|---|---|\n" + "".join(f"| {k} | `{v}` |\n" for k, v in result.items()),
        description="What this run produced",
    )


def _dataset(spec: RunSpec) -> dict:
    """The preprocessed dataset (``preprocess``'s record) of the data file, or of the model's
    example data; none (``dataset_url`` ``None``) for a model that makes its own data."""
    if spec.own_data:
        return {"dataset_url": None, "task": None, "rejected_rows": 0}
    return preprocess(
        spec.data_url or example_data(spec.model, spec.storage_url),
        spec.storage_url,
        **spec.data,
        seed=spec.config.seed,
        engine=spec.preprocess_engine,
    )


def _run(spec: RunSpec, attempt: int) -> dict:
    """The pipeline itself: every task in order, each given the typed parts it needs."""
    dataset = _dataset(spec)
    model, config, best = spec.model, spec.config, None
    if spec.tune:
        best = tune(
            model, dataset["dataset_url"], spec.storage_url, run_key=spec.run_key, **spec.tune
        )
        model, config = spec.tuned(best)
    if spec.use_best_checkpoint and best is not None:
        trained = {"checkpoint": best["best_checkpoint"], "resumed_from_step": None}
    else:
        # Listed before training, which may delete some (retention): the resume report uses them.
        checkpoints = CheckpointStore(spec.workspace.checkpoints).checkpoints(spec.run_key)
        trained = train(
            model,
            dataset["dataset_url"],
            spec.storage_url,
            run_key=spec.run_key,
            config=config,
            pipeline=spec.pipeline,
            init_from=warm_start_checkpoint(spec.storage_url, spec.model_name)
            if spec.warm_start
            else None,
            loggers=spec.loggers,
            model_name=spec.model_name,
        )
        if trained["resumed_from_step"] is not None:
            report_resume(checkpoints, spec.run_key, trained["resumed_from_step"], attempt)
    test = evaluate(trained["checkpoint"], dataset["dataset_url"], model=model.path)
    version = register(
        trained["checkpoint"],
        spec.storage_url,
        metrics=test,
        dataset_url=dataset["dataset_url"],
        data_fingerprint=f"module:{model.path}" if spec.own_data else None,
        run_key=spec.run_key,
        model=spec.model_name,
    )
    gate = (
        promote(
            version["version"],
            spec.storage_url,
            model=spec.model_name,
            allowed=spec.allowed_models,
            tolerance=spec.tolerance,
        )
        if test
        else {"promoted": False, "reason": "no test metrics to judge it by: production stays"}
    )
    result = {
        **test,
        "model": model.path,
        "hparams": model.hparams,
        "model_name": spec.model_name,
        "checkpoint": trained["checkpoint"],
        "model_uri": version["uri"],
        "model_version": version["version"],
        "promoted": gate["promoted"],
        "gate_reason": gate["reason"],
        "dataset_url": dataset["dataset_url"],
        "task": dataset["task"],
        "rejected_rows": dataset["rejected_rows"],
        "run_key": spec.run_key,
        "resumed_from_step": trained["resumed_from_step"],
        "run_count": attempt,
        "dashboard": trained.get("dashboard"),
        "worker_logs": trained.get("worker_logs", []),
    }
    if best is not None:
        result["tune"] = {k: best[k] for k in ("best_metric", "base_metric", "best_trial")}
        result["tune"]["best_params"] = best["best_params"]
    if spec.serve:
        served = serve_production(
            spec.storage_url,
            dataset["dataset_url"],
            port=spec.serve_port,
            model=spec.model_name,
            model_path=model.path,
            allowed=spec.allowed_models,
        )
        served["served_version"] = served.pop("model_version")
        result.update(served)
    publish_summary(result)
    get_run_logger().info("result: %s", "; ".join(" ".join(ln.split()) for ln in describe(result)))
    return result
