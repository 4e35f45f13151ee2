"""Pipeline bubble: each stage's idle fraction against theory, and ours against torch's.

P stages of equal cost (an MLP of ``Linear + ReLU`` blocks, ``--layers-per-stage`` of them
per stage) run a schedule (``1f1b`` by default) with M micro-batches of a fixed size, for M
in 4, 8, 16. For every step each stage records its compute time; its bubble is the rest of
the step's makespan (first stage start to last stage end), and theory says (P-1)/(M+P-1)
for stages of equal cost. So for the bubble the first stage's input requires its gradient:
a first layer otherwise skips its input's gradient, and the first stage idles for the
difference, which is imbalance between stages, not the schedule's bubble. On CPU each stage
process is pinned to a core of its own, as a stage has a device of its own.

Theory also assumes every forward and every backward takes the same time. Where they vary
(a shared CPU), the schedule itself idles more, whatever runs it: so each step is also
*replayed* (``replay``): the stages' actions, in their order and with the durations measured,
run again on paper with free transfers. Its bubble is the schedule's own given the compute as
it happened; ``excess_over_replay`` is what our implementation added on top (transfers,
waits, bookkeeping).
The stages run in spawned processes with the engine's own stage code (``PipelineStage``,
``StageLink``, ``run_schedule``): gloo on CPU, NCCL on GPU (one process per GPU), no Ray.

Layouts (``--layouts 1x2,2x2,1x4,4x1``): ``DxP`` is D data-parallel replicas of a P-stage
pipeline, D*P processes. After each step every stage's gradients are summed over its D
replicas through our ring (``RingCollective``, one flat buffer, as
``engine.pipeline.step.PipelineStep`` does); the bubble is measured on the schedule alone, the
throughput (samples/s = D x M x micro-size / step) over the whole step, all-reduce included.

With ``--device cuda`` the same stages also run under torch.distributed.pipelining's
``Schedule1F1B`` with the same D, P and M in the same run (the stage's gradients summed over
its replicas with ``dist.all_reduce`` on the replicas' group), and the throughput ratio is
reported. The last line is one JSON object with ``max_bubble_excess`` (the largest measured
bubble over theory, minus 1, over the layouts with P > 1), ``max_bubble_excess_over_replay``
(the same against the replayed bubble) and, when compared,
``ours_vs_torch_pipelining`` (the smallest ours/torch throughput ratio); ``by_layout`` holds
each layout's figures. A layout needing more GPUs than present is skipped with a note, so
the same command runs unchanged on 4 and on 8 GPUs.

    python -m bench.pipeline                        # CPU, 2 processes (layout 1x2)
    python -m bench.pipeline --layouts 2x2          # CPU, 4 processes
    python -m bench.pipeline --device cuda --hidden 8192 --micro-size 256
    python -m bench.pipeline --device cuda --layouts 2x2,1x4,4x1,2x4,4x2
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from bench import headline_json
from bench.ports import free_port

HEADLINE = ("ours_vs_torch_pipelining", "max_bubble_excess")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    device: str
    replicas: int
    """D: data-parallel replicas of the pipeline."""
    stages: int
    """P: stages per replica."""
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
    for _ in range(spec.stages * spec.layers_per_stage):
        blocks += [nn.Linear(spec.hidden, spec.hidden), nn.ReLU()]
    return nn.Sequential(*blocks)


def main(argv: list[str] | None = None) -> dict:
    base, layouts = _parse(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # NVLink multicast (NVLS) can wedge a shared host's GPUs: off unless the user says otherwise.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    print(
        f"# pipeline bubble: layouts {','.join(f'{d}x{p}' for d, p in layouts)} (replicas x "
        f"stages), {base.layers_per_stage} blocks of Linear({base.hidden}, {base.hidden}) per "
        f"stage, micro-batches of {base.micro_size}, schedule {base.schedule}, device "
        f"{base.device} ({_device_name(base.device)}), {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, fastest of {base.steps} steps after {base.warmup} warm-up",
        flush=True,
    )
    by_layout = {}
    for replicas, stages in layouts:
        spec = replace(base, replicas=replicas, stages=stages)
        if spec.device == "cuda" and torch.cuda.device_count() < replicas * stages:
            print(
                f"# skipping layout {replicas}x{stages}: needs {replicas * stages} GPUs, "
                f"{torch.cuda.device_count()} here",
                flush=True,
            )
            continue
        by_layout[f"{replicas}x{stages}"] = _run_layout(spec)
    summary = _summary(base, by_layout)
    print(headline_json(summary, HEADLINE), flush=True)
    return summary


def _run_layout(spec: Spec) -> dict:
    world = spec.replicas * spec.stages
    params = sum(p.numel() for p in mlp(spec).parameters())
    print(
        f"## layout {spec.replicas}x{spec.stages}: {spec.replicas} replicas x {spec.stages} "
        f"stages, {world} processes, {params / 1e6:.1f} M params",
        flush=True,
    )
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(spec, free_port(), queue), nprocs=world, join=True)
    reports = dict(queue.get() for _ in range(world))
    return _report(spec, reports)


def _parse(argv: list[str] | None) -> tuple[Spec, list[tuple[int, int]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--layouts",
        default="1x2",
        help="DxP layouts, comma-separated: D data-parallel replicas of P stages (1x2, 2x2, 4x2)",
    )
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
    layouts = [_layout(text, parser) for text in args.layouts.split(",")]
    cuda = args.device == "cuda"
    spec = Spec(
        device=args.device,
        replicas=layouts[0][0],
        stages=layouts[0][1],
        hidden=args.hidden or (8192 if cuda else 1024),
        layers_per_stage=args.layers_per_stage,
        micro_size=args.micro_size or (512 if cuda else 64),
        micro_batches=tuple(int(m) for m in args.micro_batches.split(",")),
        steps=args.steps,
        warmup=args.warmup,
        schedule=args.schedule,
        compare_torch=cuda if args.compare_torch is None else args.compare_torch,
    )
    return spec, layouts


def _layout(text: str, parser: argparse.ArgumentParser) -> tuple[int, int]:
    replicas, _, stages = text.strip().lower().partition("x")
    if not (replicas.isdigit() and stages.isdigit() and int(replicas) > 0 and int(stages) > 0):
        parser.error(f"--layouts takes DxP pairs of positive counts like 2x2, got {text!r}")
    return int(replicas), int(stages)


# -- one spawned stage -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Groups:
    """This process's process groups: its pipeline's (per use) and its stage's replicas'."""

    link: tuple  # (activations, gradients) of our StageLink
    ring: object  # our ring's NCCL group
    torch_pipe: object  # torch.distributed.pipelining's
    torch_replicas: object  # torch's side of the gradient sum


def _rank(rank: int, spec: Spec, port: int, queue) -> None:
    from ringflow.engine.collective import RingCollective
    from ringflow.engine.pipeline import PipelineConfig, PipelineStage, StageLink, partition_model

    replica, stage_index = divmod(rank, spec.stages)
    world = spec.replicas * spec.stages
    cuda = spec.device == "cuda"
    torch.set_num_threads(4 if cuda else 1)  # more only for building the model on the host
    if not cuda and hasattr(os, "sched_setaffinity"):
        # One core per stage, as one device per stage: a stage the scheduler moves between
        # cores, or puts beside the other, stalls the whole pipeline for that time.
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=dt.timedelta(seconds=120)
    )
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend, store=dist.PrefixStore("default", store), rank=rank, world_size=world
    )
    groups = _new_groups(spec, replica=replica, stage=stage_index)
    torch.manual_seed(spec.seed)
    model = mlp(spec)
    x = torch.randn(spec.micro_size, spec.hidden)
    y = torch.randn(spec.micro_size, spec.hidden)
    split = tuple(2 * spec.layers_per_stage * s for s in range(1, spec.stages))
    partition = partition_model(model, PipelineConfig(stages=spec.stages, balance=split))
    stage = PipelineStage(
        model, partition=partition, stage=stage_index, example=x, loss_fn=F.mse_loss, device=device
    )
    torch.set_num_threads(1)
    link = StageLink(
        store=dist.PrefixStore(f"ours/{replica}", store),
        stage=stage_index,
        stages=spec.stages,
        timeout_s=60,
        backend=backend,
        groups=groups.link if cuda else None,
    )
    ring = RingCollective(
        rank=replica,
        world_size=spec.replicas,
        backend=backend,
        store=dist.PrefixStore(f"ring/{stage_index}", store),
        timeout_s=60,
        group=groups.ring if cuda else None,
    )
    x, y = x.to(device), y.to(device)
    report = {"bubble": {}, "throughput": {}, "ring": ring.transport}
    for m in spec.micro_batches:
        report["bubble"][m] = _timed_steps(stage, link, spec, m, x, y)
        if spec.compare_torch:
            report["throughput"][m] = {
                "ours": _ours_seconds(stage, link, ring, spec, m, x, y),
                "torch": _torch_seconds(stage, groups, spec, m, x, y, device),
            }
    dist.barrier()
    queue.put((rank, report))
    ring.close()
    link.close()
    dist.destroy_process_group()


def _new_groups(spec: Spec, *, replica: int, stage: int) -> _Groups:
    """Every group of the layout, created on every rank in the same order (as NCCL needs)."""
    pipes = [[r * spec.stages + s for s in range(spec.stages)] for r in range(spec.replicas)]
    columns = [[r * spec.stages + s for r in range(spec.replicas)] for s in range(spec.stages)]
    mine: dict[str, list] = {"link": [], "ring": [], "torch_pipe": [], "torch_replicas": []}
    for r, ranks in enumerate(pipes):
        made = [dist.new_group(ranks) for _ in range(3)]  # activations, gradients, torch's
        if r == replica:
            mine["link"], mine["torch_pipe"] = made[:2], [made[2]]
    for s, ranks in enumerate(columns):
        made = [dist.new_group(ranks) for _ in range(2)]  # our ring, torch's all-reduce
        if s == stage:
            mine["ring"], mine["torch_replicas"] = [made[0]], [made[1]]
    return _Groups(
        link=tuple(mine["link"]),
        ring=mine["ring"][0],
        torch_pipe=mine["torch_pipe"][0],
        torch_replicas=mine["torch_replicas"][0],
    )


def _micro(spec: Spec, m: int, x: torch.Tensor, y: torch.Tensor):
    from ringflow.engine.pipeline import MicroBatches

    return MicroBatches(
        sizes=(spec.micro_size,) * m, inputs=[x] * m, targets=[y] * m, weights=(1 / m,) * m
    )


def _timed_steps(stage, link, spec: Spec, m: int, x, y) -> list[tuple]:
    """``(start, end, compute seconds, ((action, seconds), ...))`` of each measured step on
    this stage."""
    from ringflow.engine.pipeline import StepTiming, run_schedule, stage_actions

    actions = stage_actions(spec.schedule, stage=stage.stage, stages=spec.stages, micro_batches=m)
    if stage.is_first:
        x = x.detach().requires_grad_(True)  # the same backward work as the other stages
    micro = _micro(spec, m, x, y)
    records = []
    for step in range(spec.warmup + spec.steps):
        link.barrier()
        timing = StepTiming()
        run_schedule(stage, actions, link=link, micro=micro, timing=timing, sync=True)
        if step >= spec.warmup:
            actions_s = tuple((name, end - begin) for name, begin, end in timing.actions)
            records.append((timing.started, timing.finished, timing.busy_s, actions_s))
    return records


def _ours_seconds(stage, link, ring, spec: Spec, m: int, x, y) -> float:
    """Seconds per step of our schedule and gradient sum (no synchronisation per action)."""
    from ringflow.engine.pipeline import run_schedule, stage_actions

    actions = stage_actions("1f1b", stage=stage.stage, stages=spec.stages, micro_batches=m)
    micro = _micro(spec, m, x, y)
    params = stage.parameters()

    def step() -> None:
        run_schedule(stage, actions, link=link, micro=micro)
        _sum_gradients(params, lambda flat: ring.allreduce_(flat, op="sum"), spec)

    return _seconds_per_step(step, spec, x.device)


def _torch_seconds(stage, groups: _Groups, spec: Spec, m: int, x, y, device) -> float:
    """Seconds per step of torch.distributed.pipelining's Schedule1F1B on the same layers."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B

    submodule = nn.Sequential(*stage.layers)
    torch_stage = TorchStage(submodule, stage.stage, spec.stages, device, group=groups.torch_pipe)
    schedule = Schedule1F1B(torch_stage, n_microbatches=m, loss_fn=F.mse_loss)
    full_x, full_y = torch.cat([x] * m), torch.cat([y] * m)
    params = [p for p in submodule.parameters() if p.requires_grad]

    def all_reduce(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=groups.torch_replicas)

    def step() -> None:
        if stage.is_first and stage.is_last:
            schedule.step(full_x, target=full_y, losses=[])
        elif stage.is_first:
            schedule.step(full_x)
        else:
            schedule.step(target=full_y, losses=[])
        _sum_gradients(params, all_reduce, spec)

    return _seconds_per_step(step, spec, device)


def _sum_gradients(params: list[torch.Tensor], all_reduce, spec: Spec) -> None:
    """The stage's gradients summed over its replicas in one flat buffer, then copied back."""
    if spec.replicas == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    all_reduce(flat)
    offset = 0
    for p in params:
        if p.grad is not None:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


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
    """One layout's table: per stage, the worst bubble over its replicas."""
    P, D = spec.stages, spec.replicas
    print(
        f"{'M':>4} {'theory':>8} "
        + " ".join(f"{f'stage {s}':>8}" for s in range(P))
        + f" {'excess':>8} {'replayed':>9} {'ours/replay':>11} {'step ms':>8}",
        flush=True,
    )
    rows = []
    for m in spec.micro_batches:
        theory = (P - 1) / (m + P - 1)
        per_replica = [
            _bubbles([reports[r * P + s]["bubble"][m] for s in range(P)]) for r in range(D)
        ]
        bubbles = [max(b[s] for b, _, _ in per_replica) for s in range(P)]
        replayed = [max(b[s] for _, _, b in per_replica) for s in range(P)]
        step_s = max(span for _, span, _ in per_replica)
        excess = max(bubbles) / theory - 1 if theory > 0 else None
        over_replay = max(bubbles) / max(replayed) - 1 if max(replayed) > 0 else None
        rows.append(
            {
                "micro_batches": m,
                "theory": theory,
                "bubble": bubbles,
                "excess": excess,
                "replayed_bubble": replayed,
                "excess_over_replay": over_replay,
                "step_s": step_s,
            }
        )
        shown = f"{excess:>+8.1%}" if excess is not None else f"{'-':>8}"
        versus = f"{over_replay:>+11.1%}" if over_replay is not None else f"{'-':>11}"
        print(
            f"{m:>4} {theory:>8.3f} "
            + " ".join(f"{b:>8.3f}" for b in bubbles)
            + f" {shown} {max(replayed):>9.3f} {versus} {step_s * 1e3:>8.1f}",
            flush=True,
        )
    excesses = [r["excess"] for r in rows if r["excess"] is not None]
    over_replay = [r["excess_over_replay"] for r in rows if r["excess_over_replay"] is not None]
    result = {
        "replicas": D,
        "stages": P,
        "ring_transport": reports[0]["ring"],
        "rows": rows,
        "max_bubble_excess": max(excesses) if excesses else None,
        "max_bubble_excess_over_replay": max(over_replay) if over_replay else None,
    }
    if spec.compare_torch:
        result.update(_throughput(spec, reports))
    return result


def _bubbles(per_stage: list[list[tuple]]) -> tuple[list[float], float, list[float]]:
    """Each stage's idle fraction of the makespan of the fastest step, that makespan, and
    each stage's idle fraction in that step's replay.

    The fastest step is the one other processes disturbed least (``timeit`` takes the
    minimum for the same reason): on a shared machine a descheduled stage shows up as
    bubble on its neighbour.
    """
    steps = len(per_stage[0])
    spans = [
        max(r[k][1] for r in per_stage) - min(r[k][0] for r in per_stage) for k in range(steps)
    ]
    best = min(range(steps), key=spans.__getitem__)
    measured = [1 - records[best][2] / spans[best] for records in per_stage]
    return measured, spans[best], replay([records[best][3] for records in per_stage])


def replay(actions: list[tuple[tuple[str, float], ...]]) -> list[float]:
    """Each stage's idle fraction if its actions, in their order and with the durations they
    took, ran with free transfers: ``F i`` on a stage after ``F i`` on the stage before it,
    ``B i`` after ``B i`` on the stage after it.

    The schedule's own bubble given the compute as it happened; measured bubble above it is
    what the implementation added (transfers, waits, bookkeeping). With equal, constant
    action times it is (P-1)/(M+P-1).
    """
    stages = len(actions)
    ends: dict[tuple[int, str], float] = {}
    position, clock = [0] * stages, [0.0] * stages
    while any(position[s] < len(actions[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(actions[s]):
                name, seconds = actions[s][position[s]]
                needs = (s - 1, name) if name[0] == "F" else (s + 1, name)
                if 0 <= needs[0] < stages and needs not in ends:
                    break  # waits for a neighbour that has not run it yet
                start = max(clock[s], ends.get(needs, 0.0))
                clock[s] = ends[(s, name)] = start + seconds
                position[s] += 1
                progressed = True
        if not progressed:
            raise ValueError("the stages' actions wait on each other: not a valid schedule")
    span = max(clock)
    return [1 - sum(t for _, t in stage) / span for stage in actions]


def _throughput(spec: Spec, reports: dict[int, dict]) -> dict:
    ratios, rates = {}, {}
    print(
        f"{'M':>4} {'ours ms':>9} {'torch ms':>9} {'ours samples/s':>15} "
        f"{'torch samples/s':>16} {'ours/torch':>11}",
        flush=True,
    )
    for m in spec.micro_batches:
        ours = max(r["throughput"][m]["ours"] for r in reports.values())
        theirs = max(r["throughput"][m]["torch"] for r in reports.values())
        samples = spec.replicas * m * spec.micro_size
        ratios[m] = theirs / ours  # throughput ratio: samples per second, ours over torch's
        rates[m] = {"ours": samples / ours, "torch": samples / theirs}
        print(
            f"{m:>4} {ours * 1e3:>9.2f} {theirs * 1e3:>9.2f} {samples / ours:>15.1f} "
            f"{samples / theirs:>16.1f} {ratios[m]:>11.3f}",
            flush=True,
        )
    return {
        "ours_vs_torch_pipelining": min(ratios.values()),
        "ours_vs_torch_pipelining_by_m": ratios,
        "samples_per_s_by_m": rates,
    }


def _summary(spec: Spec, by_layout: dict[str, dict]) -> dict:
    excesses = [r["max_bubble_excess"] for r in by_layout.values()]
    excesses = [e for e in excesses if e is not None]
    compared = [
        r["ours_vs_torch_pipelining"] for r in by_layout.values() if "ours_vs_torch_pipelining" in r
    ]
    over_replay = [r["max_bubble_excess_over_replay"] for r in by_layout.values()]
    over_replay = [e for e in over_replay if e is not None]
    summary = {
        "bench": "pipeline",
        "spec": asdict(spec),
        "max_bubble_excess": max(excesses) if excesses else None,
        "max_bubble_excess_over_replay": max(over_replay) if over_replay else None,
        "by_layout": by_layout,
    }
    if len(by_layout) == 1:  # one layout: its figures at the top level too, for short reads
        (only,) = by_layout.values()
        summary.update({k: v for k, v in only.items() if not k.startswith("max_bubble")})
    if compared:
        summary["ours_vs_torch_pipelining"] = min(compared)
    return summary


def _device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return "CPU"


if __name__ == "__main__":
    main()
