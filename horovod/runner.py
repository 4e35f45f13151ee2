"""``ringflow.horovod.run`` (Horovod's ``horovod.run``) and ``ringflow-run`` (its
``horovodrun``) on Ray: each rank an actor."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ringflow.horovod.basics import VARIABLES

__all__ = ["RankFailedError", "main", "run"]


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

    def start(self, command: list[str], env: dict[str, str]) -> None:
        """Start ``command`` (``ringflow-run``'s) with the launcher's variables; its output
        is kept line by line for :meth:`output`."""
        self._lines: list[str] = []
        self._process = subprocess.Popen(
            command,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._process.stdout:
            self._lines.append(line)

    def output(self) -> tuple[list[str], int | None]:
        """The lines written since the last call, and the exit status once it ended (after
        its last line)."""
        status = self._process.poll()
        if status is not None:
            self._reader.join()
        lines, self._lines = self._lines, []
        return lines, status

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()

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
    **horovods: Any,
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
    _check_horovods_options(horovods)
    import ray

    ranks, variables = _start(np, cpus_per_worker, gpus_per_worker, timeout_s, env)
    try:
        refs = [
            rank.run.remote(fn, tuple(args), dict(kwargs or {}), told)
            for rank, told in zip(ranks, variables, strict=True)
        ]
        return _results(refs)
    finally:
        for rank in ranks:
            ray.kill(rank)


_IGNORED = ("use_gloo", "verbose", "disable_cache", "start_timeout", "network_interface")
"""``horovod.run`` options with nothing to do here: ringflow's ring has its own rendezvous
and transports, and Ray starts the ranks."""


def _check_horovods_options(options: dict[str, Any]) -> None:
    """``horovod.run``'s other options: ignored where meaningless here, refused where a
    script would get something else than it asked for."""
    from ringflow.horovod.basics import HorovodError

    for name, value in options.items():
        if name in _IGNORED or value in (None, False):
            continue
        what = {
            "use_mpi": "MPI",
            "hosts": "host lists (the ranks go where Ray places them)",
            "hostfile": "host files (the ranks go where Ray places them)",
            "min_np": "elastic runs (not yet in ringflow.horovod)",
            "max_np": "elastic runs (not yet in ringflow.horovod)",
        }.get(name, f"the option {name}")
        raise HorovodError(f"ringflow.horovod.run does not take {name}={value!r}: {what}")


def _start(
    np: int, cpus: float, gpus: int, timeout_s: float, env: dict[str, str] | None
) -> tuple[list[Any], list[dict[str, str]]]:
    """``np`` rank actors, and what each is told of its place (``basics.VARIABLES``)."""
    import ray

    from ringflow.engine.cluster import connect

    connect()
    actor = ray.remote(_Rank).options(num_cpus=cpus, num_gpus=gpus)
    ranks = [actor.remote() for _ in range(np)]
    nodes = ray.get([r.node.remote() for r in ranks])
    address = ray.get(ranks[0].address.remote())
    order = list(dict.fromkeys(nodes))
    variables = []
    for index, node in enumerate(nodes):
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
        variables.append({**(env or {}), **{VARIABLES[k]: str(v) for k, v in told.items()}})
    return ranks, variables


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


_NOT_YET = ("--min-np", "--max-np", "--timeline-filename", "-H", "--hosts")
"""horovodrun's flags ringflow-run refuses for now (elastic runs, the timeline, host lists)."""


def _dest(flag: str) -> str:
    return flag.strip("-").replace("-", "_")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringflow-run",
        description="Run a Horovod script's ranks as Ray actors (horovodrun's form): "
        "ringflow-run -np 4 python train.py ARGS",
    )
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True)
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--gpus-per-worker", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="collective deadline")
    for flag in _NOT_YET:
        parser.add_argument(flag, dest=_dest(flag), default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``ringflow-run -np N COMMAND...``: start COMMAND on N ranks, each rank's output on this
    terminal prefixed by ``[rank]``; the exit status is the first failing rank's (the others
    are stopped then), 0 when every rank succeeded."""
    args = _parser().parse_args(argv)
    given = [flag for flag in _NOT_YET if getattr(args, _dest(flag))]
    if given:
        print(
            f"error: ringflow-run does not take {given[0]} yet: "
            "elastic runs, the timeline and host lists are not in ringflow.horovod yet "
            "(the ranks go where Ray places them)",
            file=sys.stderr,
        )
        return 2
    if not args.command or args.np < 1:
        print("error: give -np N (1 or more) and the command to run", file=sys.stderr)
        return 2
    import ray

    ranks, variables = _start(
        args.np, args.cpus_per_worker, args.gpus_per_worker, args.timeout_s, None
    )
    try:
        ray.get([r.start.remote(args.command, v) for r, v in zip(ranks, variables, strict=True)])
        return _follow(ranks)
    finally:
        for rank in ranks:
            ray.kill(rank)


def _follow(ranks: list[Any]) -> int:
    """Forward every rank's lines until all ended, or one failed (its status is returned)."""
    import ray

    running = set(range(len(ranks)))
    while running:
        for index in sorted(running):
            lines, status = ray.get(ranks[index].output.remote())
            for line in lines:
                sys.stdout.write(f"[{index}] {line}")
            sys.stdout.flush()
            if status is None:
                continue
            running.discard(index)
            if status != 0:
                ray.get([ranks[i].stop.remote() for i in running])
                print(f"ringflow-run: rank {index} exited with status {status}", file=sys.stderr)
                return status if status > 0 else 128 - status  # killed by a signal
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
