"""Pipeline bubble: each stage's idle fraction against theory, and ours against torch's.

Two stages of equal cost (an MLP of ``Linear + ReLU`` blocks, half of them per stage, one
torch thread per stage) run a schedule (``1f1b`` by default) with M micro-batches of a fixed
size, for M in 4, 8, 16. For every step each stage records its compute time; its bubble is
the rest of the step's makespan (first stage start to last stage end), and theory says
(P-1)/(M+P-1). The stages run in spawned processes with the engine's own stage code
(``PipelineStage``, ``StageLink``, ``run_schedule``): gloo on CPU, NCCL on GPU, no Ray.

With ``--device cuda`` (2 GPUs) the same stages also run under torch.distributed.pipelining's
``Schedule1F1B`` with the same P and M in the same run, and the throughput ratio is reported.
The last line is one JSON object with ``max_bubble_excess`` (the largest measured bubble
over theory, minus 1) and, when compared, ``ours_vs_torch_pipelining``.

    python -m bench.pipeline                        # CPU, 2 processes
    python -m bench.pipeline --device cuda --hidden 8192 --micro-size 256
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

STAGES = 2


@dataclass(frozen=True, kw_only=True)
class Spec:
    device: str
    hidden: int
    layers_per_stage: int
    micro_size: int
    micro_batches: tuple[int, ...]
    steps: int
    warmup: int
    schedule: str
    compare_torch: bool
    seed: int = 0


def mlp(spec: Spec) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(STAGES * spec.layers_per_stage):
        blocks += [nn.Linear(spec.hidden, spec.hidden), nn.ReLU()]
    return nn.Sequential(*blocks)


def main(argv: list[str] | None = None) -> dict:
    spec = _parse(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    params = sum(p.numel() for p in mlp(spec).parameters())
    print(
        f"# pipeline bubble: {STAGES} stages x {spec.layers_per_stage} blocks of "
        f"Linear({spec.hidden}, {spec.hidden}) ({params / 1e6:.1f} M params), micro-batches of "
        f"{spec.micro_size}, schedule {spec.schedule}, device {spec.device}, "
        f"{os.cpu_count()} CPUs, fastest of {spec.steps} steps after {spec.warmup} warm-up",
        flush=True,
    )
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_rank, args=(spec, _free_port(), queue), nprocs=STAGES, join=True)
    reports = dict(queue.get() for _ in range(STAGES))
    summary = _report(spec, reports)
    print(json.dumps(summary), flush=True)
    return summary


def _parse(argv: list[str] | None) -> Spec:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--hidden", type=int, default=None, help="default 1024 (CPU), 8192 (GPU)")
    parser.add_argument("--layers-per-stage", type=int, default=4)
    parser.add_argument("--micro-size", type=int, default=None, help="default 64 (CPU), 512")
    parser.add_argument("--micro-batches", default="4,8,16")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument(
        "--compare-torch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run torch.distributed.pipelining Schedule1F1B (default: on CUDA only)",
    )
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    return Spec(
        device=args.device,
        hidden=args.hidden or (8192 if cuda else 1024),
        layers_per_stage=args.layers_per_stage,
        micro_size=args.micro_size or (512 if cuda else 64),
        micro_batches=tuple(int(m) for m in args.micro_batches.split(",")),
        steps=args.steps,
        warmup=args.warmup,
        schedule=args.schedule,
        compare_torch=cuda if args.compare_torch is None else args.compare_torch,
    )


# -- one spawned stage -------------------------------------------------------------------


def _rank(rank: int, spec: Spec, port: int, queue) -> None:
    from engine.pipeline import PipelineConfig, PipelineStage, StageLink, partition_model

    torch.set_num_threads(1)
    cuda = spec.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        "127.0.0.1", port, STAGES, is_master=rank == 0, timeout=dt.timedelta(seconds=120)
    )
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend, store=dist.PrefixStore("default", store), rank=rank, world_size=STAGES
    )
    torch.manual_seed(spec.seed)
    model = mlp(spec)
    x = torch.randn(spec.micro_size, spec.hidden)
    y = torch.randn(spec.micro_size, spec.hidden)
    split = (2 * spec.layers_per_stage,)  # half the blocks (Linear + ReLU) each
    partition = partition_model(model, PipelineConfig(stages=STAGES, balance=split))
    stage = PipelineStage(
        model, partition=partition, stage=rank, example=x, loss_fn=F.mse_loss, device=device
    )
    link = StageLink(
        store=dist.PrefixStore("ours", store),
        stage=rank,
        stages=STAGES,
        timeout_s=60,
        backend=backend,
    )
    x, y = x.to(device), y.to(device)
    report = {"bubble": {}, "throughput": {}}
    for m in spec.micro_batches:
        report["bubble"][m] = _timed_steps(stage, link, spec, m, x, y)
        if spec.compare_torch:
            report["throughput"][m] = {
                "ours": _ours_seconds(stage, link, spec, m, x, y),
                "torch": _torch_seconds(stage, spec, m, x, y, device),
            }
    dist.barrier()
    queue.put((rank, report))
    link.close()
    dist.destroy_process_group()


def _micro(spec: Spec, m: int, x: torch.Tensor, y: torch.Tensor):
    from engine.pipeline import MicroBatches

    return MicroBatches(
        sizes=(spec.micro_size,) * m, inputs=[x] * m, targets=[y] * m, weights=(1 / m,) * m
    )


def _timed_steps(stage, link, spec: Spec, m: int, x, y) -> list[tuple[float, float, float]]:
    """``(start, end, compute seconds)`` of each measured step on this stage."""
    from engine.pipeline import StepTiming, run_schedule, stage_actions

    actions = stage_actions(spec.schedule, stage=stage.stage, stages=STAGES, micro_batches=m)
    micro = _micro(spec, m, x, y)
    records = []
    for step in range(spec.warmup + spec.steps):
        link.barrier()
        timing = StepTiming()
        run_schedule(stage, actions, link=link, micro=micro, timing=timing, sync=True)
        if step >= spec.warmup:
            records.append((timing.started, timing.finished, timing.busy_s))
    return records


def _ours_seconds(stage, link, spec: Spec, m: int, x, y) -> float:
    """Seconds per step of our schedule, untimed inside (no synchronisation per action)."""
    from engine.pipeline import run_schedule, stage_actions

    actions = stage_actions("1f1b", stage=stage.stage, stages=STAGES, micro_batches=m)
    micro = _micro(spec, m, x, y)

    def step() -> None:
        run_schedule(stage, actions, link=link, micro=micro)

    return _seconds_per_step(step, spec, x.device)


def _torch_seconds(stage, spec: Spec, m: int, x, y, device) -> float:
    """Seconds per step of torch.distributed.pipelining's Schedule1F1B on the same layers."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B

    submodule = nn.Sequential(*stage.layers)
    torch_stage = TorchStage(submodule, stage.stage, STAGES, device)
    schedule = Schedule1F1B(torch_stage, n_microbatches=m, loss_fn=F.mse_loss)
    full_x, full_y = torch.cat([x] * m), torch.cat([y] * m)

    def step() -> None:
        if stage.is_first:
            schedule.step(full_x)
        else:
            schedule.step(target=full_y, losses=[])

    return _seconds_per_step(step, spec, device)


def _seconds_per_step(step, spec: Spec, device: torch.device) -> float:
    for _ in range(spec.warmup):
        step()
    _sync(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(spec.steps):
        step()
    _sync(device)
    dist.barrier()
    return (time.perf_counter() - started) / spec.steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- report ----------------------------------------------------------------------------------


def _report(spec: Spec, reports: dict[int, dict]) -> dict:
    print(
        f"{'M':>4} {'theory':>8} "
        + " ".join(f"{f'stage {s}':>8}" for s in range(STAGES))
        + f" {'excess':>8} {'step ms':>8}",
        flush=True,
    )
    rows = []
    for m in spec.micro_batches:
        theory = (STAGES - 1) / (m + STAGES - 1)
        bubbles, step_s = _bubbles([reports[s]["bubble"][m] for s in range(STAGES)])
        excess = max(bubbles) / theory - 1
        rows.append(
            {
                "micro_batches": m,
                "theory": theory,
                "bubble": bubbles,
                "excess": excess,
                "step_s": step_s,
            }
        )
        print(
            f"{m:>4} {theory:>8.3f} "
            + " ".join(f"{b:>8.3f}" for b in bubbles)
            + f" {excess:>+8.1%} {step_s * 1e3:>8.1f}",
            flush=True,
        )
    summary = {
        "bench": "pipeline",
        "spec": asdict(spec),
        "stages": STAGES,
        "rows": rows,
        "max_bubble_excess": max(r["excess"] for r in rows),
    }
    if spec.compare_torch:
        summary.update(_throughput(spec, reports))
    return summary


def _bubbles(per_stage: list[list[tuple[float, float, float]]]) -> tuple[list[float], float]:
    """Each stage's idle fraction of the makespan of the fastest step, and that makespan.

    The fastest step is the one other processes disturbed least (``timeit`` takes the
    minimum for the same reason): on a shared machine a descheduled stage shows up as
    bubble on its neighbour.
    """
    steps = len(per_stage[0])
    spans = [
        max(r[k][1] for r in per_stage) - min(r[k][0] for r in per_stage) for k in range(steps)
    ]
    best = min(range(steps), key=spans.__getitem__)
    return [1 - records[best][2] / spans[best] for records in per_stage], spans[best]


def _throughput(spec: Spec, reports: dict[int, dict]) -> dict:
    ratios = {}
    print(f"{'M':>4} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>11}", flush=True)
    for m in spec.micro_batches:
        ours = max(reports[s]["throughput"][m]["ours"] for s in range(STAGES))
        theirs = max(reports[s]["throughput"][m]["torch"] for s in range(STAGES))
        ratios[m] = theirs / ours  # throughput ratio: samples per second, ours over torch's
        print(f"{m:>4} {ours * 1e3:>9.2f} {theirs * 1e3:>9.2f} {ratios[m]:>11.3f}", flush=True)
    return {
        "ours_vs_torch_pipelining": min(ratios.values()),
        "ours_vs_torch_pipelining_by_m": ratios,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
