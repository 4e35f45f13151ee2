"""This project's own Prefect tasks: the raw export, then feature engineering.

Both write under the pipeline's ``storage_url`` (any fsspec URL pandas can write) and return
the URL of what they wrote, which ringflow's ``preprocess`` then validates.
"""

from __future__ import annotations

import os

import pandas as pd
from prefect import task
from prefect.logging import get_run_logger

RATIOS = {
    "flavanoid_share": ("flavanoids", "total_phenols"),
    "colour_per_hue": ("color_intensity", "hue"),
}
"""New columns, each the ratio of two measured ones."""


def _url(storage_url: str, *parts: str) -> str:
    base = storage_url if "://" in storage_url else os.path.abspath(storage_url)
    return "/".join([base.rstrip("/"), *parts])


@task(name="prepare-wine")
def prepare_wine(storage_url: str) -> str:
    """scikit-learn's bundled wine data as the CSV a lab would export: 178 wines, 13
    measurements, and the ``cultivar`` (0, 1 or 2)."""
    from sklearn.datasets import load_wine

    frame = load_wine(as_frame=True).frame
    frame = frame.rename(
        columns={"od280/od315_of_diluted_wines": "od280_od315", "target": "cultivar"}
    )
    url = _url(storage_url, "raw", "wine.csv")
    if "://" not in url:
        os.makedirs(os.path.dirname(url), exist_ok=True)
    frame.to_csv(url, index=False)
    return url


@task(name="add-ratios")
def add_ratios(source_url: str, storage_url: str) -> str:
    """The table at ``source_url`` with the :data:`RATIOS` columns added, as Parquet."""
    frame = pd.read_csv(source_url)
    for name, (top, bottom) in RATIOS.items():
        frame.insert(len(frame.columns) - 1, name, (frame[top] / frame[bottom]).round(4))
    url = _url(storage_url, "features", "wine.parquet")
    if "://" not in url:
        os.makedirs(os.path.dirname(url), exist_ok=True)
    frame.to_parquet(url, index=False)
    get_run_logger().info("added %s to %d rows: %s", sorted(RATIOS), len(frame), url)
    return url
