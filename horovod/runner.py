"""``ringflow.horovod.run``: Horovod's ``horovod.run`` on Ray, each rank an actor."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ringflow.horovod.basics import VARIABLES

__all__ = ["RankFailedError", "run"]


class RankFailedError(RuntimeError):
    """A rank's function raised: its rank and the original exception, in one line."""

    def __init__(self, rank: int, error: BaseException) -> None:
        cause = error
        while getattr(cause, "cause", None) is not None:  # Ray's RayTaskError wraps it
            cause = cause.cause
        message = " ".join(str(cause).split()) or type(cause).__name__
        super().__init__(f"rank {rank} raised {type(cause).__name__}: {message}")
        self.rank, self.original = rank, cause


class _Rank:
    """One rank: runs the user's function with the launcher's variables set."""

    def node(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def address(self) -> str:
        from ringflow.engine.worker import free_address

        return free_address()

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, env: dict[str, str]) -> Any:
        from ringflow import horovod as hvd

        os.environ.update(env)
        try:
            return fn(*args, **kwargs)
        finally:
            hvd.shutdown()


def run(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    np: int = 1,
    *,
    cpus_per_worker: float = 1.0,
    gpus_per_worker: int = 0,
    timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks, each a Ray actor (a private local Ray, or
    the cluster ``RAY_ADDRESS`` names); each rank's result, in rank order.

    Inside ``fn``, ``hvd.init()`` joins the ranks' ring. ``timeout_s`` is every collective's
    deadline: a rank that died or stopped answering makes the others fail within it.

    Raises:
        RankFailedError: a rank's ``fn`` raised; the first to fail, by rank and exception.
    """
    if np < 1:
        raise ValueError(f"np must be 1 or more, got {np}")
    import ray

    from ringflow.engine.cluster import connect

    connect()
    actor = ray.remote(_Rank).options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)
    ranks = [actor.remote() for _ in range(np)]
    try:
        nodes = ray.get([r.node.remote() for r in ranks])
        address = ray.get(ranks[0].address.remote())
        order = list(dict.fromkeys(nodes))
        refs = []
        for index, (rank, node) in enumerate(zip(ranks, nodes, strict=True)):
            local = [i for i, n in enumerate(nodes) if n == node]
            told = {
                "rank": index,
                "size": np,
                "local_rank": local.index(index),
                "local_size": len(local),
                "cross_rank": order.index(node),
                "cross_size": len(order),
                "address": address,
                "timeout_s": timeout_s,
            }
            variables = {**(env or {}), **{VARIABLES[k]: str(v) for k, v in told.items()}}
            refs.append(rank.run.remote(fn, tuple(args), dict(kwargs or {}), variables))
        return _results(refs)
    finally:
        for rank in ranks:
            ray.kill(rank)


def _results(refs: list[Any]) -> list[Any]:
    """Every rank's result; the first failure as soon as it happens (the others, waiting on
    it in a collective, are ended by the caller)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except Exception as err:
            raise RankFailedError(refs.index(done[0]), err) from None
    return ray.get(refs)
