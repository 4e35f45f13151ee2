"""Checkpoint storage throughput against raw fsspec, and how long async saves stall training.

Part 1 writes and reads the same checkpoint bytes twice on the same store, alternating: once
through :class:`~storage.CheckpointStore` (safetensors, CRC-32, manifest, retention) and
once as raw fsspec calls (``pipe_file`` / ``cat_file`` of the very same file bytes). On a
local disk it also compares the store's default, which fsyncs every file before the commit,
with raw writes that fsync too.

Part 2 trains the demo model (``models.digits.DigitsClassifier`` on the bundled digits,
Adam, batch 64) with an :class:`~storage.AsyncCheckpointer` saving model and optimizer state,
and measures how long each ``save`` call (collecting the state included) blocks the training
loop. ``async_stall_fraction`` is that time over the training time between two saves when
saving every ``--every`` steps (default 23: once per epoch of the demo's 1,437 training rows).
``stall/step`` is the same time against a single step, and ``interference`` how much slower
the steps right after a save run while the background thread writes. With the overlapped
copy, gathering and copying the state run in the background during the next step, so
``cost frac`` (``async_cost_fraction``) compares the whole block of steps after a save,
blocked time included, with the block after none: the save's whole cost to the loop, the
background threads' share of the CPU included. Then the same for a
wider model (``--large-hidden``), whose state is tens of MB rather than 0.1 MB.

Run: ``python -m bench.checkpoint [--url URL] [--mb 256]``. The last line printed is one JSON
object with ``save_vs_raw``, ``load_vs_raw`` and ``async_stall_fraction``.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.nn import functional as F

from bench import headline_json
from ringflow.models.digits import DigitsClassifier
from ringflow.storage import AsyncCheckpointer, CheckpointStore, RetentionPolicy, training_state

HEADLINE = ("save_vs_raw", "load_vs_raw", "async_stall_fraction")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Fastest seconds of each operation over the repeats, and the bytes it moved.

    The minimum, not the mean: on a shared machine other tenants only ever add time, so the
    fastest run is the best estimate of each operation's own cost.
    """

    nbytes: int
    save_s: float
    raw_write_s: float
    load_s: float
    raw_read_s: float


@dataclass(frozen=True, kw_only=True)
class Stall:
    """Async-save stall on one model."""

    label: str
    state_mb: float
    step_ms: float
    """Median training step in the blocks after which nothing was saved."""
    stall_ms: float
    """Median time one ``save`` call blocked the loop."""
    stall_max_ms: float
    sync_save_ms: float
    """Fastest of three synchronous ``CheckpointStore.save`` calls of the same state."""
    every: int
    saves: int
    replaced: int
    stall_fraction: float
    """Median blocked time of a save over the time of the ``every`` steps between saves."""
    interference: float
    """How much slower the steps right after a save are than those after none (the
    background write shares the CPU and the GIL), as a fraction."""
    block_cost: float
    """What a save costs the loop in all: the ``every`` steps after a save, the blocked time
    included, against the ``every`` steps after none (median over the pairs of blocks), minus
    1. Work moved to background threads counts here, since it shares the CPU and the GIL."""

    @property
    def stall_vs_step(self) -> float:
        return self.stall_ms / self.step_ms


# ---------------------------------------------------------------------------- throughput


def model_like_state(megabytes: int) -> dict[str, dict[str, torch.Tensor]]:
    """Two shards of fp32 matrices and vectors, like two pipeline stages of an MLP."""
    generator = torch.Generator().manual_seed(0)
    layers = max(2, megabytes // 4)
    shards: dict[str, dict[str, torch.Tensor]] = {"stage-00000": {}, "stage-00001": {}}
    for layer in range(layers):
        shard = shards["stage-00000" if layer < layers // 2 else "stage-00001"]
        shard[f"layers.{layer}.weight"] = torch.randn(1024, 1024, generator=generator)
        shard[f"layers.{layer}.bias"] = torch.randn(1024, generator=generator)
    return shards


def measure_throughput(
    url: str, shards: dict[str, dict[str, torch.Tensor]], *, repeats: int, fsync: bool
) -> Throughput:
    """Alternate store saves and loads with raw writes and reads of the same file bytes.

    Both sides write fresh files each time and delete the previous ones, as the store's
    retention does: overwriting a file in place costs more on ext4 (a truncated file is
    flushed when closed), which would flatter the store.
    """
    store = CheckpointStore(url, retention=RetentionPolicy(keep_last=1), fsync=fsync)
    run = f"bench-{uuid.uuid4().hex[:8]}"
    fs, root = fsspec.core.url_to_fs(store.url)
    checkpoint = store.save(run, step=0, shards=shards)
    step_dir = f"{root}/{run}/step-000000000000"
    blobs = [fs.cat_file(f"{step_dir}/{record.file}") for record in checkpoint.shards.values()]
    times: dict[str, list[float]] = {"save": [], "write": [], "load": [], "read": []}
    previous: str | None = None
    n = len(blobs)
    for step in range(1, repeats + 1):
        raw = f"{root}/raw-{uuid.uuid4().hex[:8]}"
        times["write"].append(_timed(lambda r=raw, p=previous: _raw_write(fs, r, blobs, p, fsync)))
        times["save"].append(_timed(lambda s=step: store.save(run, step=s, shards=shards)))
        times["read"].append(_timed(lambda r=raw: [fs.cat_file(f"{r}/{i}") for i in range(n)]))
        times["load"].append(_timed(lambda: store.load_latest(run)))
        previous = raw
    fs.rm(previous, recursive=True)
    fs.rm(f"{root}/{run}", recursive=True)
    best = {key: min(values) for key, values in times.items()}
    return Throughput(
        nbytes=sum(len(b) for b in blobs),
        save_s=best["save"],
        raw_write_s=best["write"],
        load_s=best["load"],
        raw_read_s=best["read"],
    )


def _raw_write(
    fs: fsspec.AbstractFileSystem, raw: str, blobs: list[bytes], previous: str | None, fsync: bool
) -> None:
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(raw, exist_ok=True)
    for i, data in enumerate(blobs):
        if not fsync:
            fs.pipe_file(f"{raw}/{i}", data)
            continue
        with fs.open(f"{raw}/{i}", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    if previous is not None:
        fs.rm(previous, recursive=True)


def _timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


# ---------------------------------------------------------------------------- async stall


def measure_stall(
    url: str, *, hidden: int, blocks: int, every: int, overlap: bool, label: str
) -> Stall:
    """Train the demo model in blocks of ``every`` steps, saving asynchronously after every
    other block, so that blocks after a save and blocks after none alternate and any drift
    in the machine's load hits both alike. With ``overlap`` the copy runs in the background
    during the next forward and backward pass, fenced before ``optimizer.step()``."""
    model, optimizer, step_fn = _demo_training(hidden)
    store = CheckpointStore(url, retention=RetentionPolicy(keep_last=2))
    run = f"stall-{uuid.uuid4().hex[:8]}"
    tensors, _ = training_state(model, optimizer)
    sync_s = min(_timed(lambda: _save_sync(store, run, model, optimizer)) for _ in range(3))
    stalls: list[float] = []
    after: dict[bool, list[float]] = {True: [], False: []}
    blocks_after: dict[bool, list[float]] = {True: [], False: []}
    with AsyncCheckpointer(store) as saver:
        saver.guard(optimizer)
        saved = False
        for block in range(2 * blocks):
            fenced_before = saver.stalled_s
            times = [_timed(step_fn) for _ in range(every)]
            fenced = saver.stalled_s - fenced_before  # waits for an overlapped copy
            times[0] -= fenced
            after[saved].extend(times)
            if saved:
                stalls[-1] += fenced
            blocks_after[saved].append(sum(times) + (stalls[-1] if saved else 0.0))
            saved = block % 2 == 0
            if saved:
                # Collecting the state is part of what the training loop waits for.
                save = lambda b=block: _save_async(saver, run, b, model, optimizer, overlap)  # noqa: E731
                stalls.append(_timed(save))
        saver.wait()
    assert not saver.errors, saver.errors
    fs, root = fsspec.core.url_to_fs(store.url)
    fs.rm(f"{root}/{run}", recursive=True)
    step_s = statistics.median(after[False])
    return Stall(
        label=label,
        state_mb=sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20,
        step_ms=step_s * 1e3,
        stall_ms=statistics.median(stalls) * 1e3,
        stall_max_ms=max(stalls) * 1e3,
        sync_save_ms=sync_s * 1e3,
        every=every,
        saves=len(stalls),
        replaced=saver.replaced,
        stall_fraction=statistics.median(stalls) / (every * step_s),
        interference=statistics.median(after[True]) / step_s - 1,
        block_cost=statistics.median(
            a / b - 1 for a, b in zip(blocks_after[True], blocks_after[False][1:], strict=False)
        ),
    )


def _demo_training(hidden: int) -> tuple[DigitsClassifier, Any, Callable[[], None]]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    torch.manual_seed(0)
    model = DigitsClassifier(hidden=hidden)
    optimizer = model.configure_optimizers()
    step_fn = _trainer(model, optimizer, x, y)
    for _ in range(5):  # warm up allocator and kernels, and create Adam's state
        step_fn()
    return model, optimizer, step_fn


def _trainer(
    model: DigitsClassifier, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], None]:
    generator = torch.Generator().manual_seed(1)

    def step() -> None:
        batch = torch.randint(0, len(y), (64,), generator=generator)
        loss = F.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()

    return step


def _save_async(
    saver: AsyncCheckpointer, run: str, step: int, model: Any, optimizer: Any, overlap: bool
) -> None:
    def collect() -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        tensors, metadata = training_state(model, optimizer)
        return {"replicated": tensors}, {"optimizer": metadata}

    # As the engine's workers save: with overlap, gathering the state runs in the
    # background too.
    saver.save(run, step=step, collect=collect, overlap=overlap)


def _save_sync(store: CheckpointStore, run: str, model: Any, optimizer: Any) -> None:
    tensors, metadata = training_state(model, optimizer)
    store.save(run, step=0, shards={"replicated": tensors}, metadata={"optimizer": metadata})


# ---------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="store URL (default: a temporary dir)")
    parser.add_argument("--mb", type=int, default=256, help="checkpoint size for part 1")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--blocks", type=int, default=16, help="saves measured in part 2")
    parser.add_argument("--every", type=int, default=23, help="save every N steps")
    parser.add_argument("--hidden", type=int, default=128, help="demo model width")
    parser.add_argument("--large-hidden", type=int, default=32768, help="wider model; 0: skip")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # One thread for training leaves a core for the background writer, and keeps the small
    # model's step time steady on a shared machine (two spinning threads on two busy cores
    # vary by 10x from run to run).
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="ringflow-bench-") as tmp:
        url = args.url or tmp
        local = "://" not in url or url.startswith("file://")
        shards = model_like_state(args.mb)
        plain = measure_throughput(url, shards, repeats=args.repeats, fsync=False)
        durable = (
            measure_throughput(url, shards, repeats=args.repeats, fsync=True) if local else None
        )
        stalls = [
            measure_stall(
                url,
                hidden=hidden,
                blocks=blocks,
                every=every,
                overlap=overlap,
                label=f"{name}, {'overlapped copy' if overlap else 'copy in save'}",
            )
            for name, hidden, blocks, every in (
                ("demo", args.hidden, args.blocks, args.every),
                ("wide", args.large_hidden, max(4, args.blocks // 4), max(5, args.every // 4)),
            )
            if hidden
            for overlap in (False, True)
        ]
    _print_report(url, plain, durable, stalls)


def _print_report(
    url: str, plain: Throughput, durable: Throughput | None, stalls: list[Stall]
) -> None:
    mb = plain.nbytes / 2**20
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} training thread)"
    )
    print(f"store:   {url}   checkpoint: {mb:.0f} MB in 2 shards")
    print()
    print(f"{'':34}{'store MB/s':>12}{'raw MB/s':>12}{'ratio':>8}")
    rows = [
        ("save, no fsync", plain.save_s, plain.raw_write_s),
        ("load (verify + decode)", plain.load_s, plain.raw_read_s),
    ]
    if durable is not None:
        rows.insert(1, ("save, fsync (store default)", durable.save_s, durable.raw_write_s))
    for label, ours, raw in rows:
        print(f"{label:34}{mb / ours:12.0f}{mb / raw:12.0f}{raw / ours:8.2f}")
    print()
    print(
        f"{'async save':32}{'state MB':>9}{'step ms':>9}{'stall ms':>10}{'max ms':>8}"
        f"{'sync ms':>9}{'every':>7}{'stall/step':>11}{'stall frac':>11}{'cost frac':>10}"
        f"{'interfere':>10}"
    )
    for s in stalls:
        print(
            f"{s.label:32}{s.state_mb:9.2f}{s.step_ms:9.2f}{s.stall_ms:10.3f}"
            f"{s.stall_max_ms:8.2f}{s.sync_save_ms:9.1f}{s.every:7d}{s.stall_vs_step:11.3f}"
            f"{s.stall_fraction:11.4f}{s.block_cost:10.4f}{s.interference:10.3f}"
        )
    in_save, overlapped = stalls[0], stalls[1]
    summary: dict[str, Any] = {
        "save_vs_raw": round(plain.raw_write_s / plain.save_s, 3),
        "load_vs_raw": round(plain.raw_read_s / plain.load_s, 3),
        "async_stall_fraction": round(overlapped.stall_fraction, 5),
        "async_stall_vs_step": round(overlapped.stall_vs_step, 4),
        "async_stall_ms": round(overlapped.stall_ms, 3),
        "async_interference": round(overlapped.interference, 4),
        "async_cost_fraction": round(overlapped.block_cost, 5),
        "async_stall_fraction_copy_in_save": round(in_save.stall_fraction, 5),
        "async_stall_vs_step_copy_in_save": round(in_save.stall_vs_step, 4),
        "save_every_steps": overlapped.every,
        "checkpoint_mb": round(mb, 1),
    }
    if durable is not None:
        summary["save_vs_raw_fsync"] = round(durable.raw_write_s / durable.save_s, 3)
    if len(stalls) > 2:
        summary["wide_state_mb"] = round(stalls[3].state_mb, 1)
        summary["wide_async_stall_fraction"] = round(stalls[3].stall_fraction, 5)
        summary["wide_async_stall_vs_step"] = round(stalls[3].stall_vs_step, 4)
        summary["wide_async_stall_vs_step_copy_in_save"] = round(stalls[2].stall_vs_step, 4)
    print(headline_json(summary, HEADLINE))


if __name__ == "__main__":
    main()
