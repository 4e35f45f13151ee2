"""Raw rows on any fsspec URL to validated train/validation/test Parquet shards."""

from __future__ import annotations

from dataclasses import asdict

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import INPUTS, RUN_ID, TASK_SOURCE
from prefect.logging import get_run_logger

from ringflow.engine.cluster import connect
from ringflow.engine.errors import ModelError
from ringflow.engine.spec import ModelRef
from ringflow.storage.dataset import TableSchema, choose_engine, infer_schema
from ringflow.storage.dataset import preprocess as preprocess_table
from ringflow.storage.layout import Workspace

__all__ = ["example_data", "preprocess"]


@task(
    name="preprocess",
    persist_result=True,
    result_serializer="json",
    # Keyed by the flow run too: a retried run reuses the result, a new run re-checks the data
    # (and finds the committed dataset by its content hash, without writing it again).
    cache_policy=INPUTS + TASK_SOURCE + RUN_ID,
)
def preprocess(
    data_url: str,
    storage_url: str,
    *,
    label: str = "label",
    features: list[str] | None = None,
    task: str | None = None,
    bounds: dict[str, list[float | None]] | None = None,
    classes: int | None = None,
    categorical: list[str] | None = None,
    seed: int = 0,
    engine: str = "auto",
) -> dict:
    """Validate the rows at ``data_url`` and write the dataset under ``storage_url``.

    The schema is read from the file: ``label`` names the target column, ``features`` the
    inputs (default: every other column); ``task`` (classification or regression), ``bounds``
    ({column: [min, max]}), ``classes`` and ``categorical`` columns are inferred unless given.
    Rows that fail it are kept aside with their reasons. ``engine`` says where the work runs:
    ``"local"`` in this process, ``"ray"`` as a Ray Data job on the cluster ``RAY_ADDRESS``
    names (else a private local Ray), ``"auto"`` by the data's size and ``RAY_ADDRESS``
    (``storage.dataset.choose_engine``); both write the same dataset.

    Returns:
        ``dataset_url``, ``rows`` per split, ``rejected_rows``, ``rejected_url``, ``task``.
    """
    logger = get_run_logger()
    schema = infer_schema(
        data_url,
        label=label,
        features=features,
        task=task,
        bounds=bounds,
        classes=classes,
        categorical=categorical,
    )
    where = choose_engine(data_url, engine)
    result = _run(data_url, storage_url, schema, seed=seed, engine=where)
    logger.info(
        "dataset %s (%s of %s on %d features, preprocessed %s): %s rows kept, %d rejected",
        result.dataset_url,
        schema.task,
        label,
        schema.input_dim,
        "with Ray Data" if where == "ray" else "in one process",
        result.rows,
        result.rejected_rows,
    )
    if result.rejected_rows:
        logger.warning(
            "%d of %d rows failed validation; they are in %s with the reason for each",
            result.rejected_rows,
            result.source_rows,
            result.rejected_url,
        )
    create_markdown_artifact(
        key="dataset",
        markdown=(
            f"**Dataset** `{result.dataset_url}`: {schema.task} of `{label}` on "
            f"{schema.input_dim} features\n\n| split | rows |\n|---|---|\n"
            + "".join(f"| {k} | {v} |\n" for k, v in result.rows.items())
            + f"| rejected | {result.rejected_rows} |\n"
        ),
        description="Rows kept per split and rows rejected by validation",
    )
    return {**asdict(result), "task": schema.task}


@task(name="example-data", persist_result=True, result_serializer="json")
def example_data(model: ModelRef, storage_url: str) -> str:
    """The example data a model ships (its ``example_data`` hook), dropped under
    ``{storage_url}/raw`` as a user's export would be; for runs given no ``data_url``."""
    hook = getattr(model.resolve(), "example_data", None)
    if not callable(hook):
        raise ModelError(
            f"data_url is required: model {model.path} ships no example data "
            "(an example_data(directory_url, hparams) hook)"
        )
    url = hook(Workspace(storage_url).raw, dict(model.hparams))
    get_run_logger().info("example data of %s: %s", model.path, url)
    return url


def _run(data_url: str, storage_url: str, schema: TableSchema, *, seed: int, engine: str):
    """``storage.dataset.preprocess`` where ``engine`` says. A connection to Ray opened here
    for Ray Data is closed again afterwards: training and serving connect with the model's
    code for the workers (``engine.cluster.connect(model=...)``), which a connection left
    open without it would keep out of their jobs."""
    datasets = Workspace(storage_url).datasets
    if engine != "ray":
        return preprocess_table(data_url, datasets, schema, seed=seed, engine=engine)
    import ray

    opened = not ray.is_initialized()
    connect()
    try:
        return preprocess_table(data_url, datasets, schema, seed=seed, engine=engine)
    finally:
        if opened:
            ray.shutdown()
