"""Scoring on Ray Data: the blocks :func:`serving.score.score` has left to score, spread over
actors that each load the model once (``map_batches`` with an actor class).

Each actor reads its blocks from storage itself and scores them with
:func:`serving.score.score_block`, the one-process path's function, so the shards and block
records are the same bytes either way; only the block records come back to the driver, which
commits the output. Runs on the Ray this process is connected to (Ray Data starts a local one
otherwise, or joins ``RAY_ADDRESS``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ringflow.serving.score import Block, Job, ScoringOptions

__all__ = ["score_on_ray"]


def score_on_ray(
    job: Job,
    blocks: list[Block],
    options: ScoringOptions,
    finished: Callable[[str, dict], None],
) -> None:
    """Score ``blocks`` on Ray Data actors holding the model; call ``finished(block id,
    record)`` as each block commits."""
    import ray.data

    items = [{"block": json.dumps(asdict(b))} for b in blocks]
    scored = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _BlockScorer,
        fn_constructor_kwargs={"job": job, "on_gpu": options.gpus_per_actor > 0},
        batch_size=1,
        batch_format="numpy",
        concurrency=_actors(options, len(blocks)),
        num_cpus=options.cpus_per_actor,
        num_gpus=options.gpus_per_actor,
    )
    for row in scored.iter_rows():
        record = json.loads(row["record"])
        finished(record["block"], record)


def _actors(options: ScoringOptions, blocks: int) -> int:
    """Actors to start: as asked, else as many as the cluster's CPUs (or GPUs) hold, at
    most one per block."""
    if options.concurrency is not None:
        return min(options.concurrency, blocks)
    import ray

    resources = ray.cluster_resources()
    fits = resources.get("CPU", 1.0) / options.cpus_per_actor
    if options.gpus_per_actor > 0:
        fits = min(fits, resources.get("GPU", 0.0) / options.gpus_per_actor)
    return max(1, min(int(fits), blocks))


class _BlockScorer:
    """One Ray Data actor: loads the model once, scores the blocks it is handed."""

    def __init__(self, job: Job, on_gpu: bool) -> None:
        import torch

        from ringflow.serving.replica import _load_served

        self.job = job
        self.served = _load_served(job.uri, job.allowed, job.record)
        if on_gpu and torch.cuda.is_available():
            self.served.module.to("cuda")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ringflow.serving.score import Block, score_block

        records = []
        for text in batch["block"]:
            block = Block(**json.loads(str(text)))
            records.append(json.dumps(score_block(self.job, self.served, block)))
        return {"record": np.array(records, dtype=object)}
