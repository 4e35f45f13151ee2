"""Sharded data parallel (``TrainConfig.shard``) against torch's FSDP2: memory per worker and
step time, on CPU (gloo), in one call.

Every runner trains ``ringflow.models.gpt.GPTModule`` (GPT-2 small by default, 124 M
parameters; ``--model-size tiny`` and ``--layers``/``--width``/``--heads`` for tests) on the
same tokens (``models/gpt.py``'s standard-library bytes), in the same global order
(``engine.data.EpochOrder``), with the same seed, global batch (split over the workers),
fp32, AdamW and warm-up+cosine schedule (``GPTModule.configure_optimizers``), one torch
thread per worker:

- ``ours``: ``engine.fit`` on Ray, one run per ``shard`` mode (``--modes``): ``none`` (every
  worker holds the whole state), ``optimizer`` (ZeRO-1), ``gradients`` (ZeRO-2) and
  ``parameters`` (ZeRO-3). A mode ``TrainConfig`` refuses (``parameters`` until it is
  built) is shown as *not built* and measured as soon as the config accepts it. Fresh worker
  processes for every run (``RINGFLOW_WORKER_POOL=0``; ``--no-fresh-workers``: the pool's
  warm ones, quicker, for tests).
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each transformer block and on the root
  (parameters resharded after forward: ZeRO-3), gloo, in processes spawned by
  ``torch.multiprocessing``, the engine's step (zero the gradients, forward, backward,
  ``optimizer.step()``, the schedule's step) in a loop.

One epoch of ``--warmup-steps`` + ``--steps`` global batches; measured in each worker:

- ``state``: bytes of the parameters, the gradients and the optimizer state the worker holds
  where training ends (``on_train_end``; FSDP2 after its last step), each tensor's untyped
  storage counted once (the parameters that view flat buffers, the gradients that view
  gradient buckets, the optimizer's pieces of them: the buffer once); DTensors by their
  local shard. ``optimizer`` is the optimizer state alone.
- ``peak RSS``: the process's resident high-water mark (``VmHWM``) over the training steps,
  reset (``/proc/self/clear_refs``, after ``malloc_trim``) where training starts: the model
  is built and resident then, a build's transient peak is not counted. Ours' workers hold
  an in-memory commit of the weights from step 0 throughout (``TrainConfig.commit_every``:
  commits are what a lost worker is recovered from). ``peak RSS to end`` adds the end of
  training: ours' epoch-end commit, a host copy of the weights and of the whole optimizer
  state (sharded, gathered from every worker into each: ``ShardedOptimizer.state_dict``).
  FSDP2 has no such end: its two figures are the same. ``start RSS`` is what was resident
  where training started (imports, the model, ours' first commit): the peaks' floor.
- ``step ms``: the median of the timed steps' durations (the end of one step to the end of
  the next), the slowest worker's median.

Every figure is the largest over the workers. Ratios: ``state_vs_none`` and
``optimizer_state_vs_none`` are a mode's bytes over ``shard="none"``'s at the same worker
count (below 1: the mode saves memory; ``fsdp2`` over ours' ``none`` too);
``speed_vs_fsdp2`` is FSDP2's step time over the mode's (above 1: ours faster; the goal is at
least 0.9); ``peak_rss_vs_fsdp2`` is the mode's peak RSS over FSDP2's.

Prints one row per run, a table, and last one JSON object: the headline figures, then
``peak_rss_vs_fsdp2``, ``modes`` (each ``measured``, or why not), ``notes`` (FSDP2 or a run
that could not run, and why) and the raw ``rows``.

    python -m bench.shard --workers 2,4
    python -m bench.shard --model-size tiny --workers 2 --steps 2 --warmup-steps 1   # CI
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from bench import headline_json, local_ray, stdlib_windows
from ringflow.models.gpt import PRESETS, GPTModule

HEADLINE = ("state_vs_none", "optimizer_state_vs_none", "speed_vs_fsdp2")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

MODES = ("none", "optimizer", "gradients", "parameters")
RUNNERS = ("ours", "fsdp2")
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What every runner trains at one worker count."""

    preset: str
    overrides: dict[str, int]
    """``GPTConfig`` fields changed in the preset (layers, width, heads, block size)."""
    seq_len: int
    global_batch: int
    """Sequences a step, split over the workers."""
    steps: int
    """Timed steps, after the warm-up ones."""
    warmup_steps: int
    workers: int = 2
    bucket_mb: float = 25.0
    seed: int = 0
    lr: float = 6e-4

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    def hparams(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "overrides": {**self.overrides, "block_size": self.seq_len},
            "lr": self.lr,
            "warmup_steps": min(10, self.total_steps),
            "decay_steps": self.total_steps,
        }


@dataclass(kw_only=True)
class Row:
    """One run: a runner and mode at a worker count; bytes are the largest over the workers."""

    runner: str
    mode: str
    workers: int
    status: str = "measured"
    """``measured``, ``not built`` or ``failed``."""
    state_bytes: int | None = None
    param_bytes: int | None = None
    grad_bytes: int | None = None
    optimizer_bytes: int | None = None
    peak_rss_bytes: int | None = None
    """Over the training steps (reset where training starts)."""
    end_peak_rss_bytes: int | None = None
    """To the end of training: ours' epoch-end commit included."""
    start_rss_bytes: int | None = None
    """Resident where training started (the peaks' floor)."""
    step_ms: float | None = None
    """The slowest worker's median step."""
    wall_s: float | None = None
    per_worker: list[dict[str, Any]] = field(default_factory=list)
    note: str | None = None


# -- measuring, inside each worker ------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset this process's resident high-water mark to its resident size now (Linux 4.0+),
    after giving the C heap's free pages back (``malloc_trim``: what building the model freed
    is no longer resident); whether it could."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as out:
            out.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (``VmHWM``; ``ru_maxrss`` where there is no
    ``/proc``)."""
    peak = _status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if peak is None else peak


def rss_bytes() -> int | None:
    """This process's resident size now (``VmRSS``)."""
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def state_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the parameters, their gradients and ``optimizer``'s state, each untyped
    storage counted once (views of one flat buffer: the buffer once), in that order: a
    storage is the parameters' if a parameter views it. The optimizer's own parameters (a
    sharded optimizer's pieces) count with the module's. DTensors count their local shard."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = _local(tensor).untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    pieces = [p for group in optimizer.param_groups for p in group["params"]]
    every = [*params, *pieces]
    out = {
        "param_bytes": count(every),
        "grad_bytes": count(p.grad for p in every),
        "optimizer_bytes": count(v for entry in optimizer.state.values() for v in entry.values()),
    }
    out["state_bytes"] = sum(out.values())
    return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _report(record: str, rank: int, marks: list[float], warmup: int, **measured: Any) -> None:
    """Write this rank's figures to ``record``: the timed steps' durations from the end of
    each step (``marks``) after the warm-up ones."""
    timed = [(b - a) * 1e3 for a, b in zip(marks[warmup - 1 :], marks[warmup:], strict=False)]
    report = {"rank": rank, "step_ms": statistics.median(timed) if timed else None, **measured}
    Path(record, f"rank-{rank}.json").write_text(json.dumps(report))


class MeasuredGPT(GPTModule):
    """``GPTModule`` measuring, in each worker, its state where training ends, its peak RSS
    over the steps (:func:`reset_peak_rss` where training starts, read at the last step's
    end) and to the end, and its steps' durations after ``warmup`` steps; written as
    ``rank-<r>.json`` under ``record``."""

    def __init__(self, record: str = "", warmup: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record, self.warmup = record, warmup
        self._marks: list[float] = []
        self._steps_peak: int | None = None
        self._reset = False
        self._start_rss: int | None = None

    def on_train_start(self) -> None:
        self._marks = []
        self._reset = reset_peak_rss()
        self._start_rss = rss_bytes()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._marks.append(time.perf_counter())
        if batch_idx == self.trainer.num_training_batches - 1:
            self._steps_peak = peak_rss_bytes()

    def on_train_end(self) -> None:
        optimizer = self.optimizers()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper's
        _report(
            self.record,
            self.trainer.global_rank,
            self._marks,
            self.warmup,
            **state_bytes(list(self.parameters()), optimizer),
            peak_rss_bytes=self._steps_peak,
            end_peak_rss_bytes=peak_rss_bytes(),
            start_rss_bytes=self._start_rss,
            peak_reset=self._reset,
        )


# -- the run ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    spec, counts, modes, runners, fresh = _parse(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not fresh:
        return _main(spec, counts, modes, runners)
    # Fresh worker processes for every run: no run's memory in the next one's workers.
    pool = os.environ.get("RINGFLOW_WORKER_POOL")
    os.environ["RINGFLOW_WORKER_POOL"] = "0"
    try:
        return _main(spec, counts, modes, runners)
    finally:
        if pool is None:
            del os.environ["RINGFLOW_WORKER_POOL"]
        else:
            os.environ["RINGFLOW_WORKER_POOL"] = pool


def _main(spec: Spec, counts: list[int], modes: list[str], runners: list[str]) -> dict:
    from ringflow.models.gpt import GPT, GPTConfig

    params = GPT(GPTConfig.preset(spec.preset, **spec.hparams()["overrides"])).num_params(
        embeddings=True
    )
    print(
        f"# shard: GPT {spec.preset} {spec.overrides or ''} ({params / 1e6:.2f} M params), "
        f"global batch {spec.global_batch} x {spec.seq_len} tokens, {spec.warmup_steps} warm-up "
        f"steps then {spec.steps} timed, fp32 AdamW, bucket {spec.bucket_mb} MiB, one thread "
        f"per worker, CPU ({os.cpu_count()} cores), torch {torch.__version__}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        flush=True,
    )
    built = {mode: _built(mode) for mode in modes}
    for mode, why in built.items():
        if why is not None:
            print(f"# ours shard={mode!r}: not built ({why})", flush=True)
    rows: list[Row] = []
    notes: list[str] = []
    with local_ray(max(2, max(counts))) if "ours" in runners else contextlib.nullcontext():
        for n in counts:
            one = Spec(**{**asdict(spec), "workers": n})
            for runner in runners:
                for mode in modes if runner == "ours" else ["fsdp2"]:
                    if runner == "ours" and built[mode] is not None:
                        rows.append(Row(runner="ours", mode=mode, workers=n, status="not built"))
                        continue
                    row = _run_ours(one, mode) if runner == "ours" else _run_fsdp2(one)
                    if row.note:
                        notes.append(f"{row.runner} {row.mode} x{n}: {row.note}")
                    print(_line(row), flush=True)
                    rows.append(row)
    summary = _summary(rows, counts, modes, built)
    summary["notes"] = notes
    summary["spec"] = {**asdict(spec), "workers": counts, "modes": modes, "runners": runners}
    summary["params"] = params
    summary["device"] = f"CPU ({os.cpu_count()} cores)"
    summary["torch"] = torch.__version__
    summary["date"] = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}"
    summary["rows"] = [asdict(row) for row in rows]
    _print_table(rows, summary)
    print(headline_json(summary, HEADLINE), flush=True)
    return summary


def _built(mode: str) -> str | None:
    """``None`` where ``TrainConfig`` takes ``shard=mode``; else why not (its message)."""
    from ringflow.engine import TrainConfig

    try:
        TrainConfig(shard=mode)
    except ValueError as err:
        return str(err)
    return None


def _datasets(spec: Spec):
    """An epoch of ``spec.total_steps`` global batches of token windows."""
    from ringflow.models.gpt import TokenWindows

    tokens = stdlib_windows(spec.total_steps * spec.global_batch, spec.seq_len)
    return TokenWindows(tokens, spec.seq_len)


def _from_ranks(row: Row, root: str) -> Row:
    """``row`` filled from the ranks' reports under ``root``: the largest of each figure."""
    reports = [json.loads(Path(root, f"rank-{r}.json").read_text()) for r in range(row.workers)]
    row.per_worker = sorted(reports, key=lambda r: r["rank"])
    for key in (
        "state_bytes",
        "param_bytes",
        "grad_bytes",
        "optimizer_bytes",
        "peak_rss_bytes",
        "end_peak_rss_bytes",
        "start_rss_bytes",
        "step_ms",
    ):
        values = [r[key] for r in reports if r.get(key) is not None]
        setattr(row, key, max(values) if values else None)
    if not all(r.get("peak_reset") for r in reports):
        row.note = "peak RSS not reset where training started: the process's whole life"
    return row


# -- ours -------------------------------------------------------------------------------------


def _run_ours(spec: Spec, mode: str) -> Row:
    import ray

    from ringflow.engine import DatasetData, TrainConfig, fit

    if __name__ != "__main__":  # workers need not import bench
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    row = Row(runner="ours", mode=mode, workers=spec.workers)
    cpus = ray.cluster_resources().get("CPU", spec.workers)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ringflow-shard-") as root:
        try:
            fit(
                MeasuredGPT,
                hparams={**spec.hparams(), "record": root, "warmup": spec.warmup_steps},
                data=DatasetData(train=_datasets(spec)),
                config=TrainConfig(
                    workers=spec.workers,
                    epochs=1,
                    batch_size=spec.global_batch,
                    seed=spec.seed,
                    shard=mode,
                    bucket_mb=spec.bucket_mb,
                    cpus_per_worker=min(1.0, cpus / spec.workers),
                    # One commit at the epoch's end, none inside the timed steps.
                    commit_every=spec.total_steps,
                    timeout_s=600.0,
                    collective_timeout_s=600.0,
                ),
                checkpoint_uri=f"{root}/model",
            )
            row.wall_s = round(time.perf_counter() - started, 2)
            return _from_ranks(row, root)
        except Exception as err:  # one mode failing leaves the others' figures
            row.status, row.note = "failed", f"{type(err).__name__}: {str(err)[:300]}"
            return row


# -- FSDP2, in spawned processes ----------------------------------------------------------------


def _run_fsdp2(spec: Spec) -> Row:
    row = Row(runner="fsdp2", mode="fsdp2", workers=spec.workers)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ringflow-shard-") as root:  # rendezvous, reports
        try:
            mp.spawn(_fsdp2_rank, args=(spec, root), nprocs=spec.workers, join=True)
            row.wall_s = round(time.perf_counter() - started, 2)
            return _from_ranks(row, root)
        except Exception as err:  # FSDP2 that cannot run here: why, in the JSON's notes
            last = str(err).strip().splitlines()[-1:] or [type(err).__name__]
            row.status, row.note = "failed", f"FSDP2 could not run: {last[0][:300]}"
            return row


def _fsdp2_rank(rank: int, spec: Spec, root: str) -> None:
    import torch.distributed as dist
    from torch.utils.data import default_collate

    from ringflow.engine.data import EpochOrder, Layout

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{root}/rendezvous",  # no port to race Ray's processes for
        rank=rank,
        world_size=spec.workers,
    )
    try:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch before 2.6
            from torch.distributed._composable.fsdp import fully_shard
        torch.manual_seed(spec.seed)  # the engine's workers' initial weights
        module = GPTModule(**spec.hparams())
        module.configure_model()
        for block in module.model.blocks:
            fully_shard(block)
        fully_shard(module)
        optimization = module.configure_optimizers()
        optimizer, schedule = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
        train = _datasets(spec)
        order = EpochOrder(
            Layout((len(train),)), seed=spec.seed, epoch=0, batch_size=spec.global_batch
        )
        reset = reset_peak_rss()
        start_rss = rss_bytes()
        marks = []
        for step in range(order.steps):
            mine = torch.tensor_split(order.batch(step), spec.workers)[rank]
            ids, targets = default_collate([train[i] for i in mine])
            optimizer.zero_grad()
            logits = module(ids)
            loss = torch.nn.functional.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1)
            )
            loss.backward()
            optimizer.step()
            schedule.step()
            marks.append(time.perf_counter())
        peak = peak_rss_bytes()
        _report(
            root,
            rank,
            marks,
            spec.warmup_steps,
            **state_bytes(list(module.parameters()), optimizer),
            peak_rss_bytes=peak,
            end_peak_rss_bytes=peak,
            start_rss_bytes=start_rss,
            peak_reset=reset,
        )
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


# -- summary ----------------------------------------------------------------------------------


def _summary(
    rows: list[Row], counts: list[int], modes: list[str], built: dict[str, str | None]
) -> dict:
    got = {(r.runner, r.mode, r.workers): r for r in rows if r.status == "measured"}

    def ours(mode: str, n: int) -> Row | None:
        return got.get(("ours", mode, n))

    def fsdp2(n: int) -> Row | None:
        return got.get(("fsdp2", "fsdp2", n))

    def vs_none(key: str, row: Row | None, n: int) -> float | None:
        none = ours("none", n)
        return _ratio(getattr(row, key, None), getattr(none, key, None))

    state = {m: {n: vs_none("state_bytes", ours(m, n), n) for n in counts} for m in modes}
    state["fsdp2"] = {n: vs_none("state_bytes", fsdp2(n), n) for n in counts}
    optim = {m: {n: vs_none("optimizer_bytes", ours(m, n), n) for n in counts} for m in modes}
    optim["fsdp2"] = {n: vs_none("optimizer_bytes", fsdp2(n), n) for n in counts}
    speed = {
        m: {
            n: _ratio(getattr(fsdp2(n), "step_ms", None), getattr(ours(m, n), "step_ms", None))
            for n in counts
        }
        for m in modes
    }
    rss = {
        m: {
            n: _ratio(
                getattr(ours(m, n), "peak_rss_bytes", None),
                getattr(fsdp2(n), "peak_rss_bytes", None),
            )
            for n in counts
        }
        for m in modes
    }
    status = {}
    for mode in modes:
        failed = [r for r in rows if r.runner == "ours" and r.mode == mode and r.status == "failed"]
        if built[mode] is not None:
            status[mode] = f"not built: {built[mode]}"
        elif failed:
            status[mode] = f"failed: {failed[0].note}"
        else:
            status[mode] = "measured"
    return {
        "state_vs_none": state,
        "optimizer_state_vs_none": optim,
        "speed_vs_fsdp2": speed,
        "peak_rss_vs_fsdp2": rss,
        "modes": status,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.0f}"


def _line(row: Row) -> str:
    if row.status != "measured":
        return f"{row.runner:<6} {row.mode:<10} workers={row.workers} {row.status}: {row.note}"
    return (
        f"{row.runner:<6} {row.mode:<10} workers={row.workers} state {_mib(row.state_bytes)} MiB "
        f"(params {_mib(row.param_bytes)}, grads {_mib(row.grad_bytes)}, optimizer "
        f"{_mib(row.optimizer_bytes)}), peak RSS {_mib(row.peak_rss_bytes)} MiB (to end "
        f"{_mib(row.end_peak_rss_bytes)}, at start {_mib(row.start_rss_bytes)}), "
        f"step {row.step_ms:.1f} ms (run {row.wall_s:.1f} s)"
    )


def _print_table(rows: list[Row], summary: dict) -> None:
    header = (
        f"{'runner':<6} {'mode':<10} {'workers':>7} {'state MiB':>9} {'optim MiB':>9} "
        f"{'RSS start':>9} {'peak RSS':>8} {'RSS end':>8} {'step ms':>9} {'state/none':>10} "
        f"{'optim/none':>10} {'fsdp2/ours':>10} {'RSS/fsdp2':>9}"
    )
    print(header, flush=True)
    for r in rows:
        if r.status != "measured":
            print(f"{r.runner:<6} {r.mode:<10} {r.workers:>7} {r.status}", flush=True)
            continue
        key = "fsdp2" if r.runner == "fsdp2" else r.mode
        speed = summary["speed_vs_fsdp2"].get(key, {}).get(r.workers)
        rss = summary["peak_rss_vs_fsdp2"].get(key, {}).get(r.workers)
        print(
            f"{r.runner:<6} {r.mode:<10} {r.workers:>7} {_mib(r.state_bytes):>9} "
            f"{_mib(r.optimizer_bytes):>9} {_mib(r.start_rss_bytes):>9} "
            f"{_mib(r.peak_rss_bytes):>8} {_mib(r.end_peak_rss_bytes):>8} {r.step_ms:>9.1f} "
            f"{_cell(summary['state_vs_none'][key][r.workers], 10)} "
            f"{_cell(summary['optimizer_state_vs_none'][key][r.workers], 10)} "
            f"{_cell(speed, 10)} {_cell(rss, 9)}",
            flush=True,
        )


def _cell(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.3f}"


def _parse(argv: list[str] | None) -> tuple[Spec, list[int], list[str], list[str], bool]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="2,4", help="worker counts: 2,4")
    parser.add_argument("--modes", default=",".join(MODES), help="ours' TrainConfig.shard modes")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="ours,fsdp2")
    parser.add_argument(
        "--model-size", default="gpt2_small", help=f"a GPT preset: {', '.join(PRESETS)}"
    )
    parser.add_argument("--layers", type=int, default=None, help="default: the preset's")
    parser.add_argument("--width", type=int, default=None, help="n_embd; default: the preset's")
    parser.add_argument("--heads", type=int, default=None, help="default: the preset's")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens a sequence")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences a step, in all")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fresh-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ours on fresh worker processes every run (RINGFLOW_WORKER_POOL=0); --no-fresh-"
        "workers reuses the pool's warm ones (quicker; the peak RSS is still reset where "
        "training starts)",
    )
    args = parser.parse_args(argv)
    modes, runners = args.modes.split(","), args.runners.split(",")
    if bad := [m for m in modes if m not in MODES]:
        parser.error(f"--modes takes {','.join(MODES)}, got {bad}")
    if bad := [r for r in runners if r not in RUNNERS]:
        parser.error(f"--runners takes {','.join(RUNNERS)}, got {bad}")
    if args.model_size not in PRESETS:
        parser.error(f"--model-size must be one of {sorted(PRESETS)}, got {args.model_size!r}")
    counts = [int(n) for n in args.workers.split(",")]
    if any(n < 1 for n in counts) or args.steps < 1 or args.warmup_steps < 1:
        parser.error("--workers and --steps must be positive, --warmup-steps at least 1")
    if any(args.global_batch % n for n in counts):
        parser.error(f"--global-batch ({args.global_batch}) must split evenly over {counts}")
    overrides = {
        name: value
        for name, value in (
            ("n_layer", args.layers),
            ("n_embd", args.width),
            ("n_head", args.heads),
        )
        if value is not None
    }
    spec = Spec(
        preset=args.model_size,
        overrides=overrides,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        bucket_mb=args.bucket_mb,
        seed=args.seed,
    )
    return spec, counts, modes, runners, args.fresh_workers


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
