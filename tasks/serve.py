"""Serve the published model over HTTP with Ray Serve, and check that it answers."""

from __future__ import annotations

import httpx
from prefect import task
from prefect.logging import get_run_logger

from engine.cluster import connect
from engine.serving import serve_model
from models.digits import SCHEMA
from storage.dataset import read_split


@task(name="serve")
def serve(model_uri: str, dataset_url: str, *, port: int) -> dict:
    """Deploy ``model_uri`` on the Ray cluster; return the endpoint and one real answer."""
    connect()
    endpoint = serve_model(model_uri, port=port)
    pixels, labels = read_split(dataset_url, "test", SCHEMA)
    reply = httpx.post(f"{endpoint}/predict", json={"pixels": pixels[0].tolist()}, timeout=30)
    reply.raise_for_status()
    answer = reply.json()
    get_run_logger().info(
        "serving %s at %s/predict; a test digit labelled %d was read as %s",
        model_uri,
        endpoint,
        int(labels[0]),
        answer.get("digit"),
    )
    return {
        "endpoint": f"{endpoint}/predict",
        "sample_label": int(labels[0]),
        "sample_prediction": answer.get("digit"),
    }
