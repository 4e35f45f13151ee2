"""Horovod's synthetic benchmark (``examples/pytorch/pytorch_synthetic_benchmark.py``) on
``ringflow.horovod`` against torch DDP: the same ResNet, synthetic images and SGD step, the
same processes, in one run.

- ``ringflow.horovod``: the benchmark's own loop, ``hvd.DistributedOptimizer`` over our ring
  (gradients fused into 25 MiB buckets, each all-reduced as soon as backward fills it);
- ``torch DDP``: ``DistributedDataParallel`` (gloo on CPU, NCCL on GPUs) around the same model.

Each runs ``--repeats`` times in spawned processes (one per rank; one GPU each on CUDA),
alternating; the best images/s of each counts. It prints a table, then one JSON object with
``hvd_vs_ddp`` (ours / DDP) and both rates.

    python -m bench.horovod_synthetic                              # 2 CPU processes, ResNet-18
    python -m bench.horovod_synthetic --device cuda --workers 1    # ResNet-50, batch 64
    python -m bench.horovod_synthetic --device cuda --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.nn import functional as F

from bench import headline_json
from bench.ports import free_port

HEADLINE = ("hvd_vs_ddp",)
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

EXAMPLES = Path(__file__).parents[1] / "tests" / "horovod_examples"


@dataclass(frozen=True, kw_only=True)
class Spec:
    device: str
    workers: int
    model: str
    batch_size: int
    image_size: int
    warmup: int
    steps: int


def _models():
    """torchvision's models, or the same ResNets written out where torchvision cannot load
    (this project's CPU torch)."""
    try:
        from torchvision import models
    except Exception:  # noqa: BLE001 - absent, or built against another torch
        sys.path.insert(0, str(EXAMPLES))
        import torchvision_models as models
    return models


def _free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _rank(rank: int, runner: str, spec: Spec, address: str, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.workers))
    device = torch.device(f"cuda:{rank}" if spec.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = getattr(_models(), spec.model)().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * spec.workers)
    if runner == "ringflow.horovod":
        step, barrier = _horovod(rank, spec, address, model, optimizer)
    else:
        step, barrier = _ddp(rank, spec, address, model, optimizer, device)
    data = torch.randn(spec.batch_size, 3, spec.image_size, spec.image_size, device=device)
    target = torch.randint(0, 1000, (spec.batch_size,), device=device)
    for _ in range(spec.warmup):
        step(data, target)
    barrier()
    start = time.perf_counter()
    for _ in range(spec.steps):
        step(data, target)
    barrier()
    elapsed = time.perf_counter() - start
    if rank == 0:
        rate = spec.batch_size * spec.steps * spec.workers / elapsed
        Path(out).write_text(json.dumps({"images_per_s": rate, "step_s": elapsed / spec.steps}))


def _horovod(rank, spec, address, model, optimizer):
    from ringflow.horovod.basics import VARIABLES

    told = {"rank": rank, "size": spec.workers, "local_rank": rank}
    told |= {"local_size": spec.workers, "address": address, "timeout_s": 120}
    os.environ.update({VARIABLES[k]: str(v) for k, v in told.items()})
    import ringflow.horovod as hvd

    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def step(data, target):
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def barrier():
        hvd.allreduce(torch.zeros(1, device=data_device(model)))
        _synchronize(model)

    return step, barrier


def _ddp(rank, spec, address, model, optimizer, device):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=spec.workers)
    wrapped = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )

    def step(data, target):
        optimizer.zero_grad()
        F.cross_entropy(wrapped(data), target).backward()
        optimizer.step()

    def barrier():
        dist.barrier()
        _synchronize(model)

    return step, barrier


def data_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _synchronize(model: torch.nn.Module) -> None:
    if data_device(model).type == "cuda":
        torch.cuda.synchronize()


def _measure(runner: str, spec: Spec) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rate.json")
        mp.spawn(_rank, args=(runner, spec, _free_address(), out), nprocs=spec.workers)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default=None, help="resnet18 on CPU, resnet50 on CUDA")
    parser.add_argument("--batch-size", type=int, default=None, help="4 on CPU, 64 on CUDA")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="6 on CPU, 50 on CUDA")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < args.workers:
        parser.error(f"{args.workers} workers need as many GPUs; {torch.cuda.device_count()} here")
    spec = Spec(
        device=args.device,
        workers=args.workers,
        model=args.model or ("resnet50" if cuda else "resnet18"),
        batch_size=args.batch_size or (64 if cuda else 4),
        image_size=args.image_size,
        warmup=args.warmup,
        steps=args.steps or (50 if cuda else 6),
    )
    runners = ("ringflow.horovod", "torch DDP")
    best = dict.fromkeys(runners, 0.0)
    for _ in range(args.repeats):
        for runner in runners:
            best[runner] = max(best[runner], _measure(runner, spec)["images_per_s"])
    where = torch.cuda.get_device_name(0) if cuda else f"{os.cpu_count()} CPU cores"
    print(f"# {spec.model}, batch {spec.batch_size} per rank, {spec.workers} ranks on {where}")
    print(f"{'runner':<20} {'images/s':>10}")
    for runner in runners:
        print(f"{runner:<20} {best[runner]:>10.1f}")
    summary = {
        "hvd_vs_ddp": round(best["ringflow.horovod"] / best["torch DDP"], 3),
        "hvd_images_per_s": round(best["ringflow.horovod"], 2),
        "ddp_images_per_s": round(best["torch DDP"], 2),
        **asdict(spec),
        "machine": where,
    }
    print(headline_json(summary, HEADLINE), flush=True)
    return summary


if __name__ == "__main__":
    main()
