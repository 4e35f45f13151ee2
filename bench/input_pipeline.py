"""Input pipeline: our streaming reader against Ray Data and a torch DataLoader, and the memory
of 2 workers training on a dataset larger than they may hold.

Readers (the default mode), over the training split of a dataset written by
``bench.make_parquet``, each in ``--workers`` concurrent consumers (one process each, or Ray
tasks for Ray Data), each taking its share of every global batch of ``--batch-size``:

- ``ours``: ``DataSpec(stream=True)``: ``engine.worker.epoch_batches`` over a
  ``storage.stream.SplitStream``, the code a training worker runs (shuffled row groups, rows
  shuffled within windows, a background thread reading ahead);
- ``ray_data``: ``ray.data.read_parquet`` then ``streaming_split(workers)`` and, in each
  consumer, ``iter_torch_batches`` (no shuffle: its fastest), the columns stacked into one
  feature matrix as ours gives;
- ``dataloader``: a torch ``IterableDataset`` giving each rank every ``workers``-th row group,
  its rows shuffled, in batches, through ``DataLoader(num_workers=1)``.

The files are read once before any timing, so every reader finds them in the page cache. It
prints samples per second per consumer for each, and last one JSON object with
``ours_vs_ray_data`` and ``ours_vs_dataloader`` (ratios of samples per second per worker).

``--train`` instead trains a small MLP with 2 workers (``engine.fit``, streaming) for one epoch
over the whole dataset and prints each worker's peak resident memory (``ru_maxrss``), then a
JSON line with ``peak_rss_mb`` per worker.

    python -m bench.make_parquet /tmp/ringflow-bench --gb 4      # prints the dataset URL
    python -m bench.input_pipeline <dataset_url>
    python -m bench.input_pipeline <dataset_url> --train
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from bench import headline_json
from ringflow.models.digits import DigitsClassifier

HEADLINE = ("ours_vs_ray_data", "ours_vs_dataloader")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

READERS = ("ours", "ray_data", "dataloader")
_RSS_DIR = "INPUT_PIPELINE_RSS_DIR"
"""Where each training worker writes its peak RSS (workers inherit the driver's environment)."""


def _train_files(dataset_url: str) -> list[str]:
    from ringflow.storage.dataset import split_shards
    from ringflow.storage.fs import join

    _, shards = split_shards(dataset_url, "train")
    return [join(dataset_url, f["path"]) for f in shards]


def _columns(dataset_url: str) -> tuple[list[str], str]:
    from ringflow.storage.dataset import dataset_schema

    schema = dataset_schema(dataset_url)
    return [c.name for c in schema.features], schema.label.name


def _touch(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(x[:, 0].sum()) + float(y[-1])


# --------------------------------------------------------------------------- ours


def _ours(dataset_url: str, rank: int, workers: int, batch_size: int, steps: int) -> dict:
    from ringflow.engine import DataSpec, TrainConfig
    from ringflow.engine.worker import epoch_batches

    torch.set_num_threads(1)
    start = time.perf_counter()
    samples = DataSpec(dataset_url=dataset_url, stream=True).samples("train")
    config = TrainConfig(workers=workers, batch_size=batch_size)
    steps = min(steps, -(-len(samples) // batch_size))
    count = 0
    for _, mine, _ in epoch_batches(
        samples,
        config,
        epoch=0,
        first=0,
        count=steps,
        rank=rank,
        world_size=workers,
        device=torch.device("cpu"),
    ):
        x, y = samples.batch(mine)
        _touch(x, y)
        count += len(y)
    samples.close()
    read = f"{samples.row_groups_read} of {len(samples.layout.blocks)}"
    return {**_result(count, start), "row_groups_read": read}


# --------------------------------------------------------------------------- torch DataLoader


class _RowGroups(torch.utils.data.IterableDataset):
    """Every ``workers``-th row group of the files, from ``rank``; rows shuffled per group."""

    def __init__(self, files, features, label, rank, workers, part) -> None:
        self.files, self.features, self.label = files, features, label
        self.rank, self.workers, self.part = rank, workers, part

    def __iter__(self):
        from ringflow.storage.fs import resolve

        groups = []
        for path in self.files:
            fs, local = resolve(path)
            with fs.open(local, "rb") as f:
                groups += [(path, g) for g in range(pq.read_metadata(f).num_row_groups)]
        rng = np.random.default_rng(self.rank)
        for path, group in groups[self.rank :: self.workers]:
            fs, local = resolve(path)
            with fs.open(local, "rb") as f:
                table = pq.ParquetFile(f).read_row_group(group, [*self.features, self.label])
            x = np.stack([table[c].to_numpy() for c in self.features], axis=1)
            y = table[self.label].to_numpy()
            order = rng.permutation(len(y))
            for start in range(0, len(y), self.part):
                rows = order[start : start + self.part]
                yield torch.from_numpy(x[rows]), torch.from_numpy(y[rows])


def _dataloader(dataset_url: str, rank: int, workers: int, batch_size: int, steps: int) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    features, label = _columns(dataset_url)
    dataset = _RowGroups(
        _train_files(dataset_url), features, label, rank, workers, batch_size // workers
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
    count = 0
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        _touch(x, y)
        count += len(y)
    return _result(count, start)


def _result(count: int, start: float) -> dict:
    elapsed = time.perf_counter() - start
    return {"samples": count, "seconds": elapsed, "samples_per_s": count / elapsed}


def _in_processes(target, dataset_url: str, workers: int, batch_size: int, steps: int) -> list:
    """``target`` run by ``workers`` concurrent processes (not daemons: a DataLoader's workers
    are their children)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=_report,
            args=(results, target, dataset_url, rank, workers, batch_size, steps),
        )
        for rank in range(workers)
    ]
    for process in processes:
        process.start()
    runs = dict(results.get() for _ in processes)
    for process in processes:
        process.join()
    return [runs[rank] for rank in range(workers)]


def _report(results, target, dataset_url, rank, workers, batch_size, steps) -> None:
    results.put((rank, target(dataset_url, rank, workers, batch_size, steps)))


# --------------------------------------------------------------------------- Ray Data


def _ray_data(dataset_url: str, workers: int, batch_size: int, steps: int) -> list:
    import ray

    features, label = _columns(dataset_url)
    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False

        @ray.remote(num_cpus=0)
        def consume(iterator, rank: int) -> dict:
            torch.set_num_threads(1)
            start = time.perf_counter()

            def collate(batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
                x = np.stack([batch[c] for c in features], axis=1)
                return torch.from_numpy(x), torch.from_numpy(batch[label])

            count = 0
            batches = iterator.iter_torch_batches(
                batch_size=batch_size // workers, collate_fn=collate
            )
            for i, (x, y) in enumerate(batches):
                if i == steps:
                    break
                _touch(x, y)
                count += len(y)
            return _result(count, start)

        dataset = ray.data.read_parquet(_train_files(dataset_url))
        dataset = dataset.select_columns([*features, label])
        splits = dataset.streaming_split(workers, equal=True)
        return ray.get([consume.remote(it, rank) for rank, it in enumerate(splits)])
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------- training


def _train(dataset_url: str, workers: int, batch_size: int) -> dict[str, Any]:
    import ray

    from ringflow.engine import DataSpec, TrainConfig, fit

    out = tempfile.mkdtemp(prefix="ringflow-rss-")
    os.environ[_RSS_DIR] = out
    data = DataSpec(dataset_url=dataset_url, stream=True)
    ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False)
    start = time.perf_counter()
    result = fit(
        RssDigits,
        hparams={"hidden": 64, "lr": 0.001, "input_dim": data.schema.input_dim},
        data=data,
        config=TrainConfig(workers=workers, epochs=1, batch_size=batch_size),
        checkpoint_uri=os.path.join(out, "model"),
    )
    elapsed = time.perf_counter() - start
    peaks = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("rss-"):
            with open(os.path.join(out, name)) as f:
                peaks[name[4:-5]] = json.load(f)["peak_rss_mb"]
    return {
        "seconds": elapsed,
        "peak_rss_mb": peaks,
        "driver_peak_rss_mb": _peak_rss_mb(),
        "metrics": result.history[-1].metrics,
    }


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RssDigits(DigitsClassifier):
    """Writes its process's peak resident memory where the benchmark reads it."""

    def on_fit_end(self) -> None:
        rank = self.trainer.global_rank
        with open(os.path.join(os.environ[_RSS_DIR], f"rss-rank{rank}.json"), "w") as f:
            json.dump({"peak_rss_mb": _peak_rss_mb()}, f)


# --------------------------------------------------------------------------- main


def _warm(dataset_url: str) -> int:
    from ringflow.storage.fs import resolve

    total = 0
    for url in _train_files(dataset_url):
        fs, path = resolve(url)
        with fs.open(path, "rb") as f:
            while chunk := f.read(2**26):
                total += len(chunk)
    return total


def _machine() -> str:
    return f"{platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}"


def _readers(args: argparse.Namespace) -> None:
    print(f"machine: {_machine()}", file=sys.stderr)
    print(f"train files: {_warm(args.dataset_url) / 2**30:.2f} GiB (now in page cache)")
    rates = {}
    for reader in args.readers.split(","):
        if reader == "ray_data":
            runs = _ray_data(args.dataset_url, args.workers, args.batch_size, args.steps)
        else:
            target = _ours if reader == "ours" else _dataloader
            runs = _in_processes(
                target, args.dataset_url, args.workers, args.batch_size, args.steps
            )
        rates[reader] = sum(r["samples_per_s"] for r in runs) / len(runs)
        per = ", ".join(f"{r['samples_per_s']:,.0f}" for r in runs)
        if "row_groups_read" in runs[0]:
            per += "; row groups read: " + ", ".join(r["row_groups_read"] for r in runs)
        print(
            f"{reader:<11} {rates[reader]:>12,.0f} samples/s per worker "
            f"(workers: {per}; {runs[0]['samples']:,} samples in {runs[0]['seconds']:.1f} s)",
            flush=True,
        )
    summary: dict[str, Any] = {
        "workers": args.workers,
        "batch_size": args.batch_size,
        "samples_per_s_per_worker": {k: round(v) for k, v in rates.items()},
    }
    if "ours" in rates:
        for other in ("ray_data", "dataloader"):
            if other in rates:
                summary[f"ours_vs_{other}"] = round(rates["ours"] / rates[other], 3)
    print(headline_json(summary, HEADLINE))


def _training(args: argparse.Namespace) -> None:
    print(f"machine: {_machine()}", file=sys.stderr)
    run = _train(args.dataset_url, args.workers, args.batch_size)
    for rank, peak in run["peak_rss_mb"].items():
        print(f"{rank}: peak RSS {peak:,.0f} MB")
    print(f"driver: peak RSS {run['driver_peak_rss_mb']:,.0f} MB; {run['seconds']:.0f} s")
    print(json.dumps(run))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset_url", help="a dataset written by bench.make_parquet")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2048, help="global batch")
    parser.add_argument(
        "--steps", type=int, default=10**9, help="most batches per worker (default: an epoch)"
    )
    parser.add_argument("--readers", default=",".join(READERS))
    parser.add_argument("--train", action="store_true", help="train, print peak RSS per worker")
    args = parser.parse_args(argv)
    (_training if args.train else _readers)(args)


if __name__ == "__main__":
    main()
