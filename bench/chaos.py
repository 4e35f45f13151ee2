"""Goodput under repeated failures: ours against Ray TorchTrainer and torchft, one schedule.

Every runner trains the same model (``bench.dp_throughput.mlp`` over the bundled digits),
with the same global batch, seed and number of steps, on ``--workers`` workers, twice:
uninterrupted, then under a seeded failure schedule: once training is under way and
``--warmup`` seconds have passed, a random worker is SIGKILLed every ``--every`` seconds, and
every ``--process-every``-th failure kills the whole training process instead (the driver,
its process group, everything under it and its workers, as when the flow run's machine is
preempted), which is started again at once under the same run key, as a rescheduled flow
run is (``--failures`` stops the schedule after that many). What outlives a training job in
a deployment outlives the process here: the Ray cluster (ours, TorchTrainer) and torchft's
lighthouse are the benchmark's, one for both runs of a runner.

- ``ours``: ``engine.fit`` on Ray actors, ``min_workers=1``: the survivors roll back to their
  last in-memory commit (every ``--commit-every`` steps) and go on while a replacement
  starts and joins at a later commit; a restarted process resumes from its newest fsspec
  checkpoint (written every ``--commit-every`` steps too).
- ``torchtrainer``: Ray Train's ``TorchTrainer`` (DDP) with ``FailureConfig(max_failures=-1)``:
  a lost worker makes Ray restart the whole worker group, which loads the last checkpoint
  (model and optimizer, every ``--commit-every`` steps); a restarted process likewise.
- ``torchft``: torchft's ``DistributedDataParallel`` and ``Manager`` with a local lighthouse
  (gloo), one replica group per worker, each restarted at once when it dies, as a scheduler
  would; a restarted replica recovers the state from a live peer, and a restarted process
  from the last checkpoint (``bench/_chaos_torchft.py``).

For each: wall time uninterrupted and under the schedule, goodput (uninterrupted time / time
under failures), failures survived, steps redone, the time from each kill to the next
completed step (median and max), the final loss (cross-entropy of the final weights on the
whole training split) and its relative difference from the same runner's uninterrupted run,
and the memory (RSS and private) of the training process and of the longest-lived worker
after the warm-up and at the last step. It prints a table, then one JSON object with
``goodput`` and ``final_loss_rel_diff`` (maps from runner to figure, ``null`` where a runner
could not run, the reason in ``notes``).

    python -m bench.chaos                                   # a kill every 30 s, ~10 min each
    python -m bench.chaos --runners ours --epochs 720 --process-every 1000 \
        --spare-oldest --under-failures-only                # memory over 30 min of kills
    python -m bench.chaos --runners ours --epochs 8 --every 3 --warmup 2   # a short check

A runner whose training run has not ended ``--deadline`` seconds after it started is stopped
and reported as not finished (``null``, the reason in ``notes``), so that a peer that never
comes back from a failure ends the benchmark's run of it, not the benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bench import headline_json

if TYPE_CHECKING:
    import torch

HEADLINE = ("goodput", "final_loss_rel_diff")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

BATCH = 64
"""The global batch, for every runner."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What every runner trains: the same for all, passed to each training process."""

    workers: int
    epochs: int
    hidden: int
    layers: int
    lr: float
    commit_every: int
    seed: int


@dataclass(kw_only=True)
class Run:
    """One training run of one runner, as the benchmark saw it."""

    wall_s: float
    kills: list[tuple[float, str]] = field(default_factory=list)
    """When each failure was caused, and what: ``worker`` or ``process``."""
    steps: list[tuple[float, int]] = field(default_factory=list)
    """Each completed step (host time, step number), as the training logged it."""
    final_loss: float = float("nan")
    memory: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    """``process`` and ``survivor``: ``rss`` and ``private`` memory in MiB after the warm-up
    and at the last step (``_Memory.summary``)."""
    crashes: list[str] = field(default_factory=list)
    """Under the schedule, each time the training process failed on its own after a failure
    of ours (the end of its output): it was started again, as a deployment's automations
    bring a crashed run back, and the time counts against its goodput."""

    def recoveries(self) -> list[float]:
        """For each kill, the seconds until the next completed step."""
        out = []
        for at, _ in self.kills:
            after = [t for t, _ in self.steps if t > at]
            if after:
                out.append(min(after) - at)
        return out

    def redone(self) -> int:
        """Steps completed more than once (rolled back or resumed past)."""
        return len(self.steps) - len({s for _, s in self.steps})


# ----------------------------------------------------------------------------- runners


class Runner:
    """A peer: how to start its training process and how to tell its workers."""

    name = ""
    system_config: dict = {}
    """Ray's settings for the cluster this runner's processes train on."""
    worker_title = ""
    """What a worker process's command line holds."""
    warm_workers = False
    """Whether its workers outlive a run on the cluster (ours' pool): both of its runs then
    start on warm ones, after a warm-up run, as on a stack that trained before."""

    def workers(self) -> list[int]:
        """The processes of the workers training now: under the training process, or under
        the cluster this process holds (Ray's actors are the raylet's children)."""
        pids = []
        for proc in _descendants(os.getpid()):
            try:
                if self.worker_title in " ".join(proc.cmdline()):
                    pids.append(proc.pid)
            except Exception:  # noqa: BLE001 - it ended while we looked
                continue
        return sorted(pids)

    def command(self, workload: Workload, root: str, name: str) -> list[str]:
        return [sys.executable, "-m", "bench.chaos", "--child", self.name, root, name]

    def available(self) -> str | None:
        """Why this runner cannot run here, or ``None``."""
        return None

    @contextlib.contextmanager
    def cluster(self, workload: Workload) -> Iterator[dict[str, str]]:
        """What outlives a training process (a Ray cluster, torchft's lighthouse), held by
        the benchmark for both runs; the variables that point the training processes at it."""
        import ray

        ray.init(
            address="local",
            num_cpus=workload.workers + 1,
            include_dashboard=False,
            log_to_driver=False,
            _system_config=self.system_config,
        )
        try:
            yield {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        finally:
            ray.shutdown()


class Ours(Runner):
    name, worker_title = "ours", "ray::Worker"
    warm_workers = True

    def workers(self) -> list[int]:
        """The pool's workers leased to a training process (its idle ones train nothing),
        where this process holds the cluster; else whatever looks like a worker."""
        import ray

        found = super().workers()
        if not ray.is_initialized():
            return found
        from ringflow.engine.pool import worker_pids

        leased = set(worker_pids()["leased"])
        return [pid for pid in found if pid in leased]

    # Ray's idle workers import these before an actor needs them (each runner its own).
    system_config = {"preload_python_modules": ["torch", "lightning", "ringflow.engine.worker"]}


class TorchTrainerRunner(Runner):
    name, worker_title = "torchtrainer", "ray::RayTrainWorker"
    system_config = {"preload_python_modules": ["torch", "ray.train.torch"]}

    def available(self) -> str | None:
        try:
            import ray.train.torch  # noqa: F401
        except ImportError as err:
            return f"Ray Train is not installed ({err})"
        return None


class TorchFT(Runner):
    name, worker_title = "torchft", "torchft-replica"  # bench._chaos_torchft.TITLE

    def command(self, workload: Workload, root: str, name: str) -> list[str]:
        return [sys.executable, "-m", "bench._chaos_torchft", "supervise", root, name]

    @contextlib.contextmanager
    def cluster(self, workload: Workload) -> Iterator[dict[str, str]]:
        from bench._chaos_torchft import lighthouse

        with lighthouse() as address:
            yield {"TORCHFT_LIGHTHOUSE": address}

    def available(self) -> str | None:
        try:
            import torchft  # noqa: F401
        except ImportError as err:
            return f"torchft is not installed ({err}): pip install torchft"
        return None


RUNNERS: dict[str, Runner] = {r.name: r for r in (Ours(), TorchTrainerRunner(), TorchFT())}


# ----------------------------------------------------------------------------- the schedule


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runners", default="ours,torchtrainer,torchft")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=260, help="of the digits, 23 steps each")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's, for every runner")
    parser.add_argument("--commit-every", type=int, default=20, help="steps between commits")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between failures")
    parser.add_argument("--process-every", type=int, default=10, help="every Nth: the process")
    parser.add_argument("--failures", type=int, help="at most this many (default: no limit)")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before the first")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model and the schedule")
    parser.add_argument(
        "--deadline",
        type=float,
        help="seconds a training run may take before its runner is stopped and reported as "
        "not finished (default: no limit)",
    )
    parser.add_argument(
        "--spare-oldest",
        action="store_true",
        help="never kill the oldest worker: it lives through every failure, and its memory "
        "shows what recoveries leave behind (with --process-every above --failures, the "
        "training process does too)",
    )
    parser.add_argument(
        "--under-failures-only",
        action="store_true",
        help="skip the uninterrupted run (no goodput): a memory run",
    )
    parser.add_argument("--keep", help="keep the runs' files in this folder")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin each worker (each thread of its process) to a core of its own, cores 1 and "
        "up, as it appears (a replacement too); the training process and Ray's own processes "
        "share the rest: on a host with at least workers + 1 cores",
    )
    args = parser.parse_args(argv)
    workload = Workload(
        workers=args.workers,
        epochs=args.epochs,
        hidden=args.hidden,
        layers=args.layers,
        lr=args.lr,
        commit_every=args.commit_every,
        seed=args.seed,
    )
    from ringflow.engine.cluster import quiet_environment

    # The children inherit these; torchft's Rust side would log every quorum at INFO.
    quiet_environment(GLOO_SOCKET_IFNAME="lo", RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    # Stopped, the benchmark ends what it started (``_run``'s ``finally``) before it exits.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows, notes = {}, {}
    with tempfile.TemporaryDirectory(prefix="ringflow-chaos-") as scratch:
        root = args.keep or scratch
        Path(root).mkdir(parents=True, exist_ok=True)
        _write_data(root, workload)
        for name in args.runners.split(","):
            runner = RUNNERS[name]
            why = runner.available()
            if why is not None:
                notes[name] = why
                continue
            try:
                with runner.cluster(workload) as env:
                    if runner.warm_workers:
                        warm = replace(workload, epochs=1)
                        _run(runner, warm, root, f"{name}-warm-up", args, env, chaos=False)
                    calm = None
                    if not args.under_failures_only:
                        calm = _run(runner, workload, root, f"{name}-calm", args, env, chaos=False)
                    chaos = _run(runner, workload, root, f"{name}-chaos", args, env, chaos=True)
            except RuntimeError as err:
                notes[name] = str(err)
                continue
            rows[name] = (calm, chaos)
            print(f"# {name}: {_line(calm, chaos)}", flush=True)
    summary = _report(rows, notes, args)
    print(headline_json(summary, HEADLINE))
    return summary


def _run(
    runner: Runner, workload: Workload, root: str, name: str, args, env: dict, *, chaos: bool
) -> Run:
    """Train once (under the schedule if ``chaos``), restarting a killed process at once."""
    rng = random.Random(args.seed)
    Path(f"{root}/{name}").mkdir()
    Path(f"{root}/{name}/workload.json").write_text(json.dumps(asdict(workload)))
    steps_log = Path(f"{root}/{name}/steps.log")
    started = time.time()
    run = Run(wall_s=0.0)
    child = _start(runner, workload, root, name, env)
    memory = _Memory(runner, lambda: child)
    memory.start()
    pins = _Pins(runner, on=getattr(args, "pin", False))
    pins.start()
    next_kill = None
    try:
        while (status := child.poll()) != 0:
            if args.deadline and time.time() - started > args.deadline:
                raise RuntimeError(
                    f"{name} did not finish within {args.deadline:.0f} s "
                    f"(after {len(run.kills)} failures, {_progress(steps_log, root, workload)}):"
                    f" {_last_words(root, name)}"
                )
            if status is not None:  # it failed on its own: not a kill of ours
                why = _last_words(root, name)
                if not run.kills or len(run.crashes) == _CRASHES:
                    raise RuntimeError(f"{runner.name}'s training failed ({status}): {why}")
                run.crashes.append(why)
                child = _start(runner, workload, root, name, env)
                continue
            time.sleep(0.05)
            if next_kill is None:
                if steps_log.exists() and steps_log.stat().st_size:  # under way
                    next_kill = time.time() + args.warmup
                    memory.warmed_at = next_kill
                continue
            if not chaos or time.time() < next_kill or len(run.kills) == args.failures:
                continue
            number = len(run.kills) + 1
            if number % args.process_every == 0:
                _kill_tree(child.pid)
                child.wait()
                run.kills.append((time.time(), "process"))
                child = _start(runner, workload, root, name, env)
            elif _kill_a_worker(runner, rng, workload.workers, spare_oldest=args.spare_oldest):
                run.kills.append((time.time(), "worker"))
            else:
                continue  # its workers are not all up yet: at the next look
            next_kill += args.every
    finally:
        if child.poll() is None:
            _kill_tree(child.pid)
        memory.stop()
        pins.stop()
    run.wall_s = time.time() - started
    Path(f"{root}/{name}/kills.json").write_text(json.dumps(run.kills))
    run.steps = [(float(t), int(s)) for t, s in (line.split() for line in steps_log.open())]
    run.final_loss = json.loads(Path(f"{root}/{name}/result.json").read_text())["final_loss"]
    run.memory = memory.summary(until=max(t for t, _ in run.steps))
    Path(f"{root}/{name}/memory.json").write_text(json.dumps(memory.series()))
    return run


def _progress(steps_log: Path, root: str, workload: Workload) -> str:
    """How far a run got: its last logged step of all it was to train (a deadline too short
    for the workload on this host reads as such, not as a hang)."""
    total = workload.epochs * steps_per_epoch(root)
    lines = steps_log.read_text().split("\n") if steps_log.exists() else []
    last = next((line.split()[1] for line in reversed(lines) if line.strip()), None)
    return f"at step {last} of {total}" if last is not None else f"no step of {total} yet"


def _last_words(root: str, name: str) -> str:
    """The end of a training process's output, where its error is, without Ray's log lines."""
    lines = Path(f"{root}/{name}/output.log").read_text().splitlines()
    said = [line.strip() for line in lines if line.strip() and not _LOG_LINE.match(line)]
    return " ".join(" ".join(said[-4:]).split())[-400:]


_LOG_LINE = re.compile(r"^(\([^)]*\) )?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+[A-Z]+\s")
"""A Ray or logging line (``2026-12-05 10:05:01,214 INFO worker.py:1691 -- ...``)."""

_CRASHES = 3
"""Crashes after a failure of ours that a runner is started again from, under the schedule."""


def _start(runner: Runner, workload: Workload, root: str, name: str, env: dict) -> subprocess.Popen:
    log = open(f"{root}/{name}/output.log", "a")  # noqa: SIM115 - the child writes until it ends
    return subprocess.Popen(
        runner.command(workload, root, name),
        env={**os.environ, **env},
        start_new_session=True,  # its own process group: killed whole, as a host is lost
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).parents[1],
    )


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_tree(pid: int) -> None:
    """SIGKILL the process, its group and everything under it (Ray's own processes too)."""
    below = _descendants(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for proc in below:
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - gone already
            continue


def _workers(runner: Runner) -> list[int]:
    return runner.workers()


def _kill_a_worker(
    runner: Runner, rng: random.Random, workers: int, *, spare_oldest: bool = False
) -> bool:
    """SIGKILL a random one of the workers (with ``spare_oldest``, not the one that started
    first), once all ``workers`` are up."""
    import psutil

    pids = _workers(runner)
    if len(pids) < workers:
        return False
    if spare_oldest:
        try:
            pids.remove(min(pids, key=lambda pid: psutil.Process(pid).create_time()))
        except psutil.Error:
            return False
        if not pids:
            return False
    try:
        os.kill(rng.choice(pids), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


class _Memory:
    """Samples the memory of the training process and of each worker every second: RSS, and
    the process's private memory (USS: what ending it would free; RSS also counts the pages
    of Ray's shared object store a worker wrote a commit into for a joining worker)."""

    def __init__(self, runner: Runner, child) -> None:
        self._runner, self._child = runner, child
        self._workers: dict[int, list[tuple[float, float, float]]] = {}
        self._processes: dict[int, list[tuple[float, float, float]]] = {}
        self.warmed_at = float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            now = time.time()
            _measure(self._child().pid, now, self._processes)
            for pid in _workers(self._runner):
                _measure(pid, now, self._workers)

    def summary(self, *, until: float) -> dict[str, dict[str, tuple[float, float]]]:
        """RSS and private memory after the warm-up and at the last step (``until``; not
        what the process does after training), of the training process and of the worker
        that lived longest through the failures (each started once)."""
        out = {}
        for what, samples in (("process", self._processes), ("survivor", self._workers)):
            series = _longest(samples)
            # A worker started during the run imports torch and adopts a commit first.
            since = max(self.warmed_at, series[0][0] + _SETTLE_S) if series else 0.0
            warm = [(rss, private) for t, rss, private in series if since <= t <= until]
            if len(warm) >= 2:
                out[what] = {
                    "rss": (round(warm[0][0], 1), round(warm[-1][0], 1)),
                    "private": (round(warm[0][1], 1), round(warm[-1][1], 1)),
                }
        return out

    def series(self) -> dict[str, list[tuple[float, float, float]]]:
        """Every sample (time, RSS, private) of the process and the survivor of
        :meth:`summary`."""
        return {"process": _longest(self._processes), "survivor": _longest(self._workers)}


class _Pins:
    """Pins each of a runner's workers to a core of its own (every thread of it, looked at
    every 0.2 s: threads started later are pinned too), cores 1 and up; a dead worker's core
    goes to the next one that appears; nothing unless ``on``."""

    def __init__(self, runner: Runner, *, on: bool) -> None:
        self._runner, self._on = runner, on
        self._cores = sorted(os.sched_getaffinity(0))[1:]  # the first: the training process
        self._held: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pin, daemon=True)

    def start(self) -> None:
        if self._on:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._on:
            self._thread.join()

    def _pin(self) -> None:
        while not self._stop.wait(0.2):
            alive = set(_workers(self._runner))
            self._held = {pid: core for pid, core in self._held.items() if pid in alive}
            for pid in sorted(alive):
                free = [c for c in self._cores if c not in self._held.values()]
                if pid not in self._held and free:
                    self._held[pid] = free[0]
                if pid in self._held:
                    _pin_threads(pid, self._held[pid])


def _pin_threads(pid: int, core: int) -> None:
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in threads:
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(int(tid)) != {core}:
                os.sched_setaffinity(int(tid), {core})


_SETTLE_S = 15.0
"""Seconds after a process's first sample before its memory counts (it is still starting)."""


def _measure(pid: int, now: float, into: dict[int, list[tuple[float, float, float]]]) -> None:
    import psutil

    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return
    if info.rss:  # 0: killed, not yet reaped
        into.setdefault(pid, []).append((now, info.rss / 2**20, info.uss / 2**20))


def _longest(samples: dict[int, list[tuple[float, float, float]]]) -> list:
    if not samples:
        return []
    return max(samples.values(), key=lambda s: s[-1][0] - s[0][0])


# ----------------------------------------------------------------------------- training


def _write_data(root: str, workload: Workload) -> None:
    """The digits, preprocessed once for every runner; the training split as tensors."""
    from safetensors.torch import save_file

    from bench.dp_throughput import _digits, _train_arrays

    data = _digits(f"{root}/data")
    x, y = _train_arrays(data)
    save_file({"x": x.contiguous(), "y": y.contiguous()}, f"{root}/train.safetensors")
    Path(f"{root}/data.json").write_text(json.dumps({"dataset_url": data.dataset_url}))


def training_split(root: str) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    arrays = load_file(f"{root}/train.safetensors")
    return arrays["x"], arrays["y"]


def final_loss(net: torch.nn.Module, root: str) -> float:
    """The cross-entropy of ``net`` on the whole training split: every runner's last figure."""
    import torch

    x, y = training_split(root)
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(net(x / 16.0), y).item()


def steps_per_epoch(root: str) -> int:
    return -(-len(training_split(root)[1]) // BATCH)


def _child(runner: str, root: str, name: str) -> None:
    """One training process of ``runner``: resumes the run's checkpoint if it has one."""
    from ringflow.engine.cluster import quiet_environment

    quiet_environment(GLOO_SOCKET_IFNAME="lo")  # before Ray is imported: it reads them then
    import ray

    # Connected first, the cluster starts this job's workers (importing what they preload)
    # while this process imports torch and the rest.
    ray.init(log_to_driver=False)  # the benchmark's cluster: RAY_ADDRESS
    workload = Workload(**json.loads(Path(f"{root}/{name}/workload.json").read_text()))
    loss = {"ours": _train_ours, "torchtrainer": _train_torchtrainer}[runner](workload, root, name)
    Path(f"{root}/{name}/result.json").write_text(json.dumps({"final_loss": loss}))


def _train_ours(workload: Workload, root: str, name: str) -> float:
    import ray

    from bench.dp_throughput import mlp
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.models.digits import SCHEMA

    url = json.loads(Path(f"{root}/data.json").read_text())["dataset_url"]
    result = fit(
        _logged_classifier(),
        hparams={
            "hidden": workload.hidden,
            "layers": workload.layers,
            "lr": workload.lr,
            "steps_log": f"{root}/{name}/steps.log",
        },
        data=DataSpec(dataset_url=url, schema=SCHEMA),
        config=TrainConfig(
            workers=workload.workers,
            min_workers=1,
            epochs=workload.epochs,
            batch_size=BATCH,
            seed=workload.seed,
            commit_every=workload.commit_every,
            checkpoint_every=workload.commit_every,
            max_failures=10_000,
            collective_timeout_s=5.0,
            cpus_per_worker=1,
        ),
        checkpoint_uri=f"{root}/{name}/model",
        store_url=f"{root}/{name}/store",
        run_key="chaos",
    )
    ray.shutdown()
    net = mlp(hidden=workload.hidden, layers=workload.layers)
    net.load_state_dict({k.removeprefix("net."): v for k, v in result.state_dict.items()})
    return final_loss(net, root)


def _logged_classifier() -> type:
    """``bench.dp_throughput``'s classifier, each completed step logged by rank 0."""
    from bench.dp_throughput import bench_classifier

    base = bench_classifier()

    class Logged(base):
        def __init__(self, *, steps_log: str, **hparams) -> None:
            super().__init__(**hparams)
            self._steps_log = steps_log

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            if self.trainer.global_rank == 0:
                with open(self._steps_log, "a") as log:
                    log.write(f"{time.time()} {self.global_step}\n")

    return Logged


def _train_torchtrainer(workload: Workload, root: str, name: str) -> float:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from bench.dp_throughput import mlp

    TorchTrainer(
        _torchtrainer_loop,
        train_loop_config={"workload": asdict(workload), "root": root, "name": name},
        scaling_config=ScalingConfig(num_workers=workload.workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            storage_path=f"{root}/{name}/ray",
            name="chaos",
            failure_config=FailureConfig(max_failures=-1),
        ),
    ).fit()
    ray.shutdown()
    net = mlp(hidden=workload.hidden, layers=workload.layers)
    net.load_state_dict(_load_checkpoint(f"{root}/{name}/checkpoint.pt")["model"])
    return final_loss(net, root)


def _torchtrainer_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch

    from bench.dp_throughput import mlp

    torch.set_num_threads(1)
    workload, root, name = Workload(**config["workload"]), config["root"], config["name"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(workload.seed)
    model = mlp(hidden=workload.hidden, layers=workload.layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=workload.lr)
    path, start = f"{root}/{name}/checkpoint.pt", 0
    if os.path.exists(path):
        state = _load_checkpoint(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    model = ray.train.torch.prepare_model(model)
    x, y = training_split(root)
    per_epoch, total = steps_per_epoch(root), workload.epochs * steps_per_epoch(root)
    for step in range(start, total):
        epoch, position = divmod(step, per_epoch)
        order = torch.randperm(
            len(y), generator=torch.Generator().manual_seed(workload.seed + epoch)
        )
        mine = torch.tensor_split(order[position * BATCH : (position + 1) * BATCH], world)[rank]
        loss = torch.nn.functional.cross_entropy(model(x[mine] / 16.0), y[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank != 0:
            continue
        with open(f"{root}/{name}/steps.log", "a") as log:
            log.write(f"{time.time()} {step + 1}\n")
        if (step + 1) % workload.commit_every == 0 or step + 1 == total:
            _save_checkpoint(path, model.module, optimizer, step + 1)


def _save_checkpoint(path: str, model, optimizer, step: int) -> None:
    """Model, optimizer and step, written whole or not at all (a temporary file renamed)."""
    import torch

    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    torch.save(state, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def _load_checkpoint(path: str) -> dict:
    import torch

    return torch.load(path, weights_only=True)  # the benchmark's own file: tensors and numbers


# ----------------------------------------------------------------------------- the report


def _line(calm: Run | None, chaos: Run) -> str:
    if calm is None:
        return f"{chaos.wall_s:.0f} s under {len(chaos.kills)} failures"
    return (
        f"{calm.wall_s:.0f} s uninterrupted, {chaos.wall_s:.0f} s under {len(chaos.kills)} "
        f"failures, goodput {calm.wall_s / chaos.wall_s:.3f}"
    )


def _figure(value: float | None, spec: str) -> str:
    """``value`` in a column of the table's, ``-`` where there is none."""
    width = int(spec.split(".")[0])
    return "-".rjust(width) if value is None else format(value, spec)


def _seconds(values: list[float], how) -> str:
    return f"{how(values):.2f}" if values else "-"


def _report(rows: dict[str, tuple[Run | None, Run]], notes: dict[str, str], args) -> dict:
    head = (
        f"{'runner':14}{'calm s':>8}{'chaos s':>9}{'goodput':>9}{'kills':>7}{'redone':>8}"
        f"{'to step med':>13}{'max':>7}{'final loss':>12}{'rel diff':>10}  memory MiB"
    )
    print(head)
    goodput, rel, summary_rows = {}, {}, {}
    for name in args.runners.split(","):
        if name not in rows:
            print(f"{name:14}  not run: {notes.get(name, '')}")
            goodput[name] = rel[name] = None
            continue
        calm, chaos = rows[name]
        back = chaos.recoveries()
        if calm is None:
            notes.setdefault(name, "no uninterrupted run (--under-failures-only)")
            goodput[name] = rel[name] = None
        else:
            goodput[name] = round(calm.wall_s / chaos.wall_s, 4)
            rel[name] = abs(chaos.final_loss - calm.final_loss) / abs(calm.final_loss)
        memory = ", ".join(
            f"{what} " + " ".join(f"{kind} {a:.0f}->{b:.0f}" for kind, (a, b) in sizes.items())
            for what, sizes in chaos.memory.items()
        )
        print(
            f"{name:14}{_figure(calm and calm.wall_s, '8.1f')}{chaos.wall_s:9.1f}"
            f"{_figure(goodput[name], '9.3f')}{len(chaos.kills):7d}{chaos.redone():8d}"
            f"{_seconds(back, statistics.median):>13}{_seconds(back, max):>7}"
            f"{chaos.final_loss:12.3e}{_figure(rel[name], '10.2e')}  {memory}"
        )
        summary_rows[name] = {
            "uninterrupted_s": calm and round(calm.wall_s, 2),
            "under_failures_s": round(chaos.wall_s, 2),
            "failures": len(chaos.kills),
            "process_failures": sum(1 for _, what in chaos.kills if what == "process"),
            "steps_redone": chaos.redone(),
            "kill_to_step_median_s": round(statistics.median(back), 3) if back else None,
            "kill_to_step_max_s": round(max(back), 3) if back else None,
            "final_loss": chaos.final_loss,
            "final_loss_abs_diff": calm and abs(chaos.final_loss - calm.final_loss),
            "memory_mib": chaos.memory,
            "crashes": chaos.crashes,
        }
        for crash in chaos.crashes:
            print(f"{'':14}  crashed on its own after a failure, started again: {crash}")
    return {
        "goodput": goodput,
        "final_loss_rel_diff": rel,
        "runners": summary_rows,
        "every_s": args.every,
        "process_every": args.process_every,
        "workers": args.workers,
        "pinned": bool(getattr(args, "pin", False)),
        "notes": notes,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(*sys.argv[2:5])
    else:
        main()
