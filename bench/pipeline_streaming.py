"""Pipeline stages' memory, streaming against reading whole splits.

Trains a small MLP cut into 3 pipeline stages (Ray actors, one replica) for one epoch over a
dataset written by ``bench.make_parquet``, once with ``DataSpec(stream=True)`` and once with
``stream=False``, and prints each stage's peak resident memory (``ru_maxrss``, written by a
parameter-free probe layer at the head of every stage) and the run's seconds. The first and
last stages read rows; the middle one reads none either way. The last line is one JSON object
with ``peak_rss_mb`` by mode and stage, and whether both runs ended with the same weights.

    python -m bench.make_parquet /tmp/ringflow-bench --gb 0.5    # prints the dataset URL
    python -m bench.pipeline_streaming <dataset_url>
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from bench import headline_json

HEADLINE = ("peak_rss_mb", "same_weights")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

_RSS_DIR = "PIPELINE_STREAMING_RSS_DIR"
"""Where each stage writes its peak RSS (the actors inherit the driver's environment)."""
STAGES = 3


class RssProbe(nn.Module):
    """Passes its input through; writes its process's peak RSS every ``every`` calls."""

    def __init__(self, stage: int, every: int = 20) -> None:
        super().__init__()
        self.stage, self.every, self.calls = stage, every, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls % self.every == 0 and _RSS_DIR in os.environ:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            with open(os.path.join(os.environ[_RSS_DIR], f"stage{self.stage}.json"), "w") as f:
                json.dump({"peak_rss_mb": peak}, f)
        self.calls += 1
        return x


class ProbedMLP(nn.Module):
    """An MLP as a layer sequence with a probe at the head of each of its 3 stages."""

    def __init__(self, *, input_dim: int, classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            RssProbe(0),
            nn.Linear(input_dim, hidden),
            nn.Tanh(),
            RssProbe(1),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            RssProbe(2),
            nn.Linear(hidden, classes),
        )

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.001)


def _run(dataset_url: str, *, stream: bool, batch_size: int) -> dict[str, Any]:
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.engine.pipeline import PipelineConfig

    out = os.environ[_RSS_DIR]
    data = DataSpec(dataset_url=dataset_url, stream=stream)
    classes = int(data.schema.label.max) + 1
    start = time.perf_counter()
    result = fit(
        ProbedMLP,
        hparams={"input_dim": data.schema.input_dim, "classes": classes},
        data=data,
        config=TrainConfig(workers=1, epochs=1, batch_size=batch_size, seed=0),
        pipeline=PipelineConfig(stages=STAGES, micro_batches=4, balance=(3, 6)),
        checkpoint_uri=os.path.join(out, f"model-{stream}"),
    )
    seconds = time.perf_counter() - start
    peaks = {}
    for stage in range(STAGES):
        path = os.path.join(out, f"stage{stage}.json")
        with open(path) as f:
            peaks[f"stage{stage}"] = round(json.load(f)["peak_rss_mb"])
        os.remove(path)  # each run's stages are new processes
    return {"seconds": seconds, "peak_rss_mb": peaks, "state": result.state_dict}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset_url")
    parser.add_argument("--batch-size", type=int, default=4096)
    args = parser.parse_args(argv)
    import ray

    from ringflow.storage.dataset import split_shards

    _, shards = split_shards(args.dataset_url, "train")
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"train split: {sum(f['size'] for f in shards) / 2**30:.2f} GiB in {len(shards)} shards")
    os.environ[_RSS_DIR] = tempfile.mkdtemp(prefix="ringflow-pipeline-rss-")  # before Ray starts
    ray.init(address="local", num_cpus=STAGES, include_dashboard=False, log_to_driver=False)
    runs = {}
    for stream in (True, False):
        mode = "stream" if stream else "whole"
        runs[mode] = _run(args.dataset_url, stream=stream, batch_size=args.batch_size)
        peaks = ", ".join(f"{k} {v:,} MB" for k, v in runs[mode]["peak_rss_mb"].items())
        print(f"{mode}: peak RSS {peaks}; {runs[mode]['seconds']:.0f} s")
    same = all(
        torch.equal(runs["stream"]["state"][k], v) for k, v in runs["whole"]["state"].items()
    )
    print(
        headline_json(
            {
                "peak_rss_mb": {mode: run["peak_rss_mb"] for mode, run in runs.items()},
                "seconds": {mode: round(run["seconds"], 1) for mode, run in runs.items()},
                "same_weights": same,
            },
            HEADLINE,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
