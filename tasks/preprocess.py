"""Raw rows on any fsspec URL to validated train/validation/test Parquet shards."""

from __future__ import annotations

from dataclasses import asdict

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import INPUTS, RUN_ID, TASK_SOURCE
from prefect.logging import get_run_logger

from ringflow.models.digits import SCHEMA
from ringflow.storage.dataset import preprocess as preprocess_table


@task(
    name="preprocess",
    persist_result=True,
    result_serializer="json",
    # Keyed by the flow run too: a retried run reuses the result, a new run re-checks the data.
    cache_policy=INPUTS + TASK_SOURCE + RUN_ID,
)
def preprocess(data_url: str, storage_url: str, *, seed: int) -> dict:
    """Validate the raw rows at ``data_url`` and write the dataset under ``storage_url``."""
    logger = get_run_logger()
    result = preprocess_table(data_url, storage_url, SCHEMA, seed=seed)
    logger.info(
        "dataset %s: %s rows kept, %d rejected",
        result.dataset_url,
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
            f"**Dataset** `{result.dataset_url}`\n\n| split | rows |\n|---|---|\n"
            + "".join(f"| {k} | {v} |\n" for k, v in result.rows.items())
            + f"| rejected | {result.rejected_rows} |\n"
        ),
        description="Rows kept per split and rows rejected by validation",
    )
    return asdict(result)


@task(name="demo-data", persist_result=True, result_serializer="json")
def demo_data(storage_url: str) -> str:
    """Drop the bundled digits as a raw CSV under ``storage_url``, as a user's export would be."""
    from ringflow.models.digits import write_digits_csv
    from ringflow.storage.fs import exists, join

    url = join(storage_url, "raw", "digits.csv")
    if not exists(url):
        rows = write_digits_csv(url)
        get_run_logger().info("wrote the digits demo data (%d rows) to %s", rows, url)
    return url
