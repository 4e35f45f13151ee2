"""Torture: kill random workers and the whole training process, again and again, then compare.

One training run (the digits model, 2 workers on a private Ray, a checkpoint store on local
disk) is attacked ``--kills`` times at random moments: a SIGKILL to a random worker (the
elastic group replaces it and rolls back to its last in-memory commit), or a SIGKILL to the
driver's whole process group, Ray included, as when a machine is preempted (the run is started
again with the same run key and resumes from its last committed checkpoint). The final
weights are compared with those of the same run left alone: the worker count never changes
(a lost worker is replaced before training goes on), so they must be equal bit for bit.

The last line is one JSON object with ``kills``, ``final_weights_equal`` (bitwise) and
``max_rel_diff``.

    python -m bench.torture --kills 20
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import torch

from bench import headline_json

HEADLINE = ("final_weights_equal", "max_rel_diff")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

RUN_KEY = "torture"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--flow-share", type=float, default=0.3, help="share of driver kills")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill schedule")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="ringflow-torture-") as root:
        started = time.monotonic()
        _child(root, "reference", args.epochs).wait()
        reference_s = time.monotonic() - started
        log = _torture(root, args, rng)
        summary = _compare(root, log, reference_s, time.monotonic() - started - reference_s)
    print(headline_json(summary, HEADLINE))
    return summary


def _torture(root: str, args: argparse.Namespace, rng: random.Random) -> dict[str, int]:
    counts = {"worker": 0, "flow": 0, "restarts": 0}
    child = _child(root, "tortured", args.epochs)
    try:
        while True:
            if child.poll() is not None:
                if child.returncode == 0:
                    break
                with open(f"{root}/tortured.log") as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"the training process failed ({child.returncode}):\n{tail}")
            if counts["worker"] + counts["flow"] >= args.kills or not _training(child):
                time.sleep(0.1)
                continue
            time.sleep(rng.uniform(0.3, 2.0))
            if rng.random() < args.flow_share:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                counts["flow"] += 1
                kills = counts["worker"] + counts["flow"]
                print(f"# kill {kills}: the whole training process", flush=True)
                child = _child(root, "tortured", args.epochs)
                counts["restarts"] += 1
            elif _kill_a_worker(child, rng):
                counts["worker"] += 1
                print(f"# kill {counts['worker'] + counts['flow']}: a worker", flush=True)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    return counts


def _child(root: str, name: str, epochs: int) -> subprocess.Popen:
    log = open(f"{root}/{name}.log", "a")  # noqa: SIM115 - the child writes to it until it ends
    return subprocess.Popen(
        [sys.executable, "-m", "bench.torture", "--child", root, name, str(epochs)],
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _workers(child: subprocess.Popen) -> list[int]:
    import psutil

    try:
        procs = psutil.Process(child.pid).children(recursive=True)
    except psutil.Error:
        return []
    pids = []
    for proc in procs:
        try:
            if " ".join(proc.cmdline()).startswith("ray::Worker"):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


def _training(child: subprocess.Popen) -> bool:
    return len(_workers(child)) >= 2


def _kill_a_worker(child: subprocess.Popen, rng: random.Random) -> bool:
    pids = _workers(child)
    if not pids:
        return False
    try:
        os.kill(rng.choice(pids), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _compare(root: str, counts: dict[str, int], reference_s: float, tortured_s: float) -> dict:
    from safetensors.torch import load_file

    reference = load_file(f"{root}/reference.safetensors")
    tortured = load_file(f"{root}/tortured.safetensors")
    equal = reference.keys() == tortured.keys() and all(
        torch.equal(reference[k], tortured[k]) for k in reference
    )
    diff = max(
        ((tortured[k] - reference[k]).norm() / reference[k].norm()).item() for k in reference
    )
    kills = counts["worker"] + counts["flow"]
    print(f"\n{'kills':>6}{'workers':>9}{'driver':>8}{'bitwise':>9}{'max rel diff':>14}")
    print(f"{kills:6d}{counts['worker']:9d}{counts['flow']:8d}{equal!s:>9}{diff:14.3g}")
    print(f"# uninterrupted run {reference_s:.0f} s, tortured run {tortured_s:.0f} s")
    return {
        "kills": kills,
        "worker_kills": counts["worker"],
        "flow_kills": counts["flow"],
        "final_weights_equal": equal,
        "max_rel_diff": diff,
    }


def _run_child(root: str, name: str, epochs: int) -> None:
    """One training process: resumes the run key's checkpoint if there is one."""
    from ringflow.engine.cluster import quiet_environment

    quiet_environment(GLOO_SOCKET_IFNAME="lo")  # before Ray is imported: it reads them then
    import ray
    from safetensors.torch import save_file

    from bench.dp_throughput import _digits
    from ringflow.engine import TrainConfig, fit
    from ringflow.models.digits import DigitsClassifier

    data = _digits(f"{root}/data-{name}")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    result = fit(
        DigitsClassifier,
        hparams={"hidden": 64, "lr": 0.01},
        data=data,
        config=TrainConfig(
            workers=2,
            epochs=epochs,
            batch_size=64,
            commit_every=5,
            checkpoint_every=5,
            max_failures=1000,
            collective_timeout_s=5.0,
        ),
        checkpoint_uri=f"{root}/{name}-model",
        store_url=f"{root}/store-{name}",
        run_key=RUN_KEY,
    )
    save_file(result.state_dict, f"{root}/{name}.safetensors")
    ray.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _run_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
