"""``ringflow.horovod.run`` (Horovod's ``horovod.run``) and ``ringflow-run`` (its
``horovodrun``) on Ray: each rank an actor."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import secrets
import signal
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


def _die_with_parent() -> None:
    """In the rank's child process: killed when the actor that started it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Rank:
    """One rank: runs the user's function with the launcher's variables set."""

    _relay: Any = None

    def elastic(self, membership: Any, worker: str) -> None:
        """Take part in an elastic run: ``hvd.init`` asks ``membership`` for this worker's
        place, through a relay in this actor."""
        from ringflow.horovod.membership import Relay

        self._relay = Relay(membership, worker)

    def _variables(self, env: dict[str, str]) -> dict[str, str]:
        from ringflow.horovod.membership import SOCKET, WORKER

        if self._relay is None:
            return env
        return {**env, SOCKET: self._relay.path, WORKER: self._relay.worker}

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
            env={"PYTHONUNBUFFERED": "1", **os.environ, **self._variables(env)},
            preexec_fn=_die_with_parent,
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
        self._process.wait()
        self._ended = time.time()  # host time: the launcher compares ranks' exits

    def ended(self) -> float:
        """When the command exited (after :meth:`output` gave its status)."""
        return self._ended

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

        os.environ.update(self._variables(env))
        try:
            result = fn(*args, **kwargs)
            if self._relay is None:
                return result
            return (hvd.rank() if hvd.is_initialized() else None), result
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

    With ``min_np`` or ``max_np`` (``horovod.run``'s) the run is elastic: a rank whose actor
    dies is lost, the others roll back to their last commit (``@hvd.elastic.run``) and go on,
    and a worker starts in its place, as the engine's elastic coordinator decides: at most
    ``reset_limit`` (Horovod's) changes of the ranks, each loss and each join one (``None``:
    any number); the result is then each finishing rank's, in its last rank order.

    Raises:
        RankFailedError: a rank's ``fn`` raised; the first to fail, by rank and exception.
        HorovodError: an elastic run gave up (every worker lost, or ``reset_limit`` spent).
    """
    if np < 1:
        raise ValueError(f"np must be 1 or more, got {np}")
    min_np, max_np = horovods.pop("min_np", None), horovods.pop("max_np", None)
    reset_limit = horovods.pop("reset_limit", None)
    _check_horovods_options(horovods)
    if min_np is not None or max_np is not None:
        options = {
            "timeout_s": timeout_s,
            "reset_limit": reset_limit,
            "cpus": cpus_per_worker,
            "gpus": gpus_per_worker,
            "env": env,
        }
        elastic = _Elastic(np, min_np, max_np, options)
        try:
            return _results_elastic(elastic, fn, tuple(args), dict(kwargs or {}))
        finally:
            elastic.stop()
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
        }.get(name, f"the option {name}")
        raise HorovodError(f"ringflow.horovod.run does not take {name}={value!r}: {what}")


def _start(
    np: int,
    cpus: float,
    gpus: float,
    timeout_s: float,
    env: dict[str, str] | None,
    rank_cls: type = _Rank,
    rank_args: tuple = (),
    **options: Any,
) -> tuple[list[Any], list[dict[str, str]]]:
    """``np`` rank actors (``rank_cls(*rank_args)``, with Ray's actor ``options``), and what
    each is told of its place (``basics.VARIABLES``)."""
    import ray

    from ringflow.engine.cluster import connect

    connect()
    actor = ray.remote(rank_cls).options(num_cpus=cpus, num_gpus=gpus, **options)
    ranks = [actor.remote(*rank_args) for _ in range(np)]
    nodes = ray.get([r.node.remote() for r in ranks])
    address = ray.get(ranks[0].address.remote())
    order = list(dict.fromkeys(nodes))
    variables, job = [], secrets.token_hex(8)
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
            "job": job,
        }
        told_env = {VARIABLES[k]: str(v) for k, v in told.items()}
        variables.append({**_forwarded(), **(env or {}), **told_env, **_horovodrun_told(told)})
    return ranks, variables


_HOROVODRUN = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")


def _horovodrun_told(told: dict[str, Any]) -> dict[str, str]:
    """What ``horovodrun`` (its gloo controller) tells each rank, for scripts that read it:
    ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ... (an elastic run's ranks change, so only there
    they are not set)."""
    named = {f"HOROVOD_{key.upper()}": str(told[key]) for key in _HOROVODRUN}
    return {**named, "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}


class _Elastic:
    """The launcher's side of an elastic run: the workers it started, the :class:`Membership`
    that forms them into ranks (deciding through the engine's elastic coordinator), and the
    workers it starts in place of lost ones when the membership says so. Each worker is a
    ``rank_cls(*rank_args)`` actor."""

    def __init__(
        self,
        np: int,
        min_np: int | None,
        max_np: int | None,
        options: dict[str, Any],
        rank_cls: type = _Rank,
        rank_args: tuple = (),
    ) -> None:
        import ray

        from ringflow.engine.cluster import connect
        from ringflow.horovod.membership import Membership

        min_np = np if min_np is None else min_np
        max_np = max(np, min_np) if max_np is None else max_np
        reset_limit = options["reset_limit"]
        if not 1 <= min_np <= np <= max_np or (reset_limit is not None and reset_limit < 0):
            raise ValueError(
                f"an elastic run needs 1 <= min_np ({min_np}) <= np ({np}) <= max_np "
                f"({max_np}) and a reset limit of 0 or more ({reset_limit})"
            )
        connect()
        timeout_s = options["timeout_s"]
        self.np = np
        self.membership = (
            ray.remote(Membership)
            .options(num_cpus=0, max_concurrency=2 * max_np + 8)
            .remote(np, min_np, max_np, max(60.0, 2 * timeout_s), reset_limit)
        )
        self._actor = ray.remote(rank_cls).options(
            num_cpus=options["cpus"], num_gpus=options["gpus"]
        )
        self._rank_args = rank_args
        self.env = {**_forwarded(), **(options["env"] or {})}
        self.env[VARIABLES["timeout_s"]] = str(timeout_s)
        self.env[VARIABLES["job"]] = secrets.token_hex(8)
        self.workers: dict[str, Any] = {}
        self.finished = False
        self.gave_up: str | None = None
        self._count = 0

    def start(self) -> tuple[str, Any]:
        """A new worker, known to the membership; its relay is set up before any call made
        on it after this one (without waiting here: the others' output goes on)."""
        import ray

        name, self._count = str(self._count), self._count + 1
        actor = self._actor.remote(*self._rank_args)
        ray.get(self.membership.started.remote(name))
        actor.elastic.remote(self.membership, name)
        self.workers[name] = actor
        return name, actor

    def resize(self, np: int) -> None:
        """Keep ``np`` workers running from now on (the membership bounds it by ``min_np``
        and ``max_np``); more are started at the next :meth:`step`, and they join the ranks
        at a commit."""
        import ray

        ray.get(self.membership.resize.remote(np))

    def lost(self, name: str, why: str) -> None:
        """``name`` is gone (``why``): the membership decides whether the others go on."""
        import ray

        ray.kill(self.workers.pop(name))
        print(f"ringflow-run: worker {name} lost ({why})", file=sys.stderr, flush=True)
        ray.get(self.membership.lost.remote(name, why))

    def step(self) -> list[tuple[str, Any]]:
        """Act on what the membership decided since the last call: end the workers it
        dropped, report its events (as ``engine.fit`` reports them), and start the workers
        it asks for in place of lost ones; those started. After it gave up, ``gave_up``
        says why."""
        import ray

        dropped, start, events, self.gave_up = ray.get(self.membership.poll.remote())
        for name in dropped:
            if name in self.workers:
                ray.kill(self.workers.pop(name))
        for event in events:
            print(f"ringflow-run: {event.describe()}", file=sys.stderr, flush=True)
        if self.gave_up is not None or self.finished:
            return []
        return [self.start() for _ in range(start)]

    def ended(self, name: str) -> None:
        """``name`` finished: no worker is started in place of others any more."""
        import ray

        self.finished = True
        ray.kill(self.workers.pop(name))
        for waiting in ray.get(self.membership.finish.remote(name)):
            ray.kill(self.workers.pop(waiting))

    def stop(self) -> None:
        import ray

        for actor in self.workers.values():
            ray.kill(actor)
        ray.kill(self.membership)


def _follow_elastic(run: _Elastic, command: list[str]) -> int:
    """``_follow`` for an elastic run: a worker killed by a signal (or whose actor died) is
    lost, and the membership decides whether the ranks left go on and a worker starts in its
    place; one that exits with an error status fails the run with it."""
    import ray

    for _ in range(run.np):
        _, actor = run.start()
        actor.start.remote(command, run.env)
    asked: dict[str, Any] = {}  # worker -> its output() in flight (a new one takes seconds)
    while run.workers and run.gave_up is None:
        for _, actor in run.step():
            actor.start.remote(command, run.env)
        for name in [n for n in asked if n not in run.workers]:  # dropped, or ended with the run
            del asked[name]
        for name, actor in run.workers.items():
            asked.setdefault(name, actor.output.remote())
        answered, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=0.05)
        for name in [n for n, ref in asked.items() if ref in answered]:
            status = _forward(run, name, asked.pop(name))
            if status is not None and status > 0:
                print(f"ringflow-run: worker {name} exited with status {status}", file=sys.stderr)
                return status
        time.sleep(0.05)
    run.step()  # the last events
    if run.gave_up is not None:
        print(f"ringflow-run: gave up: {run.gave_up}", file=sys.stderr, flush=True)
        return 1
    return 0


def _forward(run: _Elastic, name: str, output: Any) -> int | None:
    """Write the lines of worker ``name``'s ``output()``; once it ended, tell the run (a
    worker killed by a signal, or whose actor died, is lost). Its exit status, if it ended."""
    import ray

    try:
        lines, status = ray.get(output)
    except ray.exceptions.RayActorError:
        lines, status = [], -signal.SIGKILL
    sys.stdout.write("".join(f"[{name}] {line}" for line in lines))
    sys.stdout.flush()
    if status == 0:
        run.ended(name)
    elif status is not None and status < 0:
        run.lost(name, f"killed by signal {-status}")
    return status


def _results_elastic(
    run: _Elastic,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    tick: Callable[[], None] = lambda: None,
) -> list:
    """``_results`` for an elastic run: a worker whose actor died is lost (the membership
    decides whether the ranks left go on and a worker starts in its place); one whose ``fn``
    raised fails the run. The results of the ranks that finished, in rank order. ``tick()``
    is called every 0.1 s or so while the run goes on, and once at its end.

    Raises:
        HorovodError: the run gave up (the elastic coordinator's reason).
    """
    import ray

    from ringflow.horovod.basics import HorovodError

    calls: dict[str, Any] = {}
    for _ in range(run.np):
        name, actor = run.start()
        calls[name] = actor.run.remote(fn, args, kwargs, run.env)
    results: dict[tuple[bool, int], Any] = {}  # by rank; a function that never ranked, after
    while calls and run.gave_up is None:
        for name, actor in run.step():
            calls[name] = actor.run.remote(fn, args, kwargs, run.env)
        for name in [n for n in calls if n not in run.workers]:  # dropped
            del calls[name]
        done, _ = ray.wait(list(calls.values()), num_returns=1, timeout=0.1)
        tick()
        for name in [n for n, ref in calls.items() if ref in done]:
            ref = calls.pop(name)
            if name not in run.workers:  # ended with the run
                continue
            try:
                rank, result = ray.get(ref)
            except ray.exceptions.RayActorError:
                run.lost(name, "its process died")
                continue
            except Exception as err:
                tick()
                raise RankFailedError(int(name), err) from None
            run.ended(name)
            results[(rank is None, int(name) if rank is None else rank)] = result
    run.step()  # the last events
    tick()
    if run.gave_up is not None:
        raise HorovodError(f"the elastic run gave up: {run.gave_up}")
    return [results[rank] for rank in sorted(results)]


def _forwarded() -> dict[str, str]:
    """The launcher's ``RINGFLOW_*`` variables, for the ranks (on a cluster an actor's
    environment is its node's, not the launcher's): where checkpoints go, the lease they are
    written under, ringflow's settings. Secrets (``SECRET_ENV``) stay here."""
    from ringflow.engine.cluster import SECRET_ENV
    from ringflow.horovod.membership import SOCKET, WORKER

    own = {*SECRET_ENV, *VARIABLES.values(), SOCKET, WORKER}  # each rank is told its own
    return {k: v for k, v in os.environ.items() if k.startswith("RINGFLOW_") and k not in own}


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


_NOT_YET = ("-H", "--hosts")
"""horovodrun's flags ringflow-run refuses: host lists (the ranks go where Ray places them)."""


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
    parser.add_argument(
        "--grace-s",
        type=float,
        default=10.0,
        help="once a rank failed, how long the others may go on to finish before they are stopped",
    )
    parser.add_argument(
        "--min-np", type=int, default=None, help="an elastic run: fewest ranks it goes on with"
    )
    parser.add_argument(
        "--max-np", type=int, default=None, help="an elastic run: most ranks it takes in"
    )
    parser.add_argument(
        "--reset-limit",
        type=int,
        default=None,
        help="an elastic run: how many times the ranks may change (each loss and each join "
        "is one); no limit by default",
    )
    parser.add_argument(
        "--timeline-filename",
        default=None,
        help="write a Chrome trace of every rank's collectives here",
    )
    for flag in _NOT_YET:
        parser.add_argument(flag, dest=_dest(flag), default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``ringflow-run -np N COMMAND...``: start COMMAND on N ranks, each rank's output on this
    terminal prefixed by ``[rank]``; the exit status is the first failing rank's (the others
    are stopped ``--grace-s`` later if they have not ended by then), 0 when every rank
    succeeded."""
    args = _parser().parse_args(argv)
    given = [flag for flag in _NOT_YET if getattr(args, _dest(flag))]
    if given:
        print(
            f"error: ringflow-run does not take {given[0]}: host lists are not in "
            "ringflow.horovod (the ranks go where Ray places them)",
            file=sys.stderr,
        )
        return 2
    if not args.command or args.np < 1:
        print("error: give -np N (1 or more) and the command to run", file=sys.stderr)
        return 2
    if args.timeline_filename is None:
        return _main(args)
    from ringflow.horovod.timeline import TIMELINE, merge

    path = os.path.abspath(args.timeline_filename)
    os.environ[TIMELINE] = path  # handed to the ranks with the other RINGFLOW_* variables
    try:
        return _main(args)
    finally:
        print(f"ringflow-run: the timeline of {merge(path)} ranks is in {path}", file=sys.stderr)


def _main(args: argparse.Namespace) -> int:
    if args.min_np is not None or args.max_np is not None:
        return _main_elastic(args)
    import ray

    ranks, variables = _start(
        args.np, args.cpus_per_worker, args.gpus_per_worker, args.timeout_s, None
    )
    try:
        ray.get([r.start.remote(args.command, v) for r, v in zip(ranks, variables, strict=True)])
        return _follow(ranks, args.grace_s)
    finally:
        for rank in ranks:
            ray.kill(rank)


def _main_elastic(args: argparse.Namespace) -> int:
    options = {
        "timeout_s": args.timeout_s,
        "reset_limit": args.reset_limit,
        "cpus": args.cpus_per_worker,
        "gpus": args.gpus_per_worker,
        "env": None,
    }
    try:
        run = _Elastic(args.np, args.min_np, args.max_np, options)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        return _follow_elastic(run, args.command)
    finally:
        run.stop()


def _follow(ranks: list[Any], grace_s: float) -> int:
    """Forward every rank's lines until all ended; once one failed, the others have
    ``grace_s`` to end of their own (to write their output and files) before they are
    stopped. The first failing rank's status is returned, 0 when every rank succeeded."""
    import ray

    running, failed = set(range(len(ranks))), []  # failed: (when, rank, status)
    deadline = None
    while running and (deadline is None or time.monotonic() < deadline):
        for index in sorted(running):
            lines, status = ray.get(ranks[index].output.remote())
            for line in lines:
                sys.stdout.write(f"[{index}] {line}")
            sys.stdout.flush()
            if status is None:
                continue
            running.discard(index)
            if status != 0:
                failed.append((ray.get(ranks[index].ended.remote()), index, status))
        if failed and deadline is None:
            deadline = time.monotonic() + grace_s
        time.sleep(0.05)
    if not failed:
        return 0
    ray.get([ranks[i].stop.remote() for i in running])
    _, index, status = min(failed)
    stopped = f"; {len(running)} stopped after {grace_s:g} s" if running else ""
    print(f"ringflow-run: rank {index} exited with status {status}{stopped}", file=sys.stderr)
    return status if status > 0 else 128 - status  # killed by a signal


if __name__ == "__main__":
    sys.exit(main())
