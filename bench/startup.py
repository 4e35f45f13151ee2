"""Start-up costs: what a small job pays around its training, cold and warm.

Four figures, each the median of ``--runs`` runs on this machine:

- ``trainer_s``: the digits module (10 epochs, global batch 64, validation every epoch)
  under plain ``lightning.Trainer`` in one fresh process, the peer;
- ``cli_cold_s``: the same job through the flow CLI
  (``python -m ringflow.flows.train_pipeline --workers 1 --epochs 10 --tune-trials 0
  --no-serve``) with nothing running: a temporary Prefect server, no Ray;
- ``cli_warm_s``: the same command on the local stack ``deployments/start.sh`` started
  (Prefect server, Ray head and its warm workers), after one run that warmed it;
- ``first_step_warm_s`` / ``first_step_cold_s``: ``engine.fit`` with 2 workers, from the call
  to the first training step, on the pool's warm workers and on fresh ones
  (``RINGFLOW_WORKER_POOL=0``);
- ``tuning_warm_s`` / ``tuning_cold_s``: a search of ``--trials`` trials of 2 epochs, trial
  processes reused or not;
- ``adopted_first_step_s`` and ``adopted_steps_redone``: a training process (2 workers, a run
  key) SIGKILLed in its second epoch and started again under the same run key: from the new
  process's ``fit`` call to its workers' next step, and the steps they trained twice.

The table, then one JSON line with the ratios: ``cli_warm_vs_trainer``,
``cli_cold_vs_trainer`` and ``tuning_warm_vs_cold``.

    python -m bench.startup
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench import headline_json
from bench.ports import free_port

HEADLINE = (
    "cli_warm_vs_trainer",
    "cli_cold_vs_trainer",
    "first_step_warm_s",
    "first_step_cold_s",
    "tuning_warm_vs_cold",
    "adopted_first_step_s",
    "adopted_steps_redone",
)
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "GLOO_SOCKET_IFNAME": "lo",
}

_TRAINER = textwrap.dedent(
    """
    import torch, lightning as L
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset
    from ringflow.models.digits import DigitsClassifier

    L.seed_everything(0, verbose=False)
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    train, val = TensorDataset(x[:1438], y[:1438]), TensorDataset(x[1438:1618], y[1438:1618])
    L.Trainer(max_epochs={epochs}, accelerator="cpu", devices=1, logger=False,
              enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(
        DigitsClassifier(), DataLoader(train, batch_size=64, shuffle=True),
        DataLoader(val, batch_size=64))
    """
)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any Prefect server, Ray cluster or stack of its own."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "RAY_ADDRESS", "RINGFLOW_", "RAY_AUTH"))
    }
    return {**env, **QUIET, **extra}


def _timed(command: list[str], *, env: dict[str, str], cwd: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed: {done.stderr[-2000:]}")
    return seconds


def _median(times: list[float]) -> float:
    return round(statistics.median(times), 2)


def _cli(epochs: int) -> list[str]:
    return [sys.executable, "-m", "ringflow.flows.train_pipeline", "--workers", "1"] + [
        "--epochs",
        str(epochs),
        "--tune-trials",
        "0",
        "--no-serve",
    ]


def measure_trainer(runs: int, epochs: int) -> float:
    script = _TRAINER.format(epochs=epochs)
    env = _clean_env()
    return _median([_timed([sys.executable, "-c", script], env=env, cwd=ROOT) for _ in range(runs)])


def measure_cli_cold(runs: int, epochs: int) -> float:
    times = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as cwd:
            times.append(_timed(_cli(epochs), env=_clean_env(RINGFLOW_LOCAL_STACK="0"), cwd=cwd))
    return _median(times)


def measure_cli_warm(runs: int, epochs: int) -> float:
    """On a stack of its own (deployments/start.sh, in a temporary state folder)."""
    with tempfile.TemporaryDirectory() as state:
        env = _clean_env(
            RINGFLOW_STATE=state,
            RINGFLOW_PREFECT_PORT=str(free_port()),
            RINGFLOW_RAY_PORT=str(free_port()),
            RINGFLOW_RAY_DASHBOARD="0",
            RINGFLOW_POOL="ringflow-bench-startup",
            PREFECT_UI_ENABLED="false",
        )
        start = subprocess.run(
            ["./deployments/start.sh"], env=env, cwd=ROOT, capture_output=True, text=True
        )
        try:
            if start.returncode != 0:
                raise RuntimeError(f"start.sh failed: {start.stderr[-2000:]}")
            with tempfile.TemporaryDirectory() as cwd:
                _timed(_cli(epochs), env=env, cwd=cwd)  # warms the stack's workers
                return _median([_timed(_cli(epochs), env=env, cwd=cwd) for _ in range(runs)])
        finally:
            subprocess.run(["./deployments/stop.sh"], env=env, cwd=ROOT, capture_output=True)


_FIRST_STEP = textwrap.dedent(
    """
    import json, os, sys, tempfile, time
    import ray
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.models.digits import SCHEMA, DigitsClassifier, write_digits_csv
    from ringflow.storage.dataset import preprocess

    class FirstStep(DigitsClassifier):
        def training_step(self, batch, batch_idx):
            if self.global_step == 0 and self.global_rank == 0:
                with open(os.environ["FIRST_STEP_FILE"], "w") as f:
                    f.write(repr(time.time()))
            return super().training_step(batch, batch_idx)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    root = tempfile.mkdtemp()
    write_digits_csv(f"{root}/raw/digits.csv")
    data = DataSpec(dataset_url=preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0)
                    .dataset_url, schema=SCHEMA)
    config = TrainConfig(workers=2, epochs=1, batch_size=64, cpus_per_worker=1)
    seconds = []
    for run in range(int(sys.argv[1]) + 1):  # the first run warms the pool
        called = time.time()
        fit(FirstStep, hparams={}, data=data, config=config, checkpoint_uri=f"{root}/m{run}")
        seconds.append(float(open(os.environ["FIRST_STEP_FILE"]).read()) - called)
    print(json.dumps(seconds))
    """
)


def _last_line(script: str, argument: int, *, warm: bool, **env: str) -> str:
    """The last line ``script`` prints, run with ``argument`` on warm workers or fresh ones."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(argument)],
        env=_clean_env(RINGFLOW_WORKER_POOL="1" if warm else "0", **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the run failed: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def measure_first_step(runs: int, *, warm: bool) -> float:
    with tempfile.NamedTemporaryFile() as marker:
        line = _last_line(_FIRST_STEP, runs, warm=warm, FIRST_STEP_FILE=marker.name)
    return _median(json.loads(line)[1:])


_TUNING = textwrap.dedent(
    """
    import sys, tempfile, time
    import ray
    from ringflow.engine import DataSpec, TrainConfig
    from ringflow.models.digits import SCHEMA, DigitsClassifier, write_digits_csv
    from ringflow.storage.dataset import preprocess
    from ringflow.tuning import SearchConfig, search

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    root = tempfile.mkdtemp()
    write_digits_csv(f"{root}/raw/digits.csv")
    data = DataSpec(dataset_url=preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0)
                    .dataset_url, schema=SCHEMA)
    started = time.perf_counter()
    search(DigitsClassifier, base_hparams={}, space={"lr": [0.01, 0.1]}, data=data,
           train_config=TrainConfig(batch_size=64), storage_url=f"{root}/store", run_key="s",
           config=SearchConfig(trials=int(sys.argv[1]), epochs=2, grace_period=2),
           progress=lambda line: None)
    print(time.perf_counter() - started)
    """
)


def measure_tuning(trials: int, *, warm: bool) -> float:
    return round(float(_last_line(_TUNING, trials, warm=warm)), 2)


_ADOPTED = textwrap.dedent(
    """
    import os, sys, time
    import ray
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.models.digits import SCHEMA, DigitsClassifier

    class Logged(DigitsClassifier):
        def __init__(self, *, steps_file, **hparams):
            super().__init__(**hparams)
            self.steps_file = steps_file

        def training_step(self, batch, batch_idx):
            time.sleep(0.02)  # as if on an accelerator: a kill lands inside an epoch
            if self.global_rank == 0:
                job = os.environ.get("RINGFLOW_RAY_JOB")  # the driver the worker serves
                with open(self.steps_file, "a") as f:
                    f.write(f"{time.time()!r} {self.global_step} {job}\\n")
            return super().training_step(batch, batch_idx)

    ray.init(address=sys.argv[1], log_to_driver=False)
    print(repr(time.time()), flush=True)
    hparams = {"hidden": 16, "steps_file": sys.argv[5]}
    fit(Logged, hparams=hparams, data=DataSpec(dataset_url=sys.argv[2], schema=SCHEMA),
        config=TrainConfig(workers=2, epochs=4, batch_size=64, seed=5, cpus_per_worker=0.5),
        checkpoint_uri=sys.argv[3], store_url=sys.argv[4], run_key="adopted",
        on_epoch=lambda m: print(m.epoch, flush=True))
    """
)


def measure_adoption() -> tuple[float, int]:
    """A driver killed mid-run and started again under its run key: seconds from the new
    one's ``fit`` call to the workers' next step, and the steps trained twice."""
    import ray

    from ringflow.models.digits import SCHEMA, write_digits_csv
    from ringflow.storage.dataset import preprocess

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as root:
            write_digits_csv(f"{root}/raw/digits.csv")
            dataset = preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0).dataset_url
            address = ray.get_runtime_context().gcs_address
            steps = f"{root}/steps.log"
            # The drivers join this process's Ray, with its token where it asks for one.
            auth = {k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH")}
            env = _clean_env(**auth)

            def driver() -> subprocess.Popen:
                command = [sys.executable, "-c", _ADOPTED, address, dataset]
                command += [f"{root}/model", f"{root}/store", steps]
                return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)

            lost = driver()
            try:
                lost.stdout.readline()  # started
                while lost.stdout.readline().strip() != "0":  # its first epoch ended
                    if lost.poll() is not None:
                        raise RuntimeError("the first driver ended before it was killed")
                time.sleep(0.5)  # into the second
            finally:
                lost.kill()
                lost.wait()
            restarted = driver()
            called = float(restarted.stdout.readline())
            restarted.communicate()
            if restarted.returncode != 0:
                raise RuntimeError("the restarted driver failed")
            logged = [line.split() for line in Path(steps).read_text().splitlines()]
            lost_job = logged[0][2]  # steps the lost driver's workers trained, to the end
            before = [int(step) for _, step, job in logged if job == lost_job]
            first_time, first_step = next(
                (float(at), int(step)) for at, step, job in logged if job != lost_job
            )
            return round(first_time - called, 2), max(0, max(before) + 1 - first_step)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument(
        "--skip", default="", help="comma-separated: stack, tuning, first_step, adoption"
    )
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    summary: dict[str, float | None] = {"trainer_s": measure_trainer(args.runs, args.epochs)}
    summary["cli_cold_s"] = measure_cli_cold(args.runs, args.epochs)
    if "stack" not in skip:
        summary["cli_warm_s"] = measure_cli_warm(args.runs, args.epochs)
    if "first_step" not in skip:
        summary["first_step_warm_s"] = measure_first_step(args.runs, warm=True)
        summary["first_step_cold_s"] = measure_first_step(args.runs, warm=False)
    if "tuning" not in skip:
        summary["tuning_warm_s"] = measure_tuning(args.trials, warm=True)
        summary["tuning_cold_s"] = measure_tuning(args.trials, warm=False)
    if "adoption" not in skip:
        adopted = measure_adoption()
        summary["adopted_first_step_s"], summary["adopted_steps_redone"] = adopted
    trainer = summary["trainer_s"]
    for name in ("cli_warm", "cli_cold"):
        if summary.get(f"{name}_s"):
            summary[f"{name}_vs_trainer"] = round(summary[f"{name}_s"] / trainer, 2)
    if summary.get("tuning_cold_s"):
        warm, cold = summary["tuning_warm_s"], summary["tuning_cold_s"]
        summary["tuning_warm_vs_cold"] = round(warm / cold, 2)
    print(f"{'figure':<24}{'value':>10}")
    for key, value in summary.items():
        print(f"{key:<24}{value:>10}")
    print(headline_json(summary, HEADLINE))
    return summary


if __name__ == "__main__":
    main()
