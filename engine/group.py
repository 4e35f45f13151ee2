"""Where the ranks run: Ray actors gang-scheduled in a placement group, or this process."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time
from typing import Any, NamedTuple, NoReturn

import torch

from ringflow.engine.config import PLACEMENTS, TrainConfig
from ringflow.engine.elastic.coordinator import (
    Continue,
    ElasticEvent,
    GiveUp,
    WaitForWorkers,
)
from ringflow.engine.epochs import Epochs
from ringflow.engine.errors import (
    CollectiveError,
    EngineError,
    MembershipLost,
    ModelError,
    PeerLostError,
    Stalled,
    WorkerFailedError,
)
from ringflow.engine.failures import one_line, start_failure, user_error
from ringflow.engine.layout import DataParallel, Layout, Method
from ringflow.engine.metrics import Logged
from ringflow.engine.phases import mark
from ringflow.engine.pool import HostLease, WorkerHost, driver_job, pool_key, pooled
from ringflow.engine.worker import NOSET_VISIBLE_DEVICES, Worker

__all__ = [
    "Adopted",
    "LocalGroup",
    "MembershipLost",
    "RayWorkerGroup",
    "Recovery",
    "Steps",
    "WorkerGroup",
    "WorkerHandle",
]

log = logging.getLogger("ringflow.engine")


class Steps(NamedTuple):
    """A call of steps: ``count`` steps of ``epoch`` from ``first``, committing ``commit_at``;
    ``epochs``: each epoch's global batch, where it follows the workers (``engine.epochs``)."""

    epoch: int
    first: int
    count: int
    commit_at: int | None = None
    epochs: Epochs | None = None


class Adopted(NamedTuple):
    """Where workers a lost driver of the run left go on (``RayWorkerGroup.adopted``): step
    ``step``; the driver's ``state`` at an earlier or the same commit, and what each call of
    steps since logged (``(start step, logged)``: the lost driver never collected them);
    whether the workers go on from where they are (``as_it_is``: each ended its last call
    of steps at ``step``) or roll back to their commit of it."""

    step: int
    state: dict[str, Any]
    chunks: list[tuple[int, Logged]]
    as_it_is: bool


class Recovery(NamedTuple):
    """Where training goes on after a loss (``WorkerGroup.recover``): the step, and, where
    the survivors went on from the step that failed instead of rolling back, what the steps
    of the failed call before it logged (``None`` after a rollback: nothing of it is kept)."""

    step: int
    logged: Logged | None = None


def _named(method: Method) -> str:
    """The name of ``method``, which must be one of :class:`Worker`'s own."""
    name = getattr(method, "__name__", "")
    if getattr(Worker, name, None) is not method:
        raise TypeError(f"{method!r} is not a method of Worker: workers are called by those")
    return name


class WorkerHandle:
    """One worker's Ray actor (an ``engine.pool.WorkerHost``), called with
    :class:`Worker`'s own methods: ``handle.call(Worker.evaluate, "validation")`` returns the
    call's ``ObjectRef``."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def call(self, method: Method, *args: Any, **kwargs: Any) -> Any:
        return self.actor.run.remote(_named(method), *args, **kwargs)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class WorkerGroup:
    """Calls one method of :class:`Worker` on every worker and returns their results in
    worker order."""

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        raise NotImplementedError

    def call_each(self, method: Method, arguments: list[tuple]) -> list[Any]:
        """Call ``method`` on every worker, each with its own positional ``arguments``."""
        raise NotImplementedError

    def call_first(self, count: int, method: Method, *args: Any) -> list[Any]:
        """Call ``method`` on the first ``count`` workers (a pipeline's replica 0)."""
        raise NotImplementedError

    def call_rank0(self, method: Method, *args: Any, **kwargs: Any) -> Any:
        return self.call_first(1, method, *args, **kwargs)[0]

    remembers = False
    """Whether the driver's state is kept beside each commit (``RayWorkerGroup.remember``)."""
    adopted: Adopted | None = None

    def remember(self, step: int, state: dict[str, Any]) -> None:
        """Keep the driver's state at the commit of ``step`` (where :attr:`remembers`)."""

    def commit(self, step: int) -> None:
        """Every worker keeps its state at ``step`` in memory, to roll back to."""

    @property
    def size(self) -> int:
        """The members training now (data-parallel workers, or pipeline replicas)."""
        return 1

    def train_steps(
        self,
        epoch: int,
        first: int,
        count: int,
        *,
        commit_at: int | None = None,
        then: Steps | None = None,
        then_runs_next: bool = False,
        epochs: Epochs | None = None,
    ) -> list[Any]:
        """Every worker runs steps ``first .. first + count - 1`` of ``epoch``; then, given
        ``commit_at`` (the run's step reached), commits it (:meth:`commit`).

        ``then`` names the steps the driver asks for next, unless this call fails: a group may
        send them ahead, so the workers start them as soon as these end (the next call with
        those arguments then only collects them). ``then_runs_next`` says the steps after
        ``then`` follow them at once too. ``epochs``: as :class:`Steps`'s."""
        kwargs = {} if epochs is None else {"epochs": epochs}
        results = self.call(Worker.train_steps, epoch, first, count, **kwargs)
        if commit_at is not None:
            self.commit(commit_at)
        return results

    def recover(self, lost: MembershipLost, *, at_step: int) -> Recovery:
        raise lost

    @property
    def events(self) -> list[ElasticEvent]:
        return []

    def shutdown(self, *, reuse: bool = False) -> None:
        """End the workers; ``reuse``: the run ended well, so they may serve another."""
        raise NotImplementedError


class LocalGroup(WorkerGroup):
    """Every worker of one replica in the caller's process: one directly, pipeline stages as
    threads (real gloo links on loopback). For tests, notebooks and tuning trials.

    Threads share torch's random generator, so a pipelined model with dropout draws other
    masks than it would in separate processes.
    """

    def __init__(
        self,
        module_cls: type,
        *,
        hparams: dict,
        data: Any,
        config: TrainConfig,
        layout: Layout,
        run: str | None = None,
    ) -> None:
        if config.workers != 1:
            raise ValueError(f"in_process runs exactly 1 worker (workers=1), got {config.workers}")
        if layout.size > 1 and config.gpus_per_worker:
            raise ValueError(
                "in_process runs the stages as threads on CPU: set gpus_per_worker=0, or run GPU "
                "stages as Ray actors (in_process=False)"
            )
        self._layout = layout
        self._module_cls = module_cls
        # A worker sets torch's thread count to its cpus_per_worker; the caller's comes back
        # at shutdown, so what it runs afterwards rounds as it did before.
        self._caller_threads = torch.get_num_threads()
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(layout.size, "ringflow-stage")
            if layout.size > 1
            else None
        )
        # One at a time: each worker seeds torch's generator, which threads share.
        cls = layout.worker_cls()
        self._workers = []
        for i in range(layout.size):
            try:
                worker = cls(
                    module_cls, hparams=hparams, data=data, config=config, **layout.worker_kwargs(i)
                )
            except Exception as err:
                self.shutdown()
                self._reraise(i, err)
            self._workers.append(worker)
        try:
            layout.connect(self)
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        return self.call_each(method, [args] * len(self._workers), **kwargs)

    def call_each(self, method: Method, arguments: list[tuple], **kwargs: Any) -> list[Any]:
        _named(method)
        calls = [
            functools.partial(method, w, *a, **kwargs)
            for w, a in zip(self._workers, arguments, strict=True)
        ]
        if self._pool is None:
            try:
                return [call() for call in calls]
            except Exception as err:
                self._reraise(0, err)
        return self._gather([self._pool.submit(call) for call in calls])

    def call_first(self, count: int, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        return self.call(method, *args, **kwargs)[:count]

    def _gather(self, futures: list[concurrent.futures.Future]) -> list[Any]:
        errors = [f.exception() for f in futures]
        failed = [(i, e) for i, e in enumerate(errors) if e is not None]
        if failed:
            # Prefer the worker that failed by itself over its neighbours that then lost it.
            index, err = next(
                ((i, e) for i, e in failed if not isinstance(e, PeerLostError)), failed[0]
            )
            self._reraise(index, err)
        return [f.result() for f in futures]

    def _reraise(self, index: int, err: Exception) -> NoReturn:
        """In this process ringflow's own errors are raised as they are; the module's as
        :func:`_worker_raised` says."""
        if _not_the_models(err):
            raise err
        raise _worker_raised(err, self._layout.describe(index), index, self._module_cls) from err

    def shutdown(self, *, reuse: bool = False) -> None:
        for worker in getattr(self, "_workers", []):
            worker.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        torch.set_num_threads(self._caller_threads)


class RayWorkerGroup(WorkerGroup):
    """The layout's workers as Ray actors, gang-scheduled in one placement group.

    Every call goes to the current members in rank order. When a member dies (its actor is
    gone) or stops answering (the others' collectives pass their deadline), the call raises
    :class:`MembershipLost`; :meth:`recover` then does what the layout's membership says
    (``engine.elastic.membership``). An elastic one has the coordinator decide the new
    membership, rebuilds the ring among the survivors without restarting them, and rolls
    them back to the last commit (or lets them go on from the step that failed);
    replacements start in the background in the lost workers' placement-group bundles and
    join at a later commit, once they are up. A fixed one fails naming the lost worker.

    Raises:
        EngineError: the cluster cannot place the workers within ``config.timeout_s``.
    """

    def __init__(
        self,
        module_cls: type,
        *,
        hparams: dict,
        data: Any,
        config: TrainConfig,
        layout: Layout | None = None,
        run: str | None = None,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        self._config = config
        self._layout = layout = layout or DataParallel(config)
        self._spec = {"hparams": hparams, "data": data, "config": config}
        self._module_cls = module_cls
        self._env_vars = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        if config.gpus_per_worker:
            self._env_vars[NOSET_VISIBLE_DEVICES] = "1"  # workers see each other's GPUs
        self._membership = layout.membership()
        lower = layout.lower
        _check_capacity(config, count=layout.size, what=layout.what, lower=lower)
        bundles = [_worker_bundle(config) for _ in range(layout.size)]
        self._pg = placement_group(bundles, strategy=PLACEMENTS[config.placement])
        try:
            ray.get(self._pg.ready(), timeout=config.timeout_s)
            mark("placement group ready")
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._pg)
            raise EngineError(
                f"Ray could not place {layout.size} {layout.what} of {_describe(config)} "
                f"within {config.timeout_s:.0f} s; free resources, lower {lower} or raise "
                "timeout_s"
            ) from None
        # CPU workers on one node are leased warm from the cluster's pool (engine.pool); the
        # placement group reserves their resources while the run trains.
        single = _single_node()
        # ``run`` names the run's state (its key and configuration): a driver of that run
        # lost before this one left its workers, which this one adopts (engine.pool).
        run = self._membership.adoptable(run)
        self._lease = (
            HostLease(
                pool_key(config.cpus_per_worker, self._env_vars, module_cls, data),
                self._env_vars,
                run=run,
            )
            if pooled(config.gpus_per_worker, single)
            else None
        )
        if self._lease is not None:  # pooled GPU hosts learn their bundle's GPU
            self._lease.place(self._pg, len(bundles), config.gpus_per_worker)
        self.remembers = self._lease is not None and run is not None
        """Whether rank 0 keeps the driver's state at each commit (:meth:`remember`)."""
        self._runtime_env = {"env_vars": self._env_vars} if single else None
        self._job = driver_job()
        """The job the workers write for, whatever job started their processes."""
        self._warm: list[Any] = []
        self._next_id = 0
        self._actors: dict[str, WorkerHandle] = {}
        self._units: dict[str, list[str]] = {}
        """The workers of each member unit (one worker, or a pipeline replica's stages), by
        unit id; the coordinator decides which units are members."""
        self._places: dict[str, int] = {}
        """Which place (a run of ``layout.unit`` placement-group bundles) each unit holds."""
        self._starting: dict[str, tuple[list[WorkerHandle], list[Any]]] = {}
        """Replacements being started: unit id -> (handles, refs of their starts)."""
        self._ahead: tuple[Steps, dict[str, Any], bool] | None = None
        """Steps sent before the driver asked for them (``train_steps``'s ``then``), and
        whether their workers run the next step where they end."""
        self.adopted = self._take_over(self._lease.adopt()) if self.remembers else None
        """Where the adopted workers go on from (:class:`Adopted`)."""
        units, starts = list(self._units), {}
        if self.adopted is None:
            self._warm = self._lease.take(layout.size) if self._lease is not None else []
            for place in range(config.workers):
                unit, handles, refs = self._start_unit(place, first=True)
                self._admit_unit(unit, handles)
                starts.update(zip(self._units[unit], refs, strict=True))
                units.append(unit)
        # The coordinator counts units: data-parallel workers, or pipeline replicas.
        self.coordinator = self._membership.coordinator(units)
        try:
            if self.adopted is None:
                self._started(starts)
                mark("workers built")
                layout.connect(self)
            else:
                self._rewire(joined=[])  # their ring, anew, among the same ranks
        except BaseException:
            self.shutdown()
            raise

    def _take_over(self, hosts: list[Any]) -> Adopted | None:
        """Admit ``hosts``, which a lost driver of this run left, as the ranks they were;
        where they go on from (:class:`Adopted`). ``None`` (and the hosts killed) where they
        are not the whole group or hold no commit to go on from with the driver's state."""
        import ray

        if not hosts:
            return None
        handles = [WorkerHandle(host) for host in hosts]
        try:
            standings = ray.get(
                [h.call(Worker.standing) for h in handles], timeout=self._config.timeout_s
            )
            ranks = sorted(range(len(hosts)), key=lambda i: standings[i][0])
            common = set.intersection(*(set(commits) for _, commits, _, _ in standings))
            remembered = standings[ranks[0]][2]
            if [standings[i][0] for i in ranks] != list(range(self._layout.size)):
                raise ValueError(f"their ranks do not make a whole group: {standings}")
            if remembered is None:
                raise ValueError(f"they hold no state of their driver's: {standings}")
            # Where they all are, as they are (past their last commit, where their driver
            # was lost while they trained on); else the newest commit they can go back to.
            where = {position for _, _, _, (position, _) in standings}
            here = [where.pop()] if len(where) == 1 and None not in where else []
            adopted = None
            for step in [*here, *sorted(common, reverse=True)]:
                if step >= remembered:
                    adopted = self._adopted_at(handles, ranks, step, remembered, here == [step])
                if adopted is not None:
                    break
            if adopted is None:
                raise ValueError(
                    f"no commit they hold joins up with the driver's state at step "
                    f"{remembered}: {standings}"
                )
            ray.get([host.serve.remote(self._job) for host in hosts])
        except (ray.exceptions.RayError, ValueError) as err:
            # One line: which way it failed, not Ray's account of a dead actor.
            why = (
                f"one is gone: {_why_gone(err)}"
                if isinstance(err, ray.exceptions.RayError)
                else one_line(str(err))
            )
            log.warning(
                "the %d workers a lost driver left are not adopted (%s); the run starts on "
                "new workers",
                len(hosts),
                why,
            )
            for handle in handles:
                handle.kill()
            return None
        for place, i in enumerate(ranks):
            unit = self._new_unit()
            self._places[unit] = place
            self._admit_unit(unit, [handles[i]])
        log.info(
            "adopted %d workers of a lost driver at their commit of step %d",
            len(hosts),
            adopted.step,
        )
        return adopted

    def _adopted_at(
        self, handles: list[WorkerHandle], ranks: list[int], step: int, remembered: int, here: bool
    ) -> Adopted | None:
        """Going on from step ``step``, where the workers are (``here``) or back at its
        commit: the driver's state at ``remembered`` and what every call of steps in between
        logged (merged over the workers); ``None`` where those calls do not join up."""
        import ray

        chunks: list[tuple[int, Logged]] = []
        if step != remembered:
            ranked = [handles[i] for i in ranks]  # merged in rank order, as the driver does
            parts = ray.get([h.call(Worker.chunks_since, remembered, step) for h in ranked])
            if any(part is None for part in parts):
                return None
            for index, (start, _) in enumerate(parts[0]):
                merged = Logged()
                for part in parts:
                    merged = merged.merge(part[index][1])
                chunks.append((start, merged))
        state = ray.get(handles[ranks[0]].call(Worker.driver_state, remembered))
        return Adopted(step, state, chunks, as_it_is=here)

    def remember(self, step: int, state: dict[str, Any]) -> None:
        """Rank 0 keeps the driver's ``state`` at the commit of ``step``, for a driver that
        adopts the workers if this one is lost (nothing waits for it)."""
        self._actors[self.members[0]].call(Worker.remember, step, state)

    def _started(self, starts: dict[str, Any]) -> None:
        """Wait for the workers' starts; the first one that failed fails the group as the
        start failure it is (``engine.failures.start_failure``)."""
        import ray

        timeout = self._config.timeout_s
        ready, _ = ray.wait(list(starts.values()), num_returns=len(starts), timeout=timeout)
        if len(ready) < len(starts):
            raise EngineError(
                f"{len(starts) - len(ready)} of {len(starts)} {self._layout.what} did not start "
                f"within timeout_s={timeout:g}; free the cluster's resources or raise timeout_s"
            )
        self._gather(Worker.__init__, starts)

    @property
    def members(self) -> tuple[str, ...]:
        """The member workers in rank order (a pipeline's replica-major, stage by stage)."""
        return tuple(w for unit in self.coordinator.members for w in self._units[unit])

    @property
    def events(self) -> list[ElasticEvent]:
        return self.coordinator.events

    @property
    def size(self) -> int:
        return len(self.coordinator.members)

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        refs = {w: self._actors[w].call(method, *args, **kwargs) for w in self.members}
        return self._gather(method, refs)

    def call_each(self, method: Method, arguments: list[tuple]) -> list[Any]:
        refs = {
            w: self._actors[w].call(method, *a)
            for w, a in zip(self.members, arguments, strict=True)
        }
        return self._gather(method, refs)

    def call_first(self, count: int, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        members = self.members[:count]
        refs = {w: self._actors[w].call(method, *args, **kwargs) for w in members}
        return self._gather(method, refs)

    def commit(self, step: int) -> None:
        """Every member commits ``step`` (where the membership keeps commits); then ready
        replacements join the group."""
        self._membership.commit(self, step)

    def commit_in_memory(self, step: int) -> None:
        self.call(Worker.commit, step)

    def on_commit(self, step: int, *, admit: bool) -> None:
        """The members committed ``step``; with ``admit``, ready replacements join there."""
        self.coordinator.committed(step)
        if admit:
            self._admit_ready(step)

    def train_steps(
        self,
        epoch: int,
        first: int,
        count: int,
        *,
        commit_at: int | None = None,
        then: Steps | None = None,
        then_runs_next: bool = False,
        epochs: Epochs | None = None,
    ) -> list[Any]:
        """As :meth:`WorkerGroup.train_steps`, each worker committing at the end of its own
        call (``Worker.train_steps``), and the steps ``then`` sent before these return.

        A worker runs its calls in turn, so it starts the next steps the moment these end:
        its GPU does not wait for a round trip through the driver between calls. They are
        sent only while every place is filled: a replacement adopts the commit these steps
        end at, and the next ones must start from the same membership. If these steps fail,
        the next ones fail too (a member is gone from their ring) or the run ends; whatever
        the driver asks next queues behind them.

        Sending ``then``, the workers also run its first step before waiting for these steps
        to end (``Worker.train_steps``'s ``run_next``), and with ``then_runs_next`` the
        first after ``then`` where ``then`` ends: no replacement joins at a commit where the
        members are a step past it.
        """
        steps = Steps(epoch, first, count, commit_at, epochs)
        # Sent ahead only while every place is filled (see above); then the workers may also
        # run the steps after them ahead, no replacement having to join where they end.
        filled = then is not None and not self._starting and not self.coordinator.vacancies()
        if self._ahead is not None:
            (sent, refs, ran_next), self._ahead = self._ahead, None
            if sent != steps:
                raise RuntimeError(f"steps {steps} asked for while {sent} were sent ahead")
        else:
            ran_next = filled
            refs = self._send(steps, run_next=ran_next)
        if filled:
            self._ahead = (then, self._send(then, run_next=then_runs_next), then_runs_next)
        try:
            results = self._gather(Worker.train_steps, refs)
        except BaseException:
            self._ahead = None
            raise
        if commit_at is not None:
            self._membership.committed(self, commit_at, admit=not ran_next)
        return results

    def _send(self, steps: Steps, *, run_next: bool = False) -> dict[str, Any]:
        """Ask every member for ``steps``; the refs of their calls, by member."""
        kwargs = self._membership.step_options(commit_at=steps.commit_at, run_next=run_next)
        if steps.epochs is not None:
            kwargs["epochs"] = steps.epochs
        args = (steps.epoch, steps.first, steps.count)
        return {w: self._actors[w].call(Worker.train_steps, *args, **kwargs) for w in self.members}

    def recover(self, lost: MembershipLost, *, at_step: int) -> Recovery:
        """Apply the coordinator's decision on ``lost``; return where training goes on.

        A member lost while the others recover (while they report where they are, roll
        back, rebuild the ring or admit a replacement) is one more loss for the same
        decision, counted against the same budget.

        Raises:
            EngineError: the failure budget is spent, or too few workers are left and no
                replacement came within ``config.timeout_s``.
        """
        while True:
            try:
                return self._membership.recover(self, lost, at_step=at_step)
            except MembershipLost as again:
                lost = again.adding(lost, still=self._actors.keys())

    def rebuild(self, lost: MembershipLost, *, at_step: int) -> Recovery:
        """:meth:`recover` for one loss, as an elastic membership does it
        (``engine.elastic.membership.Elastic``).

        Where every survivor failed at the same step with nothing of it kept
        (``Worker.reached``), they go on from that step as they are: no step is redone, and
        replacements join at the next commit. Otherwise they roll back to the last commit.

        Raises:
            EngineError: the failure budget is spent, or too few workers are left and no
                replacement came within ``config.timeout_s``.
        """
        if isinstance(lost, Stalled):
            decision = self.coordinator.stalled(at_step=at_step, cause=lost.cause)
            log.warning("%s", lost.cause)
            if isinstance(decision, GiveUp):
                raise EngineError(f"training stopped: {decision.reason}")
            # The units link their own workers again too: a deadline closed those links.
            self._rewire(joined=list(dict.fromkeys(self._unit_of(w) for w in lost.workers)))
            self.call(Worker.rollback, decision.step)
            log.warning(
                "every worker is alive: training goes on from the commit at step %d "
                "(%d steps redone)",
                decision.step,
                at_step - decision.step,
            )
            return Recovery(decision.step)
        # A unit goes whole: a pipeline replica is of no use without any of its stages.
        units = list(dict.fromkeys(self._unit_of(w) for w in lost.workers))
        reached, logged = self._reached([w for w in self.members if self._unit_of(w) not in units])
        decision = self.coordinator.lost(units, at_step=at_step, cause=lost.cause, reached=reached)
        log.warning("%s", lost.cause)
        for unit in units:
            self._places.pop(unit, None)  # its place is free for a replacement
            for worker in self._units.pop(unit, []):
                handle = self._actors.pop(worker, None)
                if handle is not None:
                    handle.kill()
        if isinstance(decision, GiveUp):
            raise EngineError(f"training stopped: {decision.reason}")
        step = decision.step
        if isinstance(decision, Continue) and decision.went_on:
            self._rewire(joined=[])
            self.call(Worker.go_on)
            self._fill(0, wait=False)  # replacements start now and join at a commit
            log.warning(
                "training goes on with %d %s from step %d, where they were (no step redone)",
                len(self.coordinator.members),
                self._layout.units,
                step,
            )
            return Recovery(step, logged)
        if isinstance(decision, WaitForWorkers):
            self._fill(decision.count, wait=True)
        self._rewire(joined=[])
        self.call(Worker.rollback, step)
        self._admit_ready(step)
        log.warning(
            "training goes on with %d %s from the commit at step %d (%d steps lost)",
            len(self.coordinator.members),
            self._layout.units,
            step,
            at_step - step,
        )
        return Recovery(step)

    def _reached(self, survivors: list[str]) -> tuple[int | None, Logged | None]:
        """The step every survivor failed at with nothing of it kept, and what they logged
        before it, merged; ``(None, None)`` where any must roll back (a pipeline's stages always
        do)."""
        if not survivors:
            return None, None
        calls = {w: self._actors[w].call(Worker.reached) for w in survivors}
        points = self._gather(Worker.reached, calls)
        if any(p is None for p in points) or len({step for step, _ in points}) != 1:
            return None, None
        logged = Logged()
        for _, part in points:
            logged = logged.merge(part)
        return points[0][0], logged

    def failed(self, lost: MembershipLost) -> WorkerFailedError:
        """A membership that cannot go on without a worker fails naming it."""
        worker, why = next(iter(lost.workers.items()))
        index = self.members.index(worker)
        return WorkerFailedError(f"{self._layout.describe(index)} is lost: {why}", rank=index)

    def shutdown(self, *, reuse: bool = False) -> None:
        """End the workers; with ``reuse`` (the run ended well), pooled ones are reset and go
        back to the pool, warm for the next run."""
        from ray.util.placement_group import remove_placement_group

        if self._pg is None:
            return
        starting = [handle for handles, _ in self._starting.values() for handle in handles]
        members = list(self._actors.values())
        self._actors, self._starting = {}, {}
        try:
            if self._lease is not None:  # hosts not given back clean are killed by the pool
                self._lease.give_back([h.actor for h in members], reuse=reuse)
        except Exception as err:
            log.warning("the worker pool could not take its workers back: %s", err)
            reuse = False
        if self._lease is None or not reuse:
            for handle in [*members, *starting]:
                handle.kill()
        remove_placement_group(self._pg)
        self._pg = None

    # ------------------------------------------------------------------------ membership

    def _unit_of(self, worker: str) -> str:
        """The unit ``worker`` belongs to (itself while it is not admitted yet)."""
        return next((unit for unit, workers in self._units.items() if worker in workers), worker)

    def _start_unit(
        self, place: int, *, first: bool = False
    ) -> tuple[str, list[WorkerHandle], list[Any]]:
        """Start the workers of one unit in ``place``'s bundles; its id and actors. The first
        units are workers ``place * unit ..``; a replacement's workers are made as replica
        0's (each joins at its members' rank)."""
        size = self._layout.unit
        unit = self._new_unit()
        indices = [place * size + i if first else i for i in range(size)]
        spawned = [self._spawn(place * size + i, index=index) for i, index in enumerate(indices)]
        self._places[unit] = place
        return unit, [handle for handle, _ in spawned], [start for _, start in spawned]

    def _new_unit(self) -> str:
        """A new unit's id: ``worker-N``, or ``replica-N`` for a pipeline's stages."""
        self._next_id += 1
        return f"{self._layout.unit_kind}-{self._next_id - 1}"

    def _admit_unit(self, unit: str, actors: list[WorkerHandle]) -> None:
        names = self._layout.worker_names(unit)
        for name, actor in zip(names, actors, strict=True):
            self._actors[name] = actor
        self._units[unit] = names

    def _spawn(self, bundle: int, *, index: int) -> tuple[WorkerHandle, Any]:
        """A worker for bundle ``bundle`` as worker ``index`` of the layout, and the ref of
        its start: a warm host from the pool, or a new one in the bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._warm:
            actor = self._warm.pop(0)
        elif self._lease is not None:
            actor = self._lease.take(1)[0]
        else:
            actor = (
                self._host_cls()
                .options(
                    num_cpus=self._config.cpus_per_worker,
                    num_gpus=self._config.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=bundle
                    ),
                    runtime_env=self._runtime_env,
                )
                .remote()
            )
        gpu = self._lease.gpu(bundle) if self._lease is not None else None
        start = actor.start.remote(
            self._module_cls,
            job=self._job,
            gpu=gpu,
            **self._layout.worker_kwargs(index),
            **self._spec,
        )
        return WorkerHandle(actor), start

    @staticmethod
    def _host_cls() -> Any:
        import ray

        return ray.remote(WorkerHost)

    def _fill(self, count: int, *, wait: bool) -> None:
        """Start replacement units in free places; with ``wait``, until ``count`` are up."""
        import ray

        used = {self._places[u] for u in (*self.coordinator.members, *self._starting)}
        free = [p for p in range(self._config.workers) if p not in used]
        for place in free[: max(0, self.coordinator.vacancies() - len(self._starting))]:
            unit, handles, starts = self._start_unit(place)
            self._starting[unit] = (handles, starts)
        if not wait:
            return
        pending = list(self._starting.values())
        deadline = time.monotonic() + self._config.timeout_s
        up = 0
        for _, refs in pending:
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=left)
            up += len(ready) == len(refs)
            if up >= count:
                return
        raise EngineError(
            self.coordinator.wait_failed(
                f"{count} replacement(s) not up within timeout_s={self._config.timeout_s:g}"
            ).reason
        )

    def _admit_ready(self, step: int) -> None:
        """Replacements that are up adopt the commit of ``step`` and join the ring."""
        import ray

        if self.coordinator.vacancies() > len(self._starting):
            self._fill(0, wait=False)
        ready = []
        for unit, (actors, refs) in list(self._starting.items()):
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(done) < len(refs):
                continue
            del self._starting[unit]
            try:
                ray.get(refs)
            except ray.exceptions.RayError as err:
                for actor in actors:
                    actor.kill()
                self.coordinator.spawn_failed(f"{unit} did not start: {err}")
                continue
            ready.append((unit, actors))
        if not ready:
            return
        ready = self._adopted(ready, step)
        if not ready:
            return
        for unit, actors in ready:
            self._admit_unit(unit, actors)
        self.coordinator.joined([unit for unit, _ in ready])
        log.warning(
            "%s joined at step %d; %d %s",
            ", ".join(unit for unit, _ in ready),
            step,
            len(self.coordinator.members),
            self._layout.units,
        )
        self._rewire(joined=[unit for unit, _ in ready])

    def _adopted(
        self, ready: list[tuple[str, list[Any]]], step: int
    ) -> list[tuple[str, list[Any]]]:
        """The units of ``ready`` that took the commit of ``step`` from the members; each new
        worker takes it from the member that holds the same part (a pipeline's stage) of the
        model.

        A replacement lost while it adopts (its process died, it stopped answering) is
        dropped as one that failed to start: the coordinator backs off and starts another.
        Its code raising fails the run as the module's error, and a member lost while it
        hands over its commit is lost as in any call (:class:`MembershipLost`).
        """
        import ray

        first = self._units[self.coordinator.members[0]]
        states = [self._actors[w].call(Worker.handed_commit, step) for w in first]
        calls = {
            unit: [a.call(Worker.adopt, step, states[i]) for i, a in enumerate(actors)]
            for unit, actors in ready
        }
        deadline = time.monotonic() + self._config.timeout_s
        adopted = []
        for unit, actors in ready:
            try:
                ray.get(calls[unit], timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayTaskError as err:
                raise _worker_raised(
                    err.cause, f"{unit}, in adopt", 0, self._module_cls, traceback_text=str(err)
                ) from None
            except ray.exceptions.RayError as err:
                self._gather(Worker.handed_commit, dict(zip(first, states, strict=True)))
                for actor in actors:
                    actor.kill()
                timed_out = isinstance(err, ray.exceptions.GetTimeoutError)
                why = "it stopped answering" if timed_out else _why_gone(err)
                self.coordinator.spawn_failed(
                    f"{unit} was lost while it took the commit of step {step}: {why}"
                )
                log.warning("%s was lost while it joined; another replacement starts", unit)
                continue
            adopted.append((unit, actors))
        return adopted

    def _rewire(self, *, joined: list[str]) -> None:
        """Rebuild the rings among the members, in their order, without restarting them
        (units that ``joined`` first meet each other as the layout says)."""
        self._layout.rewire(
            self,
            [[self.members.index(w) for w in self._units[unit]] for unit in joined],
        )

    def _raise_lost(
        self,
        method: str,
        called: list[str],
        lost: dict[str, str],
        blamed: list[tuple[str, CollectiveError]],
    ) -> None:
        """:class:`MembershipLost` for the workers gone, else for those the others blame;
        :class:`Stalled` when every unit is blamed by another, all alive and answering (a
        deadline passed on a slow host or a starved core: there is nobody to leave out)."""
        if lost:
            raise MembershipLost(lost, during=method)
        lost = self._blamed_peers(called, blamed)
        if lost and {self._unit_of(w) for w in lost} == {self._unit_of(w) for w in called}:
            raise Stalled(lost, during=method)
        if lost:
            raise MembershipLost(lost, during=method)

    def _blamed_peers(
        self, called: list[str], blamed: list[tuple[str, CollectiveError]]
    ) -> dict[str, str]:
        """The workers the survivors' errors name as the lost peer (their ``peer`` is a rank
        in the ring or the pipeline that raised it: the layout says which worker that is)."""
        lost: dict[str, str] = {}
        for worker, error in blamed:
            peer = self._layout.peer_of(called.index(worker), error)
            if peer is not None and 0 <= peer < len(called):
                lost.setdefault(called[peer], f"peers report: {error}")
        return lost

    def _grace(self, method: Method) -> float:
        """How long the other members of a call may still take once one failed or (in
        calls all run alike) returned: a collective's deadline, or, while they rebuild
        their ring, how long they wait there for each other (``rejoin_timeout_s``: held by
        a peer lost as they met, they fail the rebuild then instead of going silent)."""
        if method is Worker.reconfigure:
            return self._config.rejoin_timeout_s + 2.0
        return self._config.collective_timeout_s + 2.0

    def call_ranked(self, method: Method, arguments: list[tuple], workers: list[int]) -> list[Any]:
        """Call ``method`` on the members at positions ``workers``, each with its arguments."""
        members = self.members
        refs = {
            members[i]: self._actors[members[i]].call(method, *a)
            for i, a in zip(workers, arguments, strict=True)
        }
        return self._gather(method, refs)

    def _gather(self, method: Method, refs: dict[str, Any]) -> list[Any]:
        """Results in rank order, or :class:`MembershipLost` naming the lost workers.

        A worker whose actor died is lost. A worker whose call failed with a collective
        error survived but saw a peer go; once one call has failed, the others get the
        collective deadline plus a margin to finish, and a worker still busy then is lost
        too (it stopped answering: SIGSTOP, a hung host). In calls every member runs alike
        (:data:`_ALIKE`) the others get that much once one call has *returned*, too: a host
        stopped outside any collective (in a commit) would otherwise hang the run until Ray
        gives up on it, minutes later.
        """
        import ray

        pending = {ref: worker for worker, ref in refs.items()}
        results: dict[str, Any] = {}
        lost: dict[str, str] = {}
        blamed: list[tuple[str, CollectiveError]] = []
        grace_until: float | None = None
        while pending:
            timeout = None if grace_until is None else max(0.0, grace_until - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not done:
                break
            worker = pending.pop(done[0])
            try:
                results[worker] = ray.get(done[0])
            except ray.exceptions.RayActorError as err:
                if getattr(err, "actor_init_failed", False):  # raised while it started
                    where = self._layout.describe(list(refs).index(worker))
                    raise start_failure(
                        str(err), where=where, module_cls=self._module_cls
                    ) from None
                lost[worker] = _why_gone(err)
            except ray.exceptions.RayTaskError as err:
                if method is Worker.__init__:  # its start raised
                    where = self._layout.describe(list(refs).index(worker))
                    raise start_failure(
                        str(err), where=where, module_cls=self._module_cls
                    ) from None
                if not isinstance(err.cause, CollectiveError):  # the module's code, or a refusal
                    rank = list(refs).index(worker)
                    where = f"{self._layout.describe(rank)}, in {_named(method)}"
                    raise _worker_raised(
                        err.cause, where, rank, self._module_cls, traceback_text=str(err)
                    ) from None
                blamed.append((worker, err.cause))
            if (lost or blamed or method in _ALIKE) and grace_until is None:
                grace_until = time.monotonic() + self._grace(method)
        for worker in pending.values():
            lost[worker] = "it stopped answering"
        if lost or blamed:
            self._raise_lost(_named(method), list(refs), lost, blamed)
        if blamed:
            raise blamed[0][1]
        return [results[w] for w in refs]


_ALIKE = frozenset({Worker.train_steps, Worker.commit})
"""Calls in which every member does the same work, in step with the others (the same steps
and collectives; the same state copied): one member still busy long after another returned
has stopped answering."""


def _worker_raised(
    err: BaseException,
    where: str,
    rank: int,
    module_cls: type,
    *,
    traceback_text: str | None = None,
) -> Exception:
    """What a worker's exception fails the call with, decided once (``engine.failures``): a
    collective's as a failed worker, ringflow's own or a storage error after its retries as
    a failed worker naming it, the module's code (or ringflow's refusal of it) as one line
    naming the hook, which no new start of the group can fix."""
    if isinstance(err, CollectiveError) or _not_the_models(err):
        return WorkerFailedError(f"{where} raised {type(err).__name__}: {err}", rank=rank)
    return user_error(err, where=where, module_cls=module_cls, traceback_text=traceback_text)


def _not_the_models(err: BaseException) -> bool:
    """ringflow's own errors (storage, data, the engine) but its refusals of the module
    (``ModelError``), and the operating system's: not the module's code."""
    own = type(err).__module__.startswith("ringflow.") and not isinstance(err, ModelError)
    return own or isinstance(err, OSError)


def _why_gone(err: Exception) -> str:
    """Why a worker's actor is gone: the error its start raised (no GPU, a bad dataset URL:
    the last line of Ray's traceback names it), that Ray cannot reach it (a stopped or hung
    process: Ray's ``ActorUnavailableError``), or that its process died."""
    import ray

    if getattr(err, "actor_init_failed", False):
        lines = str(err).strip().splitlines()
        return f"it failed to start: {lines[-1].strip() if lines else type(err).__name__}"
    if isinstance(err, ray.exceptions.ActorUnavailableError):
        return f"it stopped answering ({type(err).__name__})"
    return f"its process died ({type(err).__name__})"


def _worker_bundle(config: TrainConfig) -> dict[str, float]:
    """The Ray resources one worker reserves: its placement-group bundle."""
    bundle: dict[str, float] = {"CPU": config.cpus_per_worker}
    if config.gpus_per_worker:
        bundle["GPU"] = config.gpus_per_worker
    return bundle


def _describe(config: TrainConfig) -> str:
    """One worker's resources in words: ``1 CPU`` or ``1 CPU and 2 GPU``."""
    return " and ".join(f"{amount:g} {name}" for name, amount in _worker_bundle(config).items())


def _check_capacity(
    config: TrainConfig, *, count: int | None = None, what: str = "workers", lower: str = "workers"
) -> None:
    """Refuse, before any worker starts, a run the whole Ray cluster could never place.

    Every worker's bundle is reserved up front (``min_workers`` only decides how many may be
    lost), so the cluster must hold all ``count`` of them (``config.workers`` by default; a
    pipeline passes its stage workers, and ``what``/``lower`` to name them in the message).

    Raises:
        EngineError: the cluster has fewer CPUs or GPUs than the workers need; the message
            names the fields to change.
    """
    import ray

    count = config.workers if count is None else count
    resources = ray.cluster_resources()
    for resource, each in _worker_bundle(config).items():
        need, have = count * each, resources.get(resource, 0)
        if need > have:
            field, nodes = (
                ("cpus_per_worker (fractions are fine)", "")
                if resource == "CPU"
                else ("gpus_per_worker (gpus_per_worker=0 trains on CPU)", " with GPUs")
            )
            raise EngineError(
                f"{count} {what} x {each:g} {resource} need {need:g} {resource}s but the Ray "
                f"cluster has {have:g}; lower {lower} or {field}, or add Ray nodes{nodes}"
            )


def _single_node() -> bool:
    """gloo must be told to use loopback when every worker shares this one machine."""
    import ray

    return len([n for n in ray.nodes() if n["Alive"]]) == 1
