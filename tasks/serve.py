"""Serve a model over HTTP with Ray Serve, and check that it answers.

``serve`` deploys one checkpoint; ``serve_production`` deploys the registry's production
version and keeps following the pointer, so a later promotion or rollback swaps the served
model without a redeploy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import httpx
import numpy as np
from prefect import task
from prefect.logging import get_run_logger

from ringflow.engine.cluster import connect
from ringflow.storage.dataset import DataError, TableSchema, dataset_schema
from ringflow.storage.layout import Workspace
from ringflow.storage.stream import ParquetSplit

__all__ = ["serve", "serve_production"]


@task(name="serve")
def serve(model_uri: str, dataset_url: str, *, port: int, model: str) -> dict:
    """Deploy ``model_uri`` on the Ray cluster; return the endpoint and one real answer.

    ``model`` is the model's import path: the only class the checkpoint may hold, and code
    that travels with the job where the cluster does not have it installed
    (``engine.cluster.connect``)."""
    from ringflow.serving import serve_model  # Ray Serve: imported by a run that serves

    connect(model=model)
    endpoint = serve_model(model_uri, port=port, allowed=[model])
    return _sample_answer(endpoint, dataset_url, served=model_uri)


@task(name="serve-production")
def serve_production(
    storage_url: str,
    dataset_url: str,
    *,
    port: int,
    model: str,
    model_path: str,
    allowed: Sequence[str] = (),
    poll_s: float = 1.0,
) -> dict:
    """Serve the production version of the model named ``model`` from
    ``{storage_url}/registry``, following the pointer every ``poll_s`` seconds; return the
    endpoint, the version and one real answer (to a row of the dataset's test split).

    A promotion moves the pointer and the running replicas swap to it within ``poll_s``. So
    when the next flow run gets here and finds this same deployment up, it does not
    redeploy. It returns once the app answers with the production version, and no request
    fails on the way (``serving.serve_registry``).

    The replicas load only checkpoints of ``model_path`` (the class's import path) or of a
    class in ``allowed``: a version naming any other class is logged and skipped, never
    imported, and the served version keeps answering.
    """
    from ringflow.serving import serve_registry  # Ray Serve: imported by a run that serves

    connect(model=model_path)
    registry_url = Workspace(storage_url).registry
    endpoint = serve_registry(
        registry_url,
        model,
        allowed=list(dict.fromkeys([model_path, *allowed])),
        port=port,
        poll_s=poll_s,
    )
    return _sample_answer(endpoint, dataset_url, served=f"{registry_url}/{model} (production)")


def _first_test_row(dataset_url: str, schema: TableSchema) -> tuple[np.ndarray, np.generic]:
    """``(features, label)`` of the test split's first row, read from the row group it lies
    in (checked against the manifest), never the whole split.

    Raises:
        DataError: the test split has no rows.
    """
    split = ParquetSplit(dataset_url, "test", schema)
    block = next((b for b, rows in enumerate(split.blocks) if rows), None)
    if block is None:
        raise DataError(
            f"the test split of {dataset_url} has no rows to ask the served model about; "
            "preprocess with a test fraction above 0"
        )
    features, labels = split.read(block)
    return features[0], labels[0]


def _sample_answer(endpoint: str, dataset_url: str, *, served: str) -> dict:
    """Ask the served model about the first test row, sent as a plain array in schema order
    (category values by name), which every served model accepts."""
    schema = dataset_schema(dataset_url)
    features, label = _first_test_row(dataset_url, schema)
    instance = [
        column.categories[int(value)] if column.categories else value
        for column, value in zip(schema.features, features.tolist(), strict=True)
    ]
    token = os.environ.get("RINGFLOW_SERVE_TOKEN", "").strip()
    reply = httpx.post(
        f"{endpoint}/predict",
        json={"instances": [instance]},
        headers={"Authorization": f"Bearer {token}"} if token else {},
        timeout=30,
        trust_env=False,
    )
    reply.raise_for_status()
    answer = reply.json()
    prediction = answer["predictions"][0]
    version = answer.get("model", {}).get("version")
    label = label.item()
    get_run_logger().info(
        "serving %s at %s/predict (version %s); a test row with %s %s was answered %s",
        served,
        endpoint,
        version,
        schema.label.name,
        label,
        prediction,
    )
    return {
        "endpoint": f"{endpoint}/predict",
        "model_version": version,
        "sample_label": label,
        "sample_prediction": prediction,
    }
