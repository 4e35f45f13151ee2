"""Preprocessing in one process against the Ray Data job, on the same synthetic Parquet drop.

The source is the training split of a dataset written by ``bench.make_parquet`` (a directory
of Parquet files of float32 features and an int64 label), read as a raw drop. Each engine
preprocesses it into its own fresh output directory; the Ray Data job runs twice on a local
Ray of ``--cpus`` CPUs, the first run including its workers' start. It prints rows per second
of each run, and last one JSON object with ``local_rows_per_s``, ``ray_rows_per_s`` (the
second run), ``ray_vs_local`` and ``same_manifest`` (the two manifests are equal byte for byte).

    python -m bench.make_parquet /tmp/ringflow-bench-pre --gb 0.25   # prints the dataset URL
    python -m bench.preprocess <dataset_url>/train
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

from bench import headline_json
from ringflow.storage.dataset import PreprocessResult, dataset_schema, preprocess
from ringflow.storage.fs import join, read_bytes

__all__ = ["main"]

HEADLINE = ("ray_vs_local", "same_manifest")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""


def _timed(source: str, output: str, engine: str) -> tuple[PreprocessResult, float]:
    schema = dataset_schema(source.rstrip("/").rsplit("/", 1)[0])
    start = time.perf_counter()
    result = preprocess(source, output, schema, engine=engine)
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a directory of Parquet files (a bench dataset's train/)")
    parser.add_argument("--cpus", type=int, default=os.cpu_count(), help="CPUs of the local Ray")
    args = parser.parse_args(argv)

    import ray

    with tempfile.TemporaryDirectory() as scratch:
        local, local_s = _timed(args.source, join(scratch, "local"), "local")
        rows = local.source_rows
        print(f"local: {rows} rows in {local_s:.1f} s, {rows / local_s:,.0f} rows/s", flush=True)
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        timings = []
        for run in (1, 2):
            result, seconds = _timed(args.source, join(scratch, f"ray{run}"), "ray")
            timings.append(seconds)
            print(f"ray data run {run}: {seconds:.1f} s, {rows / seconds:,.0f} rows/s", flush=True)
        ray.shutdown()
        manifests = [read_bytes(join(r.dataset_url, "_manifest.json")) for r in (local, result)]
    summary = {
        "rows": rows,
        "cpus": args.cpus,
        "machine": platform.machine(),
        "local_rows_per_s": round(rows / local_s),
        "ray_rows_per_s": round(rows / timings[1]),
        "ray_first_run_s": round(timings[0], 1),
        "ray_vs_local": round(local_s / timings[1], 2),
        "same_manifest": manifests[0] == manifests[1],
    }
    print(headline_json(summary, HEADLINE), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
