"""Data-parallel training throughput: ours against torch DDP and Ray Train's TorchTrainer.

The same model (an MLP over the digits' 64 pixels), the same data, epochs, global batch and
seed, with 2 workers (``--workers``), in one run:

- ``ours (engine.fit)``: the engine's ``fit`` on Ray actors, gradients through our ring with
  buckets started during backward (CPU only: the engine's workers are CPU workers);
- ``ours (processes)``: the same per-step code (``GradientBuckets`` over ``RingCollective``)
  in spawned processes, like DDP's: the like-for-like comparison with DDP, and the one that
  runs on GPUs (NCCL);
- ``torch DDP``: ``DistributedDataParallel`` in spawned processes (gloo or NCCL);
- ``Ray TorchTrainer``: Ray Train v2 with ``prepare_model`` (DDP inside).

For each it prints the training-loop throughput (samples per second once the workers run)
and the end-to-end one (start-up included). The last line is one JSON object with
``ours_vs_ddp`` (loop throughput) and ``ours_vs_torchtrainer`` (end to end).

Scaling: ``--workers 1,2,4,8`` runs every runner at each count, one process per GPU on CUDA;
with ``--per-worker-batch B`` the global batch is ``B x workers`` (weak scaling: every GPU
does the same work at every count). It prints samples/s, ours/DDP and the scaling efficiency
``throughput(n) / (n x throughput(1))`` of ours and of DDP, and adds ``scaling_efficiency``
and ``ddp_scaling_efficiency`` (at the largest count) and ``ours_vs_ddp_by_workers`` to the
JSON; ``ours_vs_ddp`` is then the ratio at the largest count. Counts above the GPUs present
are skipped with a note, so the same command runs unchanged on 4 and on 8 GPUs.

    python -m bench.dp_throughput                                  # CPU, small MLP
    python -m bench.dp_throughput --device cuda --hidden 4096 --layers 6 --batch-size 512
    python -m bench.dp_throughput --device cuda --workers 1,2,4,8 --hidden 8192 --layers 8 \
        --per-worker-batch 1024 --epochs 2 --warmup-steps 3 --runners ours_processes,ddp
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from bench import headline_json
from bench.ports import free_port
from ringflow.engine.cluster import quiet_environment

HEADLINE = ("ours_vs_ddp", "ours_processes_vs_ddp", "ours_vs_torchtrainer", "scaling_efficiency")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

quiet_environment()  # before Ray is imported: a local Ray stays on loopback


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What every runner trains."""

    hidden: int
    layers: int
    epochs: int
    batch_size: int
    """The global batch (split over the workers)."""
    seed: int
    device: str
    bucket_mb: float
    data: str
    workers: int = 2
    warmup_steps: int = 0
    """Steps run before the loop's clock starts (CUDA: cuBLAS, NCCL and allocator set-up)."""
    amp: str = "none"
    """``bf16``: forward and backward under ``torch.autocast`` (fp32 weights and gradients)."""
    transport: str = "auto"
    """The ring's transport for ``ours (processes)`` (``engine.collective.TRANSPORTS``)."""


@dataclass(frozen=True, kw_only=True)
class Result:
    runner: str
    workers: int
    samples: int
    loop_s: float
    end_to_end_s: float

    @property
    def loop_samples_per_s(self) -> float:
        return self.samples / self.loop_s

    @property
    def end_to_end_samples_per_s(self) -> float:
        return self.samples / self.end_to_end_s


def mlp(*, hidden: int, layers: int) -> nn.Sequential:
    """``layers`` hidden layers of ``hidden`` units over 64 pixels, 10 classes."""
    blocks: list[nn.Module] = [nn.Linear(64, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 10))


def bench_classifier() -> type:
    """``mlp`` as a LightningModule, for ``engine.fit`` (lightning is imported only here)."""
    import lightning as L

    class BenchClassifier(L.LightningModule):
        def __init__(self, *, hidden: int = 512, layers: int = 3, lr: float = 1e-3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = mlp(hidden=hidden, layers=layers)

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            return self.net(pixels / 16.0)

        def training_step(self, batch, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    return BenchClassifier


def main(argv: list[str] | None = None) -> dict:
    spec, runners, counts, per_worker = _parse(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # NVLink multicast (NVLS) can wedge a shared host's GPUs: off unless the user says otherwise.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    root = tempfile.mkdtemp(prefix="ringflow-dp-")
    data = _digits(root) if spec.data == "digits" else None
    params = sum(p.numel() for p in mlp(hidden=spec.hidden, layers=spec.layers).parameters())
    batch = f"per-worker batch {per_worker}" if per_worker else f"global batch {spec.batch_size}"
    print(
        f"# dp throughput: MLP 64-{spec.hidden}x{spec.layers}-10 ({params / 1e6:.2f} M params, "
        f"{params * 4 / 2**20:.1f} MiB of gradients), workers {counts}, {spec.epochs} epochs, "
        f"{batch}, {spec.warmup_steps} warm-up steps, amp {spec.amp}, device {spec.device} "
        f"({_device_name(spec.device)}), {os.cpu_count()} CPUs, torch {torch.__version__}",
        flush=True,
    )
    results = []
    for n in counts:
        if spec.device == "cuda" and torch.cuda.device_count() < n:
            print(f"# skipping {n} workers: only {torch.cuda.device_count()} GPUs", flush=True)
            continue
        spec_n = replace(
            spec, workers=n, batch_size=per_worker * n if per_worker else spec.batch_size
        )
        results += _run_count(spec_n, runners, data=data, root=root)
    summary = _summary(spec, results)
    # The spec's workers and global batch vary by count: say what was asked for instead.
    summary["spec"].update(workers=counts, batch_size=None if per_worker else spec.batch_size)
    summary["per_worker_batch"] = per_worker
    if len({r.workers for r in results}) > 1:
        _print_scaling(summary)
    print(headline_json(summary, HEADLINE), flush=True)
    return summary


def _run_count(spec: Spec, runners: list[str], *, data, root: str) -> list[Result]:
    """Every runner at ``spec.workers`` workers."""
    x, y = _train_arrays(data) if data is not None else _synthetic(spec)
    print(
        f"# {spec.workers} workers: {len(y)} {spec.data} samples an epoch, global batch "
        f"{spec.batch_size}",
        flush=True,
    )
    results = []
    for name in runners:
        if name == "torchtrainer" and not _has_ray_train():
            print("# skipping Ray TorchTrainer: ray[train] is not installed here", flush=True)
            continue
        result = _RUNNERS[name](spec, data=data, x=x, y=y, root=root)
        print(
            f"{result.runner:<20} n={result.workers} loop {result.loop_samples_per_s:9.1f} "
            f"samples/s ({result.loop_s:6.2f} s)   end to end "
            f"{result.end_to_end_samples_per_s:9.1f} samples/s ({result.end_to_end_s:6.2f} s)",
            flush=True,
        )
        results.append(result)
    return results


def _parse(argv: list[str] | None) -> tuple[Spec, list[str], list[int], int | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument(
        "--per-worker-batch",
        type=int,
        default=None,
        help="weak scaling: the global batch is this times the workers (overrides --batch-size)",
    )
    parser.add_argument("--workers", default="2", help="worker counts, comma-separated: 1,2,4,8")
    parser.add_argument(
        "--warmup-steps", type=int, default=None, help="untimed steps first; default 0 (CPU), 3"
    )
    parser.add_argument("--amp", choices=("none", "bf16"), default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument(
        "--transport", default="auto", help="our ring's: auto, shm, gloo, nccl or symm (GPU)"
    )
    parser.add_argument(
        "--data",
        choices=("digits", "synthetic"),
        default=None,
        help="digits (needed by ours_engine; the CPU default) or synthetic (the CUDA default)",
    )
    parser.add_argument(
        "--runners",
        default=None,
        help=f"comma-separated subset of {sorted(_RUNNERS)}; default: all that run on --device",
    )
    args = parser.parse_args(argv)
    spec = Spec(
        hidden=args.hidden,
        layers=args.layers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        device=args.device,
        bucket_mb=args.bucket_mb,
        data=args.data or ("digits" if args.device == "cpu" else "synthetic"),
        warmup_steps=(
            args.warmup_steps
            if args.warmup_steps is not None
            else (0 if args.device == "cpu" else 3)
        ),
        amp=args.amp,
        transport=args.transport,
    )
    if args.amp != "none" and args.device == "cpu":
        parser.error("--amp bf16 is for --device cuda")
    default = ["ours_processes", "ddp", "torchtrainer"]
    if args.device == "cpu":
        default.insert(0, "ours_engine")
    counts = [int(n) for n in args.workers.split(",")]
    if any(n < 1 for n in counts):
        parser.error(f"--workers must be positive counts, got {args.workers}")
    runners = args.runners.split(",") if args.runners else default
    return spec, runners, counts, args.per_worker_batch


# -- the per-step loop every spawned runner shares -----------------------------------------


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    spec: Spec,
    rank: int,
    before_backward: Callable[[float], None] = lambda weight: None,
    after_backward: Callable[[], None] = lambda: None,
) -> tuple[int, float]:
    """The engine's step: this rank's part of each global batch.

    The first ``spec.warmup_steps`` steps run before the clock starts.

    Returns:
        The samples seen in the timed steps (all ranks together), and their seconds.
    """
    seen, step, started = 0, 0, time.perf_counter()
    for epoch in range(spec.epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(spec.seed + epoch))
        for start in range(0, len(order), spec.batch_size):
            if step == spec.warmup_steps:
                _sync(x.device)
                seen, started = 0, time.perf_counter()
            batch = order[start : start + spec.batch_size]
            mine = torch.tensor_split(batch, spec.workers)[rank].to(x.device)
            optimizer.zero_grad(set_to_none=False)
            before_backward(len(mine) / len(batch))
            with _autocast(spec, x.device):
                loss = F.cross_entropy(model(x[mine] / 16.0), y[mine])
            loss.backward()
            after_backward()
            optimizer.step()
            seen += len(batch)
            step += 1
    _sync(x.device)
    return seen, time.perf_counter() - started


def _autocast(spec: Spec, device: torch.device) -> contextlib.AbstractContextManager:
    if spec.amp == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- runners ----------------------------------------------------------------------------------


def _run_ours_engine(spec: Spec, *, data, x, y, root: str) -> Result:
    import ray

    from ringflow.engine import TrainConfig, fit

    started = time.perf_counter()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        result = fit(
            bench_classifier(),
            hparams={"hidden": spec.hidden, "layers": spec.layers},
            data=data,
            config=TrainConfig(
                workers=spec.workers,
                epochs=spec.epochs,
                batch_size=spec.batch_size,
                seed=spec.seed,
                collective="ring",
                bucket_mb=spec.bucket_mb,
            ),
            checkpoint_uri=f"{root}/ours-engine",
        )
    finally:
        ray.shutdown()
    end_to_end = time.perf_counter() - started
    loop = sum(epoch.seconds for epoch in result.history)  # train + a small validation pass
    return Result(
        runner="ours (engine.fit)",
        workers=spec.workers,
        samples=spec.epochs * len(y),
        loop_s=loop,
        end_to_end_s=end_to_end,
    )


def _run_spawned(name: str, runner: str, spec: Spec, x, y) -> Result:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    started = time.perf_counter()
    mp.spawn(
        _spawned_rank,
        args=(runner, spec, x, y, free_port(), queue),
        nprocs=spec.workers,
        join=True,
    )
    end_to_end = time.perf_counter() - started
    samples, loop = queue.get()
    return Result(
        runner=name, workers=spec.workers, samples=samples, loop_s=loop, end_to_end_s=end_to_end
    )


def _spawned_rank(rank: int, runner: str, spec: Spec, x, y, port: int, queue) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if spec.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.manual_seed(spec.seed)
    model = mlp(hidden=spec.hidden, layers=spec.layers).to(device)
    x, y = x.to(device), y.to(device)
    address = f"tcp://127.0.0.1:{port}"
    if runner == "ddp":
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=spec.workers)
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=spec.bucket_mb)
        hooks = {}
        close = dist.destroy_process_group
    else:
        hooks, close = _ours_hooks(model, rank=rank, backend=backend, address=address, spec=spec)
    # Before the clock: the first Adam imports torch._dynamo, seconds on a small machine.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    samples, loop = train_loop(model, optimizer, x, y, spec=spec, rank=rank, **hooks)
    close()
    if rank == 0:
        queue.put((samples, loop))


def _ours_hooks(model: nn.Module, *, rank: int, backend: str, address: str, spec: Spec):
    from ringflow.engine.collective import GradientBuckets, RingCollective

    ring = RingCollective(
        rank=rank,
        world_size=spec.workers,
        init_method=address,
        backend=backend,
        timeout_s=60,
        transport=spec.transport,
    )
    for tensor in model.state_dict().values():
        ring.broadcast_(tensor, src=0)
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = GradientBuckets(params, ring, bucket_bytes=int(spec.bucket_mb * 2**20))
    hooks = {
        "before_backward": lambda weight: buckets.start(weight=weight),
        "after_backward": buckets.finish,
    }

    def close() -> None:
        buckets.close()
        ring.close()

    return hooks, close


def _run_ours_processes(spec: Spec, *, data, x, y, root: str) -> Result:
    return _run_spawned("ours (processes)", "ours", spec, x, y)


def _run_ddp(spec: Spec, *, data, x, y, root: str) -> Result:
    return _run_spawned("torch DDP", "ddp", spec, x, y)


def _run_torchtrainer(spec: Spec, *, data, x, y, root: str) -> Result:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = f"{root}/torchtrainer.json"
    started = time.perf_counter()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        trainer = TorchTrainer(
            _torchtrainer_loop,
            train_loop_config={"spec": asdict(spec), "x": x, "y": y, "out": out},
            scaling_config=ScalingConfig(
                num_workers=spec.workers,
                use_gpu=spec.device == "cuda",
                resources_per_worker={"CPU": 1},
            ),
            run_config=RunConfig(storage_path=f"{root}/torchtrainer", name="bench"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    end_to_end = time.perf_counter() - started
    with open(out) as f:  # Ray Train v2 keeps metrics only with checkpoints: a side file
        metrics = json.load(f)
    return Result(
        runner="Ray TorchTrainer",
        workers=spec.workers,
        samples=int(metrics["samples"]),
        loop_s=float(metrics["loop_s"]),
        end_to_end_s=end_to_end,
    )


def _torchtrainer_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    spec = Spec(**config["spec"])
    context = ray.train.get_context()
    torch.manual_seed(spec.seed)
    model = ray.train.torch.prepare_model(mlp(hidden=spec.hidden, layers=spec.layers))
    device = next(model.parameters()).device
    x, y = config["x"].to(device), config["y"].to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    samples, loop_s = train_loop(model, optimizer, x, y, spec=spec, rank=context.get_world_rank())
    if context.get_world_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump({"samples": samples, "loop_s": loop_s}, f)
    ray.train.report({"samples": samples, "loop_s": loop_s})


_RUNNERS = {
    "ours_engine": _run_ours_engine,
    "ours_processes": _run_ours_processes,
    "ddp": _run_ddp,
    "torchtrainer": _run_torchtrainer,
}


# -- data and summary -------------------------------------------------------------------------


def _digits(root: str):
    from ringflow.engine import DataSpec
    from ringflow.models.digits import SCHEMA, write_digits_csv
    from ringflow.storage.dataset import preprocess

    write_digits_csv(f"{root}/raw/digits.csv")
    result = preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0)
    return DataSpec(dataset_url=result.dataset_url, schema=SCHEMA)


def _train_arrays(data) -> tuple[torch.Tensor, torch.Tensor]:
    from ringflow.storage.dataset import read_split

    x, y = read_split(data.dataset_url, "train", data.schema)
    return torch.from_numpy(x), torch.from_numpy(y)


def _synthetic(spec: Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits-shaped random data: 64 pixels in [0, 16], 10 classes, 16 batches an epoch."""
    g = torch.Generator().manual_seed(spec.seed)
    count = 16 * spec.batch_size
    return torch.rand(count, 64, generator=g) * 16, torch.randint(0, 10, (count,), generator=g)


def _has_ray_train() -> bool:
    try:
        import ray.train.torch  # noqa: F401
    except ImportError:
        return False
    return True


def _summary(spec: Spec, results: list[Result]) -> dict:
    """Headline ratios at the largest worker count, and scaling over the counts run."""
    largest = max((r.workers for r in results), default=spec.workers)
    by = {r.runner: r for r in results if r.workers == largest}
    ours = by.get("ours (engine.fit)") or by.get("ours (processes)")
    ddp, trainer = by.get("torch DDP"), by.get("Ray TorchTrainer")
    scaling = _scaling(results)
    return {
        "ours_vs_ddp": _ratio(ours and ours.loop_samples_per_s, ddp and ddp.loop_samples_per_s),
        "ours_processes_vs_ddp": _ratio(
            by.get("ours (processes)") and by["ours (processes)"].loop_samples_per_s,
            ddp and ddp.loop_samples_per_s,
        ),
        "ours_vs_torchtrainer": _ratio(
            ours and ours.end_to_end_samples_per_s, trainer and trainer.end_to_end_samples_per_s
        ),
        "workers": largest,
        "scaling_efficiency": scaling["ours (processes)"].get(largest),
        "ddp_scaling_efficiency": scaling["torch DDP"].get(largest),
        "ours_vs_ddp_by_workers": {
            n: _ratio(ours_n, ddp_n) for n, (ours_n, ddp_n) in _pairs(results).items()
        },
        "scaling_efficiency_by_workers": scaling,
        "spec": asdict(spec),
        "results": {r.runner: _numbers(r) for r in results if r.workers == largest},
        "by_workers": {
            n: {r.runner: _numbers(r) for r in results if r.workers == n}
            for n in sorted({r.workers for r in results})
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _numbers(r: Result) -> dict:
    return {
        "loop_samples_per_s": round(r.loop_samples_per_s, 1),
        "end_to_end_samples_per_s": round(r.end_to_end_samples_per_s, 1),
        "loop_s": round(r.loop_s, 3),
        "end_to_end_s": round(r.end_to_end_s, 3),
    }


def _pairs(results: list[Result]) -> dict[int, tuple[float | None, float | None]]:
    """Per worker count: the loop throughput of ours (processes) and of DDP."""
    pairs = {}
    for n in sorted({r.workers for r in results}):
        at = {r.runner: r.loop_samples_per_s for r in results if r.workers == n}
        pairs[n] = (at.get("ours (processes)"), at.get("torch DDP"))
    return pairs


def _scaling(results: list[Result]) -> dict[str, dict[int, float]]:
    """``throughput(n) / (n x throughput(1))`` per runner; empty without a 1-worker run."""
    scaling: dict[str, dict[int, float]] = {"ours (processes)": {}, "torch DDP": {}}
    for runner in scaling:
        rates = {r.workers: r.loop_samples_per_s for r in results if r.runner == runner}
        if 1 in rates:
            scaling[runner] = {n: round(v / (n * rates[1]), 3) for n, v in sorted(rates.items())}
    return scaling


def _print_scaling(summary: dict) -> None:
    print(
        f"{'workers':>7} {'ours samples/s':>15} {'DDP samples/s':>14} {'ours/DDP':>9} "
        f"{'ours eff':>9} {'DDP eff':>8}",
        flush=True,
    )
    ours_eff = summary["scaling_efficiency_by_workers"]["ours (processes)"]
    ddp_eff = summary["scaling_efficiency_by_workers"]["torch DDP"]
    for n, row in summary["by_workers"].items():
        ours = row.get("ours (processes)", {}).get("loop_samples_per_s")
        ddp = row.get("torch DDP", {}).get("loop_samples_per_s")
        print(
            f"{n:>7} {_cell(ours, 15, '.1f')} {_cell(ddp, 14, '.1f')} "
            f"{_cell(summary['ours_vs_ddp_by_workers'].get(n), 9, '.3f')} "
            f"{_cell(ours_eff.get(n), 9, '.3f')} {_cell(ddp_eff.get(n), 8, '.3f')}",
            flush=True,
        )


def _cell(value: float | None, width: int, fmt: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


def _device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return "CPU"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
