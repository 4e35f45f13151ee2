"""Training from a Ray Dataset against training from the same Parquet files as a ``DataSpec``.

Both train the same MLP with ``--workers`` workers for one epoch over the training split of a
dataset written by ``bench.make_parquet``: once with ``DataSpec(stream=True)`` (our streaming
reader), once with ``RayDatasetData(train=ray.data.read_parquet(<the train shards>),
validation=..., schema=<the dataset's>)`` (each worker reading its ``streaming_split``). It
prints, for each, the epoch's seconds, samples per second (all workers together) and each
worker's peak resident memory, then one JSON line with ``ray_dataset_vs_dataspec`` (the ratio
of samples per second).

Ray gets one CPU more than the workers reserve: Ray Data's read tasks need one.

    python -m bench.make_parquet /tmp/ringflow-bench --gb 0.1     # prints the dataset URL
    python -m bench.ray_dataset_input <dataset_url>
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from typing import Any

from bench import headline_json
from bench.input_pipeline import _RSS_DIR, RssDigits

HEADLINE = ("ray_dataset_vs_dataspec",)
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""


def _shards(dataset_url: str, split: str) -> list[str]:
    from ringflow.storage.dataset import split_shards
    from ringflow.storage.fs import join

    _, shards = split_shards(dataset_url, split)
    return [join(dataset_url, f["path"]) for f in shards]


def _rows(dataset_url: str) -> int:
    from ringflow.storage.dataset import split_shards

    return sum(f["rows"] for f in split_shards(dataset_url, "train")[1])


def _data(kind: str, dataset_url: str) -> Any:
    import ray

    from ringflow.engine import DataSpec, RayDatasetData

    spec = DataSpec(dataset_url=dataset_url, stream=True)
    if kind == "dataspec":
        return spec
    columns = [c.name for c in spec.schema.columns]
    return RayDatasetData(
        train=ray.data.read_parquet(_shards(dataset_url, "train")).select_columns(columns),
        validation=ray.data.read_parquet(_shards(dataset_url, "validation")).select_columns(
            columns
        ),
        schema=spec.schema,
    )


def _run(kind: str, dataset_url: str, workers: int, batch_size: int) -> dict[str, Any]:
    from ringflow.engine import TrainConfig, fit

    out = os.environ[_RSS_DIR]  # set before Ray starts: its workers inherit it
    data = _data(kind, dataset_url)
    start = time.perf_counter()
    result = fit(
        RssDigits,
        hparams={"hidden": 64, "lr": 0.001},
        data=data,
        config=TrainConfig(workers=workers, epochs=1, batch_size=batch_size),
        checkpoint_uri=os.path.join(out, f"model-{kind}"),
    )
    seconds = time.perf_counter() - start
    peaks = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("rss-"):
            with open(os.path.join(out, name)) as f:
                peaks[name[4:-5]] = round(json.load(f)["peak_rss_mb"])
            os.remove(os.path.join(out, name))
    rows = _rows(dataset_url)
    return {
        "seconds": round(seconds, 1),
        "epoch_seconds": round(result.history[-1].seconds, 1),
        "samples_per_s": round(rows / result.history[-1].seconds),
        "peak_rss_mb": peaks,
        "val_accuracy": round(result.metrics["val_accuracy"], 4),
    }


def main(argv: list[str] | None = None) -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset_url")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024)
    args = parser.parse_args(argv)
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}")
    os.environ[_RSS_DIR] = tempfile.mkdtemp(prefix="ringflow-ray-dataset-")
    ray.init(
        address="local",
        num_cpus=args.workers + 1,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    runs = {}
    try:
        for kind in ("dataspec", "ray_dataset"):
            runs[kind] = _run(kind, args.dataset_url, args.workers, args.batch_size)
            print(f"{kind}: {runs[kind]}")
    finally:
        ray.shutdown()
    ratio = runs["ray_dataset"]["samples_per_s"] / runs["dataspec"]["samples_per_s"]
    print(headline_json({**runs, "ray_dataset_vs_dataspec": round(ratio, 3)}, HEADLINE))


if __name__ == "__main__":
    main()
