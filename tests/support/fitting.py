"""What training tests compare (weights, and how far apart two sets of them are) and how
they pace or end a worker."""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Iterator

import torch

KILLED_PEER_DEADLINE_S = 10.0
"""``collective_timeout_s`` for a test that SIGKILLs a worker: a killed peer closes its end of
the ring at once, so the loss is seen in well under a second whatever the deadline, while a
live worker whose step is slow under the suite's load must not be taken for lost (3 s once
dropped one). Tests of the deadline itself (a stopped worker, a stalled stage) keep theirs."""


def relative_difference(a: dict, b: dict) -> float:
    """The largest relative difference, by norm, between two state dicts' tensors; integer
    tensors (BatchNorm's ``num_batches_tracked``) are equal (0) or infinitely apart."""
    assert a.keys() == b.keys()
    return max(_difference(a[k], b[k]) for k in a)


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if not b.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    return ((a - b).norm() / b.norm()).item()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread, as a ringflow worker with ``cpus_per_worker=1`` trains: an oracle
    trained in this process then rounds as the worker does; the thread count comes back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def short_handed(module, batch_idx: int, full: int) -> bool:
    """Whether fewer than ``full`` workers train this step, as seen from a ``training_step``:
    the worker's world is smaller, or it trains the shares of ranks that left, where each
    share's step sees the full world (``Trainer.as_rank``) with the batch index of the one
    before it. Tests pace such steps, so that a replacement starts before the run ends."""
    again = getattr(module, "_last_batch_idx", None) == batch_idx
    module._last_batch_idx = batch_idx
    return again or module.trainer.world_size < full


def die_once(marker: str | os.PathLike) -> None:
    """SIGKILL this process, unless file ``marker`` says it was done already (leaving it
    first): a worker lost at a chosen point of a run, once, however the run is timed."""
    try:
        open(marker, "x").close()
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def shipped_by_value(ray, *modules) -> Iterator[None]:
    """While the block runs, Ray ships the classes of ``modules`` to its actors by value: the
    actors need not import ``tests/``."""
    for module in modules:
        ray.cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        for module in modules:
            ray.cloudpickle.unregister_pickle_by_value(module)
