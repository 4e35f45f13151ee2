"""GPT training throughput on 1 to N GPUs: ours (``engine.fit`` on Ray) against torch DDP and
FSDP2, eager and compiled, in one call.

Every runner trains ``ringflow.models.gpt.GPTModule`` (GPT-2 small by default) on the same
tokens (the standard library's ``.py`` bytes, ``models/gpt.py``), in the same global order
(``engine.data.EpochOrder``), with the same per-GPU batch (16 x 1024 tokens by default), bf16,
AdamW and warm-up+cosine schedule:

- ``ours``: ``engine.fit`` on Ray actors, one GPU each (``gpus_per_worker=1``), precision
  ``bf16-mixed``, gradients summed by our ring in buckets of ``--bucket-mb`` during backward;
- ``ddp``: ``DistributedDataParallel`` (NCCL, the same bucket size) in spawned processes,
  under the same autocast;
- ``fsdp``: FSDP2, ``fully_shard`` on each block and on the root, bf16 parameters and fp32
  gradient reduction (``MixedPrecisionPolicy``), in spawned processes.

``compiled`` compiles each transformer block (``GPTModule(compile=True)``), as torchtitan does;
``whole`` compiles the whole model at once (``compile="model"``), as most users write
``torch.compile(model)``: DDP splits its graph at its buckets (dynamo's ``DDPOptimizer``), and
so do our workers (``engine.module.compiled_in_buckets``).

Timing is steady state. An epoch is ``--steps`` global batches; the first
``ceil(warmup_steps / steps)`` epochs warm up (CUDA set-up, compilation) and the last epoch
is timed, every runner from the end of its first step to the end of its last on a
synchronised clock (for ours inside each worker, by :class:`TimedGPT`, the slowest worker
counting), so ``steps - 1`` steps. For ours the whole last epoch as its driver sees it
(``on_epoch``) is reported too (``ours_epoch``): it adds the epoch's end, one validation
batch per worker and the in-memory commit of the weights and optimizer state. Every runner
trains the same number of tokens.

On a host shared with other tenants, runs of one runner differ by several percent;
``--repeats N`` runs each runner N times, interleaved, and counts each one's fastest run
(every run's tokens/s are in its ``runs``).

Prints one row per run (runner, mode, GPUs, tokens/s, MFU, ours/DDP, scaling efficiency
``tokens/s(n) / (n x tokens/s(1))``) and, last, one JSON object: ``ours_vs_ddp_by_gpus``
and ``ours_vs_fsdp_by_gpus`` (per mode, per GPU count), ``scaling_efficiency_4`` (per mode,
per runner; ``null`` where 4 GPUs did not run), ``mfu`` (per mode, per runner, per GPU
count; ``null`` on CPU), ``tokens`` and the raw ``results``. MFU counts
``GPT.flops_per_token`` (6 N plus attention, as nanoGPT and PaLM do) against the GPU's dense
bf16 peak (H100 and H200: 989 TFLOP/s).

GPU counts above those present are skipped with a note, so the same command runs on 2, 4 or 8:

    python -m bench.gpu_train --gpus 1,2,4 --compile eager,compiled
    python -m bench.gpu_train --device cpu --preset tiny --gpus 1,2 --steps 4   # gloo, CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from bench import headline_json, local_ray, stdlib_windows
from ringflow.engine import phases
from ringflow.engine.config import SHARD_MODES
from ringflow.models.gpt import GPTModule

HEADLINE = (
    "ours_vs_ddp_by_gpus",
    "ours_epoch_vs_ddp_by_gpus",
    "ours_wall_vs_ddp_by_gpus",
    "ours_warm_wall_vs_ddp_by_gpus",
    "ours_vs_fsdp_by_gpus",
    "scaling_efficiency_4",
)
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

RUNNERS = ("ours", "ddp", "fsdp")
MODES = ("eager", "compiled", "whole")
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peaks (FLOP/s) by GPU name."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What every runner trains at one GPU count and mode."""

    device: str
    preset: str
    seq_len: int
    per_gpu_batch: int
    steps: int
    """Global batches an epoch; the last epoch is timed."""
    warmup_epochs: int
    gpus: int = 1
    mode: str = "eager"
    compile_backend: str = "inductor"
    bucket_mb: float = 25.0
    collective: str = "ring"
    """Ours' collective (``TrainConfig.collective``): ``ring``, or ``native`` to set the engine
    beside DDP on NCCL's all-reduce, everything else ours."""
    commit_every: int | None = None
    """Ours' in-memory commits (``TrainConfig.commit_every``): every this many steps, inside
    the timed epoch too; ``None``: once an epoch, at its end (outside the timed steps)."""
    precision: str = "bf16-mixed"
    shard: str = "none"
    """Ours' sharding (``TrainConfig.shard``): ``parameters`` is FSDP's full sharding, for
    ours against the FSDP2 runner."""
    seed: int = 0
    lr: float = 6e-4
    repeats: int = 1
    """Runs of each runner and mode, interleaved (ours, DDP, ours, DDP, ...); the fastest
    counts."""
    timeline_url: str | None = None
    """Record a timeline and write its trace here: ours through ``TrainConfig.timeline``; DDP
    the same spans (data, forward, backward with its own wait for the last buckets,
    optimizer) from its loop, on the same clock, for a step split to set beside ours."""

    @property
    def global_batch(self) -> int:
        return self.per_gpu_batch * self.gpus

    @property
    def total_steps(self) -> int:
        return (self.warmup_epochs + 1) * self.steps

    def timeline_window(self) -> dict[str, int]:
        """The batches a timeline records, in each worker's count: the timed ones (the last
        epoch from its second step, as the timing)."""
        skip = 1 if self.steps > 1 else 0
        return {"warmup": self.warmup_epochs * self.steps + skip, "steps": self.steps - skip}

    def hparams(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "overrides": {"block_size": self.seq_len},
            "lr": self.lr,
            "warmup_steps": min(10, self.total_steps),
            "decay_steps": self.total_steps,
            "compile": {"eager": False, "compiled": True, "whole": "model"}[self.mode],
            "compile_backend": self.compile_backend,
        }


@dataclass(frozen=True, kw_only=True)
class Result:
    runner: str
    mode: str
    gpus: int
    tokens: int
    """Tokens trained in the whole run, warm-up included."""
    timed_tokens: int
    timed_s: float
    wall_s: float
    """The whole run, start-up included."""

    epoch_tokens_per_s: float | None = None
    """Ours: over the whole timed epoch as the driver sees it, its end included."""
    timeline: dict[str, Any] | None = None
    """With ``Spec.timeline_url``: the timeline's summary (``TimelineSummary``)."""
    runs: list[float] | None = None
    """With ``Spec.repeats`` above 1: tokens/s of each run, in order; this is the fastest."""
    walls: list[float] | None = None
    """With ``Spec.repeats`` above 1: each run's ``wall_s``, in order (ours' first on fresh
    worker processes, the later ones on the pool's warm ones)."""
    phases: dict[str, float] | None = None
    """Seconds from the run's start to the end of each phase of its start-up and end
    (``engine.phases``: the driver's, and the slowest worker's or rank's)."""
    step_ms: dict[str, float] | None = None
    """The timed steps' durations (``median``, ``p90``, ``max`` in ms; each the largest over
    the ranks): a run slower throughout, or one slowed by a few long steps."""

    @property
    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.timed_s


class StepClock:
    """Marks the end of each step where the device runs it (a CUDA event on the current
    stream, no synchronisation; the host's clock on CPU); :meth:`step_ms` reads the steps'
    durations once the device is synchronised."""

    STATS = ("median", "p90", "max")
    """What :meth:`step_ms` reports, in its order."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[Any] = []

    def mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def step_ms(self) -> dict[str, float]:
        """Median, 90th percentile and maximum of the durations between the marks."""
        pairs = zip(self._marks, self._marks[1:], strict=False)
        if self._cuda:
            ms = [a.elapsed_time(b) for a, b in pairs]
        else:
            ms = [(b - a) * 1e3 for a, b in pairs]
        ms = torch.tensor(ms or [0.0], dtype=torch.float64)
        values = (ms.median(), ms.quantile(0.9), ms.max())
        return {name: value.item() for name, value in zip(self.STATS, values, strict=True)}


class TimedGPT(GPTModule):
    """``GPTModule`` timing, in each worker, the last epoch's steps after its first: from the
    end of its first batch to the end of its last, the GPU synchronised at both, logged as
    ``timed_s`` (the epoch's maximum over the workers), and each of those steps on the
    device (:class:`StepClock`), logged as ``step_ms_median``, ``step_ms_p90`` and
    ``step_ms_max``."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.current_epoch == 0 and batch_idx == 0:
            _sync(self.device)
            phases.mark("first step", role="worker")
        if self.current_epoch != self.trainer.max_epochs - 1:
            return
        if batch_idx == 0:
            _sync(self.device)
            self._timed_from = time.perf_counter()
            self._clock = StepClock(self.device)
        self._clock.mark()
        if batch_idx == self.trainer.num_training_batches - 1:
            _sync(self.device)
            elapsed = time.perf_counter() - self._timed_from
            self.log("timed_s", elapsed, on_step=False, on_epoch=True, reduce_fx="max")
            for name, ms in self._clock.step_ms().items():
                self.log(f"step_ms_{name}", ms, on_step=False, on_epoch=True, reduce_fx="max")


def main(argv: list[str] | None = None) -> dict:
    spec, gpu_counts, modes, runners, timeline = _parse(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Each run's phases (engine.phases), from the driver, its workers and DDP's ranks: set
    # before Ray starts, whose workers inherit it; this call's own file is removed at its end.
    if os.environ.get(phases.ENV):
        return _main(spec, gpu_counts, modes, runners, timeline)
    fd, path = tempfile.mkstemp(prefix="ringflow-phases-", suffix=".jsonl")
    os.close(fd)
    os.environ[phases.ENV] = path
    try:
        return _main(spec, gpu_counts, modes, runners, timeline)
    finally:
        del os.environ[phases.ENV]
        os.unlink(path)


def _main(
    spec: Spec, gpu_counts: list[int], modes: list[str], runners: list[str], timeline: str | None
) -> dict:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # NVLink multicast (NVLS) can wedge a shared host's GPUs: off unless the user says otherwise.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from ringflow.models.gpt import GPT, GPTConfig

    config = GPTConfig.preset(spec.preset, block_size=spec.seq_len)
    model = GPT(config)
    flops = model.flops_per_token(spec.seq_len)
    peak = _peak(spec.device)
    print(
        f"# gpu_train: GPT {spec.preset} ({model.num_params() / 1e6:.2f} M params, "
        f"{flops / 1e9:.3f} GFLOP/token), per-GPU batch {spec.per_gpu_batch} x {spec.seq_len} "
        f"tokens, {spec.warmup_epochs * spec.steps} warm-up steps, then {spec.steps} of which "
        f"the last {spec.steps - 1} are timed, {spec.precision}, bucket {spec.bucket_mb} MiB, "
        f"ours' collective {spec.collective}, ours' commits every "
        f"{spec.commit_every or spec.steps} steps, device {_device_name(spec)}, "
        f"torch {torch.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        flush=True,
    )
    results: list[Result] = []
    present = torch.cuda.device_count() if spec.device == "cuda" else None
    counts = [n for n in gpu_counts if present is None or n <= present]
    for n in sorted(set(gpu_counts) - set(counts)):
        print(f"# skipping {n} GPUs: only {present} present", flush=True)
    traced: dict[str, Result] = {}
    for n in counts:
        at_most = timeline if n == max(counts) else None
        ran, traced_n = _run_count(replace(spec, gpus=n), modes, runners, timeline=at_most)
        results += ran
        traced.update(traced_n)
    summary = _summary(results, flops=flops, peak=peak, gpu_counts=gpu_counts, modes=modes)
    for runner, run in traced.items():
        key = "timeline" if runner == "ours" else f"{runner}_timeline"
        summary[key] = {"gpus": run.gpus, "mode": run.mode, **run.timeline}
    summary["spec"] = {**asdict(spec), "gpus": gpu_counts, "modes": modes, "runners": runners}
    summary["ray_start_s"] = dict(RAY_START_S)
    summary["device"] = _device_name(spec)
    summary["date"] = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}"
    _print_table(results, summary)
    print(headline_json(summary, HEADLINE), flush=True)
    return summary


def _run_count(
    spec: Spec, modes: list[str], runners: list[str], *, timeline: str | None = None
) -> tuple[list[Result], dict[str, Result]]:
    """Every runner and mode at ``spec.gpus`` GPUs; Ray starts once for the count. With
    ``timeline`` (a folder), ours and DDP run once more in the first mode with the timeline
    on, their traces written there (runs of their own: the timed ones record nothing)."""
    results, traced = [], {}
    with _ray(spec) if "ours" in runners else contextlib.nullcontext():
        for mode in modes:
            spec_m = replace(spec, mode=mode)
            runs: dict[str, list[Result]] = {runner: [] for runner in runners}
            for repeat in range(spec.repeats):
                for runner in runners:
                    runs[runner].append(result := _RUN[runner](spec_m))
                    epoch = result.epoch_tokens_per_s
                    epoch = f", the whole epoch {epoch:.0f} tokens/s" if epoch else ""
                    nth = f" run {repeat + 1}/{spec.repeats}" if spec.repeats > 1 else ""
                    steps = "/".join(f"{v:.1f}" for v in (result.step_ms or {}).values())
                    steps = f", step ms median/p90/max {steps}" if steps else ""
                    print(
                        f"{runner:<5} {mode:<8} gpus={spec.gpus} {result.tokens_per_s:12.0f} "
                        f"tokens/s (timed {result.timed_s:6.2f} s, run {result.wall_s:6.1f} s"
                        f"{epoch}{steps}){nth}",
                        flush=True,
                    )
                    for line in _phase_lines(result):
                        print(f"#   {line}", flush=True)
            results += [_fastest(runs[runner]) for runner in runners]
        for runner in [r for r in ("ours", "ddp") if r in runners and timeline is not None]:
            name = "" if runner == "ours" else f"-{runner}"
            url = os.path.join(timeline, f"gpt-{spec.gpus}gpus-{modes[0]}{name}.json")
            traced[runner] = run = _RUN[runner](replace(spec, mode=modes[0], timeline_url=url))
            print(f"# {runner} timeline, {spec.gpus} GPUs, {modes[0]}: {json.dumps(run.timeline)}")
    return results, traced


def _fastest(runs: list[Result]) -> Result:
    """The fastest of ``runs`` (on a shared host other tenants only ever add time, as
    ``bench.allreduce`` keeps each variant's fastest round), with every run's tokens/s."""
    best = min(runs, key=lambda r: r.timed_s)
    if len(runs) == 1:
        return best
    return replace(
        best, runs=[round(r.tokens_per_s) for r in runs], walls=[round(r.wall_s, 2) for r in runs]
    )


def _phases_since(since: float) -> tuple[dict[str, float], list[str]]:
    """The phases marked since ``since`` (a ``time.time()``): each phase's first end in
    seconds from ``since`` (the slowest process of its role), and the marks as a table."""
    path = os.environ.get(phases.ENV)
    marks = phases.read(path, since=since) if path else []
    first: dict[tuple[str, str, int], float] = {}
    for m in marks:
        first.setdefault((m["role"], m["phase"], m["pid"]), m["t"] - since)
    out: dict[str, float] = {}
    for (role, phase, _), at in first.items():
        key = f"{role}: {phase}"
        out[key] = round(max(out.get(key, at), at), 3)
    return out, phases.table(marks, start=since)


_PHASE_LINES: dict[int, list[str]] = {}
"""Each result's phase table (by ``id``), printed under its row."""


def _phase_lines(result: Result) -> list[str]:
    return _PHASE_LINES.pop(id(result), [])


RAY_START_S: dict[int, float] = {}
"""Seconds ``ray.init`` took, by GPU count: before ours' runs, outside their wall time."""


@contextlib.contextmanager
def _ray(spec: Spec):
    """A private local Ray for the count's runs, or the caller's if one is running."""
    from ringflow.engine.cluster import quiet_environment

    quiet_environment()  # before Ray is imported: a local Ray stays on loopback, quiet
    import ray  # noqa: F401  (imported before the start is timed)

    gpus = {"num_gpus": spec.gpus} if spec.device == "cuda" else {}
    started = time.perf_counter()
    with local_ray(max(2, 2 * spec.gpus), **gpus) as ours:
        if ours:
            RAY_START_S[spec.gpus] = round(time.perf_counter() - started, 3)
            print(
                f"# Ray started in {RAY_START_S[spec.gpus]:.2f} s (not in ours' run wall)",
                flush=True,
            )
        yield


# -- data -------------------------------------------------------------------------------------


def _datasets(spec: Spec):
    """An epoch of ``spec.steps`` global batches of windows, and one batch per GPU to
    validate on; the corpus is repeated if it is shorter than that."""
    from ringflow.models.gpt import TokenWindows

    train_windows, val_windows = spec.steps * spec.global_batch, spec.global_batch
    tokens = stdlib_windows(train_windows + val_windows, spec.seq_len, extra=2)
    cut = train_windows * spec.seq_len + 1
    return (
        TokenWindows(tokens[:cut], spec.seq_len),
        TokenWindows(tokens[cut - 1 :], spec.seq_len),
    )


# -- ours -------------------------------------------------------------------------------------


def _run_ours(spec: Spec) -> Result:
    import ray.cloudpickle

    from ringflow.engine import DatasetData, TrainConfig, fit

    if __name__ != "__main__":  # workers need not import bench (the GPU host has no such link)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    train, validation = _datasets(spec)
    window = spec.timeline_window()
    ends: list[float] = []
    since, started = time.time(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ringflow-gpt-") as root:
        result = fit(
            TimedGPT,
            hparams=spec.hparams(),
            data=DatasetData(train=train, validation=validation),
            config=TrainConfig(
                workers=spec.gpus,
                epochs=spec.warmup_epochs + 1,
                batch_size=spec.global_batch,
                seed=spec.seed,
                bucket_mb=spec.bucket_mb,
                collective=spec.collective,
                precision=spec.precision,
                shard=spec.shard,
                gpus_per_worker=1 if spec.device == "cuda" else 0,
                cpus_per_worker=1.0,
                commit_every=spec.commit_every or spec.steps,
                timeout_s=600.0,
                # No worker is lost here; one may wait minutes for another's first compile.
                collective_timeout_s=600.0,
                timeline=spec.timeline_url is not None,
                timeline_warmup=window["warmup"],
                timeline_steps=window["steps"],
            ),
            checkpoint_uri=f"{root}/model",
            on_epoch=lambda _: ends.append(time.perf_counter()),
            timeline_url=spec.timeline_url,
        )
    wall = time.perf_counter() - started
    split, lines = _phases_since(since)
    out = Result(
        runner="ours",
        mode=spec.mode,
        gpus=spec.gpus,
        tokens=spec.total_steps * spec.global_batch * spec.seq_len,
        timed_tokens=(spec.steps - 1) * spec.global_batch * spec.seq_len,
        timed_s=result.metrics["timed_s"],
        wall_s=wall,
        step_ms={k: result.metrics[f"step_ms_{k}"] for k in StepClock.STATS},
        epoch_tokens_per_s=spec.steps * spec.global_batch * spec.seq_len / (ends[-1] - ends[-2]),
        timeline=None if result.timeline is None else result.timeline.to_json(),
        phases=split,
    )
    _PHASE_LINES[id(out)] = lines
    return out


# -- DDP and FSDP2, in spawned processes ---------------------------------------------------------


def _run_ddp(spec: Spec) -> Result:
    return _spawn("ddp", spec)


def _run_fsdp(spec: Spec) -> Result:
    return _spawn("fsdp", spec)


def _spawn(runner: str, spec: Spec) -> Result:
    queue = mp.get_context("spawn").SimpleQueue()
    since, started = time.time(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ringflow-gpt-") as root:  # rendezvous, spans
        mp.spawn(_rank, args=(runner, spec, root, queue), nprocs=spec.gpus, join=True)
        wall = time.perf_counter() - started
        timed_s, step_ms = queue.get()
        timeline = None if spec.timeline_url is None else _write_timeline(spec, root)
    split, lines = _phases_since(since)
    out = Result(
        runner=runner,
        mode=spec.mode,
        gpus=spec.gpus,
        tokens=spec.total_steps * spec.global_batch * spec.seq_len,
        timed_tokens=(spec.steps - 1) * spec.global_batch * spec.seq_len,
        timed_s=timed_s,
        wall_s=wall,
        step_ms=step_ms,
        timeline=timeline,
        phases=split,
    )
    _PHASE_LINES[id(out)] = lines
    return out


def _write_timeline(spec: Spec, root: str) -> dict[str, Any]:
    """The ranks' spans (files under ``root``: a queue's pipe would block a rank until the
    parent reads, which it does after they exit) as one trace at ``spec.timeline_url``;
    its summary."""
    import fsspec

    from ringflow.engine.timeline import chrome_trace, summarize, trace_bytes

    parts = [json.loads(Path(root, f"spans-{rank}.json").read_text()) for rank in range(spec.gpus)]
    clock = "cuda events" if spec.device == "cuda" else "wall clock"
    trace = chrome_trace(parts, clock=clock)
    with fsspec.open(spec.timeline_url, "wb") as out:
        out.write(trace_bytes(trace))
    return summarize(trace, trace_url=spec.timeline_url).to_json()


def _rank(rank: int, runner: str, spec: Spec, root: str, queue) -> None:
    import psutil
    import torch.distributed as dist

    from ringflow.engine.module import compile_in_place

    phases.mark("process started", role=runner, at=psutil.Process().create_time())
    torch.set_num_threads(1)
    cuda = spec.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{root}/rendezvous",  # no port to race Ray's processes for
        rank=rank,
        world_size=spec.gpus,
        **({"device_id": device} if cuda else {}),
    )
    phases.mark("process group", role=runner)
    try:
        module = _module(spec)
        if runner == "ddp":
            compile_in_place(module)  # as the engine's workers run it
            model = torch.nn.parallel.DistributedDataParallel(
                module.to(device),
                device_ids=[rank] if cuda else None,
                bucket_cap_mb=spec.bucket_mb,
                gradient_as_bucket_view=True,
            )
            forward = _autocast(spec, device)
        else:
            model = _fully_shard(module.to(device), spec)
            forward = contextlib.nullcontext  # the policy casts the parameters to bf16
        phases.mark("module built", role=runner)
        timed_s, clock, spans = _train_loop(
            module, model, spec, rank=rank, device=device, forward=forward, role=runner
        )
        phases.mark("trained", role=runner)
        if spans is not None:
            Path(root, f"spans-{rank}.json").write_text(json.dumps(spans))
        step_ms = clock.step_ms()
        slowest = torch.tensor(list(step_ms.values()), device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            queue.put((timed_s, dict(zip(step_ms, slowest.tolist(), strict=True))))
        dist.barrier()  # every rank is done communicating
    except BaseException:
        dist.destroy_process_group()
        raise
    # Tearing down a process group that DDP's reducer holds can deadlock (gloo's thread waits
    # for the GIL its destructor holds, seen on CPU): the result is out, leave without it.
    os._exit(0)


def _module(spec: Spec):
    """The GPT module as the engine's workers build it: seeded, ``configure_model`` run."""
    torch.manual_seed(spec.seed)
    module = GPTModule(**spec.hparams())
    module.configure_model()
    return module


def _fully_shard(module, spec: Spec):
    """FSDP2 as torchtitan applies it: each block (compiled first, if it is), then the root;
    bf16 parameters and fp32 gradient reduction where the precision is bf16."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch before 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = spec.precision.startswith("bf16") and spec.device == "cuda"
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
    )
    blocks = module.model.blocks
    for i, block in enumerate(blocks):
        # The last block's parameters are gathered again at once for backward: keep them.
        fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(module, mp_policy=policy)
    return module


def _autocast(spec: Spec, device: torch.device):
    from ringflow.engine.module import Precision

    return Precision(spec.precision, device).forward_context


def _train_loop(
    module, model, spec: Spec, *, rank: int, device: torch.device, forward, role: str = "ddp"
) -> tuple[float, StepClock, list[dict[str, Any]] | None]:
    """The engine's step on this rank's part of each global batch, in the engine's order;
    returns the seconds from the end of the last epoch's first step to the end of its last,
    those steps' clock, and with ``spec.timeline_url`` the spans the engine's workers record
    (same window)."""
    from torch.utils.data import default_collate

    from ringflow.engine.data import EpochOrder, Layout
    from ringflow.engine.timeline import UNTIMED, WorkerTimeline
    from ringflow.engine.worker import to_device

    train, _ = _datasets(spec)
    optimization = module.configure_optimizers()
    optimizer, schedule = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    recorder = None
    if spec.timeline_url is not None:  # the window ours records
        recorder = WorkerTimeline(
            device=device, steps_per_epoch=spec.steps, **spec.timeline_window()
        )
    started, clock = 0.0, StepClock(device)
    for epoch in range(spec.warmup_epochs + 1):
        order = EpochOrder(
            Layout((len(train),)), seed=spec.seed, epoch=epoch, batch_size=spec.global_batch
        )
        for step in range(order.steps):
            if epoch == spec.warmup_epochs and step == 1:
                _sync(device)
                started = time.perf_counter()
                clock.mark()
            timeline = UNTIMED if recorder is None else recorder.begin(epoch, step)
            timeline.start("data")
            mine = torch.tensor_split(order.batch(step), spec.gpus)[rank]
            ids, targets = default_collate([train[i] for i in mine])
            ids, targets = to_device((ids, targets), device)  # as the engine's workers do
            timeline.stop("data")
            optimizer.zero_grad(set_to_none=False)
            timeline.start("forward")
            with forward():
                logits = model(ids)
            loss = torch.nn.functional.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1)
            )
            timeline.stop("forward")
            timeline.start("backward")  # DDP waits for its last buckets inside backward
            loss.backward()
            timeline.stop("backward")
            timeline.start("optimizer")
            optimizer.step()
            schedule.step()
            timeline.stop("optimizer")
            timeline.end()
            if epoch == spec.warmup_epochs and step >= 1:
                clock.mark()
            if epoch == 0 and step == 0:
                _sync(device)
                phases.mark("first step", role=role)
    _sync(device)
    timed_s = time.perf_counter() - started
    if recorder is None:
        return timed_s, clock, None
    spans = recorder.spans(rank)
    recorder.close()
    return timed_s, clock, spans


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_RUN = {"ours": _run_ours, "ddp": _run_ddp, "fsdp": _run_fsdp}


# -- summary ----------------------------------------------------------------------------------


def _summary(
    results: list[Result],
    *,
    flops: int,
    peak: float | None,
    gpu_counts: list[int],
    modes: list[str],
) -> dict:
    rate = {(r.runner, r.mode, r.gpus): r.tokens_per_s for r in results}
    # Run wall: each runner's first run (ours on fresh worker processes, as DDP's always
    # are); warm: ours' last run of several, on the pool's workers of the runs before it.
    wall = {(r.runner, r.mode, r.gpus): (r.walls or [r.wall_s])[0] for r in results}
    warm = {(r.runner, r.mode, r.gpus): r.walls[-1] for r in results if r.walls}
    runners = sorted({r.runner for r in results})

    def ratio(a: str, b: str, mode: str) -> dict[int, float | None]:
        return {n: _ratio(rate.get((a, mode, n)), rate.get((b, mode, n))) for n in gpu_counts}

    def efficiency(runner: str, mode: str, n: int) -> float | None:
        one, at_n = rate.get((runner, mode, 1)), rate.get((runner, mode, n))
        return round(at_n / (n * one), 3) if one and at_n else None

    def mfu(r: Result) -> float | None:
        return round(r.tokens_per_s * flops / (r.gpus * peak), 4) if peak else None

    return {
        "ours_vs_ddp_by_gpus": {m: ratio("ours", "ddp", m) for m in modes},
        "ours_vs_fsdp_by_gpus": {m: ratio("ours", "fsdp", m) for m in modes},
        "ours_wall_vs_ddp_by_gpus": {
            m: {n: _ratio(wall.get(("ours", m, n)), wall.get(("ddp", m, n))) for n in gpu_counts}
            for m in modes
        },
        "ours_warm_wall_vs_ddp_by_gpus": {
            m: {n: _ratio(warm.get(("ours", m, n)), wall.get(("ddp", m, n))) for n in gpu_counts}
            for m in modes
        },
        "ours_epoch_vs_ddp_by_gpus": {
            m: {
                r.gpus: _ratio(r.epoch_tokens_per_s, rate.get(("ddp", m, r.gpus)))
                for r in results
                if r.runner == "ours" and r.mode == m
            }
            for m in modes
        },
        "scaling_efficiency_4": {
            m: {runner: efficiency(runner, m, 4) for runner in runners} for m in modes
        },
        "scaling_efficiency": {
            m: {runner: {n: efficiency(runner, m, n) for n in gpu_counts} for runner in runners}
            for m in modes
        },
        "mfu": {
            m: {
                runner: {r.gpus: mfu(r) for r in results if r.runner == runner and r.mode == m}
                for runner in runners
            }
            for m in modes
        },
        "tokens": {
            m: {
                runner: {r.gpus: r.tokens for r in results if r.runner == runner and r.mode == m}
                for runner in runners
            }
            for m in modes
        },
        "flops_per_token": flops,
        "peak_flops": peak,
        "results": [
            {**asdict(r), "tokens_per_s": round(r.tokens_per_s, 1), "mfu": mfu(r)} for r in results
        ],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _print_table(results: list[Result], summary: dict) -> None:
    print(
        f"{'runner':<6} {'mode':<9} {'gpus':>4} {'tokens/s':>12} {'MFU':>6} {'ours/DDP':>9} "
        f"{'scaling eff':>11}",
        flush=True,
    )
    for r in results:
        mfu = summary["mfu"][r.mode][r.runner][r.gpus]
        versus = summary["ours_vs_ddp_by_gpus"][r.mode].get(r.gpus) if r.runner == "ours" else None
        eff = summary["scaling_efficiency"][r.mode][r.runner].get(r.gpus)
        print(
            f"{r.runner:<6} {r.mode:<9} {r.gpus:>4} {r.tokens_per_s:>12.0f} {_cell(mfu, 6, '.3f')} "
            f"{_cell(versus, 9, '.3f')} {_cell(eff, 11, '.3f')}",
            flush=True,
        )


def _cell(value: float | None, width: int, fmt: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


def _peak(device: str) -> float | None:
    if device != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((flops for key, flops in PEAK_BF16.items() if key in name), None)


def _device_name(spec: Spec) -> str:
    if spec.device == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({os.cpu_count()} cores)"


def _parse(argv: list[str] | None) -> tuple[Spec, list[int], list[str], list[str], str | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--preset", default="gpt2_small", help="a GPT preset: gpt2_small, tiny")
    parser.add_argument("--gpus", default="1,2,4", help="GPU (worker) counts: 1,2,4,8")
    parser.add_argument("--compile", default="eager,compiled", help="modes: eager,compiled,whole")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="ours,ddp,fsdp")
    parser.add_argument("--per-gpu-batch", type=int, default=16, help="sequences per GPU a step")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's block")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (an epoch)")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="untimed steps first, rounded up to whole epochs of --steps; default --steps",
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument(
        "--collective",
        choices=("ring", "native"),
        default="ring",
        help="ours' collective: our ring, or torch.distributed's all-reduce (the engine alone)",
    )
    parser.add_argument(
        "--commit-every",
        type=int,
        default=None,
        metavar="N",
        help="ours' in-memory commits every N steps, timed (default: once an epoch, untimed)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run each runner N times, interleaved; the fastest run counts",
    )
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--precision", default="bf16-mixed", help="as TrainConfig.precision")
    parser.add_argument(
        "--shard",
        default="none",
        choices=SHARD_MODES,
        help="ours' TrainConfig.shard (parameters: FSDP's full sharding, eager only)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeline",
        default=None,
        metavar="DIR",
        help="also run ours and DDP once at the largest GPU count with the timeline on; "
        "traces into DIR",
    )
    args = parser.parse_args(argv)
    modes, runners = args.compile.split(","), args.runners.split(",")
    if bad := [m for m in modes if m not in MODES]:
        parser.error(f"--compile takes {','.join(MODES)}, got {bad}")
    if bad := [r for r in runners if r not in RUNNERS]:
        parser.error(f"--runners takes {','.join(RUNNERS)}, got {bad}")
    counts = [int(n) for n in args.gpus.split(",")]
    if any(n < 1 for n in counts) or args.steps < 2 or args.per_gpu_batch < 1:
        parser.error("--gpus and --per-gpu-batch must be positive, --steps at least 2")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.shard == "parameters" and modes != ["eager"] and "ours" in runners:
        parser.error("--shard parameters trains eager only: pass --compile eager")
    if args.commit_every is not None and args.commit_every < 1:
        parser.error(f"--commit-every must be positive, got {args.commit_every}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU here; use --device cpu --preset tiny")
    from ringflow.models.gpt import PRESETS

    if args.preset not in PRESETS:
        parser.error(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    warmup = args.steps if args.warmup_steps is None else args.warmup_steps
    spec = Spec(
        device=args.device,
        preset=args.preset,
        seq_len=args.seq_len or PRESETS[args.preset].block_size,
        per_gpu_batch=args.per_gpu_batch,
        steps=args.steps,
        warmup_epochs=max(1, math.ceil(warmup / args.steps)),
        compile_backend=args.compile_backend,
        bucket_mb=args.bucket_mb,
        collective=args.collective,
        commit_every=args.commit_every,
        repeats=args.repeats,
        precision=args.precision,
        shard=args.shard,
        seed=args.seed,
    )
    return spec, counts, modes, runners, args.timeline


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
