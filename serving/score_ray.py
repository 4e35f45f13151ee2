"""Scoring on Ray Data: the blocks :func:`serving.score.score` has left to score, spread over
actors that each load the model once (``map_batches`` with an actor class).

Each actor reads its blocks from storage itself and scores them with the function it is
given, :func:`serving.score.score_block`, the one-process path's, so the shards and block
records are the same bytes either way; only the block records come back to the driver, which
commits the output. Runs on the Ray this process is connected to (Ray Data starts a local one
otherwise, or joins ``RAY_ADDRESS``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

__all__ = ["score_on_ray"]


def score_on_ray(
    job: Any,
    blocks: list[Any],
    options: Any,
    finished: Callable[[str, dict], None],
    *,
    score_block: Callable[[Any, Any, Any], dict],
) -> None:
    """Score ``blocks`` (``serving.score.Block`` objects of ``job``, a ``serving.score.Job``) on
    Ray Data actors holding the model, each block by ``score_block(job, served, block)``, as
    ``options`` (``serving.score.ScoringOptions``) say; call ``finished(block id, record)`` as
    each block commits."""
    import ray.data

    items = [{"block": json.dumps(asdict(b))} for b in blocks]
    scored = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _BlockScorer,
        fn_constructor_kwargs={
            "job": job,
            "on_gpu": options.gpus_per_actor > 0,
            "score_block": score_block,
            "block_type": type(blocks[0]),
        },
        batch_size=1,
        batch_format="numpy",
        concurrency=_actors(options, len(blocks)),
        num_cpus=options.cpus_per_actor,
        num_gpus=options.gpus_per_actor,
    )
    for row in scored.iter_rows():
        record = json.loads(row["record"])
        finished(record["block"], record)


def _actors(options: Any, blocks: int) -> int:
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

    def __init__(
        self, job: Any, on_gpu: bool, score_block: Callable[..., dict], block_type: type
    ) -> None:
        import torch

        from ringflow.serving.replica import _load_served

        self.job, self.score_block, self.block_type = job, score_block, block_type
        self.served = _load_served(job.uri, job.allowed, job.record)
        if on_gpu and torch.cuda.is_available():
            self.served.module.to("cuda")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        records = []
        for text in batch["block"]:
            block = self.block_type(**json.loads(str(text)))
            records.append(json.dumps(self.score_block(self.job, self.served, block)))
        return {"record": np.array(records, dtype=object)}
