"""Recovery from a lost worker: ours against Ray Train's ``TorchTrainer`` with ``FailureConfig``.

The same model (the digits MLP), data, global batch and seed, 2 workers, one worker
SIGKILLed in the middle of training:

- ``ours``: ``engine.fit`` on Ray actors with ``min_workers=1``: the survivor rolls back to
  the last in-memory commit and goes on while a replacement starts and joins later.
- ``Ray TorchTrainer``: DDP in Ray Train v2 with ``FailureConfig(max_failures=1)`` and a
  checkpoint every ``--commit-every`` steps (safetensors): Ray restarts the whole worker
  group, which loads the last checkpoint.

Recovery time is from the kill to the next completed training step; steps lost are the
steps done since the last commit (ours) or checkpoint (TorchTrainer), done again after it.
The last line is one JSON object with ``ours_recovery_s``, ``torchtrainer_recovery_s`` and
``steps_lost_per_failure``.

    python -m bench.recovery
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

from bench import headline_json

HEADLINE = ("speedup", "ours_recovery_s", "torchtrainer_recovery_s")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

WORKERS = 2


@dataclass(frozen=True, kw_only=True)
class Recovery:
    runner: str
    recovery_s: float
    """From the kill to the next completed step."""
    steps_lost: int
    detail: str


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--commit-every", type=int, default=10, help="steps between commits")
    parser.add_argument("--kill-after-s", type=float, default=2.0, help="into the training loop")
    parser.add_argument("--runners", default="ours,torchtrainer")
    args = parser.parse_args(argv)
    from ringflow.engine.cluster import quiet_environment

    quiet_environment(GLOO_SOCKET_IFNAME="lo")  # Ray binds to loopback only
    results = []
    with tempfile.TemporaryDirectory(prefix="ringflow-recovery-") as root:
        for runner in args.runners.split(","):
            results.append(_RUNNERS[runner](args, root))
            print(f"# {results[-1]}", flush=True)
    summary = _report(args, results)
    print(headline_json(summary, HEADLINE))
    return summary


# ---------------------------------------------------------------------------- ours


def _run_ours(args: argparse.Namespace, root: str) -> Recovery:
    import ray

    from bench.dp_throughput import _digits
    from ringflow.engine import TrainConfig, fit
    from ringflow.models.digits import DigitsClassifier

    data = _digits(f"{root}/data")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    killed: list[float] = []
    try:
        killer = _Killer("ray::Worker", killed, after_s=args.kill_after_s)
        started = threading.Event()

        def on_epoch(_metrics) -> None:
            if not started.is_set():
                started.set()
                killer.start()

        result = fit(
            DigitsClassifier,
            hparams={"hidden": args.hidden, "lr": 0.01},
            data=data,
            config=TrainConfig(
                workers=WORKERS,
                min_workers=1,
                epochs=args.epochs,
                batch_size=64,
                commit_every=args.commit_every,
                collective_timeout_s=5.0,
            ),
            checkpoint_uri=f"{root}/ours-model",
            on_epoch=on_epoch,
        )
    finally:
        ray.shutdown()
    lost = next((e for e in result.events if e.kind == "lost"), None)
    if not killed or lost is None:  # a worker killed once the run ended is no loss
        raise RuntimeError("training ended before the kill: raise --epochs")
    # After a loss the engine commits after a single step: "recovered" is that step done.
    recovered = next(e for e in result.events if e.kind == "recovered")
    return Recovery(
        runner="ours",
        recovery_s=recovered.at - killed[0],
        steps_lost=lost.steps_lost,
        detail=f"loss seen after {lost.at - killed[0]:.2f} s; events "
        + ", ".join(e.kind for e in result.events),
    )


# ---------------------------------------------------------------------------- TorchTrainer


def _run_torchtrainer(args: argparse.Namespace, root: str) -> Recovery:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from bench.dp_throughput import _digits, _train_arrays

    x, y = _train_arrays(_digits(f"{root}/tt-data"))
    steps_file = f"{root}/torchtrainer-steps.txt"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    killed: list[float] = []
    try:
        killer = _Killer("ray::RayTrainWorker", killed, after_s=args.kill_after_s)
        watcher = threading.Thread(
            target=_start_when_training, args=(steps_file, killer), daemon=True
        )
        watcher.start()
        TorchTrainer(
            _torchtrainer_loop,
            train_loop_config={
                "x": x,
                "y": y,
                "hidden": args.hidden,
                "epochs": args.epochs,
                "every": args.commit_every,
                "steps_file": steps_file,
            },
            scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(
                storage_path=f"{root}/torchtrainer",
                name="recovery",
                failure_config=FailureConfig(max_failures=1),
            ),
        ).fit()
    finally:
        ray.shutdown()
    if not killed:
        raise RuntimeError("training ended before the kill: raise --epochs")
    with open(steps_file) as f:
        lines = [line.split() for line in f.read().splitlines()]
    records = [(float(t), int(step), kind) for t, step, kind in lines]
    before = [step for t, step, kind in records if kind == "step" and t < killed[0]]
    resumed = next(step for t, step, kind in records if kind == "resume" and t > killed[0])
    first_after = next(t for t, _, kind in records if kind == "step" and t > killed[0])
    return Recovery(
        runner="Ray TorchTrainer",
        recovery_s=first_after - killed[0],
        steps_lost=max(before) + 1 - resumed,
        detail=f"restarted the worker group; resumed at step {resumed}",
    )


def _start_when_training(steps_file: str, killer: _Killer) -> None:
    while not (os.path.exists(steps_file) and os.path.getsize(steps_file) > 0):
        time.sleep(0.05)
    killer.start()


def _torchtrainer_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    from safetensors.torch import load_file

    from bench.dp_throughput import mlp

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    torch.manual_seed(0)
    model = mlp(hidden=config["hidden"], layers=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            model.load_state_dict(load_file(f"{d}/model.safetensors"))
            with open(f"{d}/step.json") as f:
                start = json.load(f)["step"]
    model = ray.train.torch.prepare_model(model)
    with open(config["steps_file"], "a", buffering=1) as log:
        if rank == 0:
            log.write(f"{time.time()} {start} resume\n")
        _torchtrainer_steps(model, optimizer, config, start=start, log=log if rank == 0 else None)


def _torchtrainer_steps(model, optimizer, config: dict, *, start: int, log) -> None:
    import ray.train
    from safetensors.torch import save_file

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    x, y = config["x"], config["y"]
    steps_per_epoch = -(-len(y) // 64)
    for step in range(start, config["epochs"] * steps_per_epoch):
        epoch, pos = divmod(step, steps_per_epoch)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        batch = torch.tensor_split(order[pos * 64 : (pos + 1) * 64], world)[rank]
        loss = torch.nn.functional.cross_entropy(model(x[batch] / 16), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if log:
            log.write(f"{time.time()} {step} step\n")
        if (step + 1) % config["every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    save_file(
                        {k: v.contiguous() for k, v in model.module.state_dict().items()},
                        f"{d}/model.safetensors",
                    )
                    with open(f"{d}/step.json", "w") as f:
                        json.dump({"step": step + 1}, f)
                ray.train.report(
                    {"step": step + 1},
                    checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None,
                )


# ---------------------------------------------------------------------------- shared


class _Killer:
    """SIGKILLs one process whose title starts with ``title``, among this process's children."""

    def __init__(self, title: str, killed: list[float], *, after_s: float) -> None:
        self.title, self.killed, self.after_s = title, killed, after_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import psutil

        time.sleep(self.after_s)
        for proc in psutil.Process().children(recursive=True):
            try:
                title = " ".join(proc.cmdline())
                if title.startswith(self.title):
                    os.kill(proc.pid, signal.SIGKILL)
                    self.killed.append(time.time())
                    print(f"# killed {proc.pid} ({title[:60]})", flush=True)
                    return
            except psutil.Error:
                continue


def _report(args: argparse.Namespace, results: list[Recovery]) -> dict:
    print(f"\n{'runner':20}{'recovery s':>12}{'steps lost':>12}  detail")
    for r in results:
        print(f"{r.runner:20}{r.recovery_s:12.2f}{r.steps_lost:12d}  {r.detail}")
    by = {r.runner: r for r in results}
    ours, tt = by.get("ours"), by.get("Ray TorchTrainer")
    summary = {
        "ours_recovery_s": round(ours.recovery_s, 3) if ours else None,
        "torchtrainer_recovery_s": round(tt.recovery_s, 3) if tt else None,
        "steps_lost_per_failure": ours.steps_lost if ours else None,
        "torchtrainer_steps_lost_per_failure": tt.steps_lost if tt else None,
        "commit_every": args.commit_every,
    }
    if ours and tt:
        summary["speedup"] = round(tt.recovery_s / ours.recovery_s, 2)
    return summary


_RUNNERS = {"ours": _run_ours, "torchtrainer": _run_torchtrainer}


if __name__ == "__main__":
    main()
