"""Serve a model over HTTP with Ray Serve, and check that it answers.

``serve`` deploys one checkpoint; ``serve_production`` deploys the registry's production
version and keeps following the pointer, so a later promotion or rollback swaps the served
model without a redeploy.
"""

from __future__ import annotations

import os

import httpx
from prefect import task
from prefect.logging import get_run_logger

from ringflow.engine.cluster import connect
from ringflow.engine.serving import serve_model, serve_registry
from ringflow.models.digits import SCHEMA
from ringflow.storage.dataset import read_split
from ringflow.storage.fs import absolute, join

__all__ = ["serve", "serve_production"]


@task(name="serve")
def serve(model_uri: str, dataset_url: str, *, port: int) -> dict:
    """Deploy ``model_uri`` on the Ray cluster; return the endpoint and one real answer."""
    connect()
    endpoint = serve_model(model_uri, port=port)
    return _sample_answer(endpoint, dataset_url, served=model_uri)


@task(name="serve-production")
def serve_production(
    storage_url: str,
    dataset_url: str,
    *,
    port: int,
    model: str = "digits",
    poll_s: float = 1.0,
) -> dict:
    """Serve ``model``'s production version from ``{storage_url}/registry``, following the
    pointer every ``poll_s`` seconds; return the endpoint, the version and one real answer.

    Deploying again (the next flow run) is not needed for a new model: a promotion moves the
    pointer and the running replicas swap to it within ``poll_s``.
    """
    connect()
    registry_url = join(absolute(storage_url), "registry")
    endpoint = serve_registry(registry_url, model, port=port, poll_s=poll_s)
    return _sample_answer(endpoint, dataset_url, served=f"{registry_url}/{model} (production)")


def _sample_answer(endpoint: str, dataset_url: str, *, served: str) -> dict:
    pixels, labels = read_split(dataset_url, "test", SCHEMA)
    token = os.environ.get("RINGFLOW_SERVE_TOKEN", "").strip()
    reply = httpx.post(
        f"{endpoint}/predict",
        json={"pixels": pixels[0].tolist()},
        headers={"Authorization": f"Bearer {token}"} if token else {},
        timeout=30,
        trust_env=False,
    )
    reply.raise_for_status()
    answer = reply.json()
    version = answer.get("model", {}).get("version")
    get_run_logger().info(
        "serving %s at %s/predict (version %s); a test digit labelled %d was read as %s",
        served,
        endpoint,
        version,
        int(labels[0]),
        answer.get("digit"),
    )
    return {
        "endpoint": f"{endpoint}/predict",
        "model_version": version,
        "sample_label": int(labels[0]),
        "sample_prediction": answer.get("digit"),
    }
