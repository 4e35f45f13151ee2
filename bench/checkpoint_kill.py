"""SIGKILL a process that saves checkpoints at random moments; every next load must be right.

Each round starts a child that resumes after the latest checkpoint and saves step after step
(synchronously in even rounds, through :class:`~storage.AsyncCheckpointer` in odd ones), then
kills it with SIGKILL after a random delay: in the middle of writing a shard, publishing a
manifest, deleting old checkpoints, or between saves. The parent then loads the latest
checkpoint and counts a bad load when

- its tensors are not exactly what the child saved at that step (a partial or corrupt
  checkpoint was loaded),
- it is not the newest fully committed checkpoint, found independently of the store by
  hashing every file a manifest names, or
- it is older than a step the child had already seen committed.

Run: ``python -m bench.checkpoint_kill [--kills 1000] [--url DIR]``. The last line printed
is one JSON object with ``kills`` and ``bad_loads``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import torch

from bench import headline_json
from ringflow.storage import AsyncCheckpointer, CheckpointStore, LoadedCheckpoint, RetentionPolicy

__all__ = ["KillReport", "expected_shards", "run_kills", "scan_committed"]

HEADLINE = ("bad_loads",)
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

_RUN_KEY = "kill-test"

# Run with -m, every child re-imports this module as its main one, which the fork server has
# already imported; runpy warns about that once per child. The filter is inherited by the
# fork server's children because the fork server imports this module.
warnings.filterwarnings("ignore", "'bench.checkpoint_kill' found in sys.modules", RuntimeWarning)


@dataclass(kw_only=True)
class KillReport:
    """What :func:`run_kills` saw."""

    kills: int = 0
    """Children killed with SIGKILL."""
    loads: int = 0
    """Loads checked, one after each kill."""
    bad_loads: int = 0
    """Loads that returned a partial, corrupt, stale or wrong checkpoint."""
    empty_loads: int = 0
    """Loads that correctly found no committed checkpoint yet."""
    interrupted_writes: int = 0
    """Kills that left a step newer than the newest commit: the kill hit a write."""
    newest_step: int = -1
    """Step of the last checkpoint loaded."""
    problems: list[str] = field(default_factory=list)
    """What was wrong with each bad load."""


def expected_shards(step: int) -> dict[str, dict[str, torch.Tensor]]:
    """The exact state the child saves at ``step``: a few dtypes, 260 KB in two shards."""
    generator = torch.Generator().manual_seed(step)
    return {
        "replicated": {
            "weight": torch.randn(256, 256, generator=generator),
            "bias": torch.full((256,), float(step), dtype=torch.float64),
            "step": torch.tensor(step, dtype=torch.int64),
        },
        "rank-00000": {"rng": torch.randint(0, 255, (64,), dtype=torch.uint8, generator=generator)},
    }


def run_kills(
    url: str,
    *,
    kills: int,
    seed: int = 0,
    max_delay_s: float = 0.15,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
    settle: Callable[[], None] | None = None,
) -> KillReport:
    """Kill ``kills`` children saving checkpoints under ``url`` and check each next load.

    ``settle`` is called after each kill, before the checks: a storage service may still be
    completing requests the killed child sent (a remote store, or a proxy in front of one).
    """
    context = mp.get_context("forkserver")
    # The fork server imports torch (and s3fs, where installed) once, so each child starts in
    # milliseconds, not seconds. Modules that fail to import are skipped.
    context.set_forkserver_preload(["bench.checkpoint_kill", "s3fs"])
    rng = random.Random(seed)
    store = _store(url, storage_options)
    report = KillReport()
    seen_committed = -1
    resume = 0
    for round_ in range(kills):
        committed = context.Value("q", -1, lock=False)
        ready = context.Event()
        child = context.Process(
            target=_child,
            args=(url, storage_options, resume, round_ % 2 == 1, committed, ready),
            daemon=True,
        )
        child.start()
        if not ready.wait(60):
            raise RuntimeError("the checkpointing child did not start within 60 s")
        time.sleep(rng.uniform(0, max_delay_s))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        if settle is not None:
            settle()
        report.kills += 1
        seen_committed = max(seen_committed, committed.value)
        loaded = store.load_latest(_RUN_KEY)
        newest, partial = scan_committed(url, storage_options)
        report.interrupted_writes += partial
        _check(report, loaded, newest, seen_committed)
        resume = 0 if loaded is None else loaded.step + 1
        if progress and (round_ + 1) % 100 == 0:
            print(f"  {round_ + 1} kills, {report.bad_loads} bad loads", flush=True)
    return report


def scan_committed(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[int | None, bool]:
    """The newest step whose manifest exists and whose every file hashes right, and whether
    a newer step directory (an interrupted write) exists beside it.

    Deliberately independent of :class:`~storage.CheckpointStore`: raw fsspec, raw JSON.
    """
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    run = f"{root.rstrip('/')}/{_RUN_KEY}"
    fs.invalidate_cache(run)
    try:
        steps = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(run, detail=False))
    except FileNotFoundError:
        return None, False
    for position, name in enumerate(reversed(steps)):
        try:
            manifest = json.loads(fs.cat_file(f"{run}/{name}/manifest.json"))
            files = [(s["file"], s["checksum"]) for s in manifest["shards"].values()]
            if all(_matches(fs.cat_file(f"{run}/{name}/{f}"), c) for f, c in files):
                return int(manifest["step"]), position > 0
        except (FileNotFoundError, ValueError, KeyError):
            continue
    return None, bool(steps)


def _check(
    report: KillReport, loaded: LoadedCheckpoint | None, newest: int | None, seen: int
) -> None:
    report.loads += 1
    step = None if loaded is None else loaded.step
    problem = None
    if step != newest:
        problem = f"loaded step {step}, but the newest fully committed step is {newest}"
    elif step is not None and step < seen:
        problem = f"loaded step {step}, older than step {seen} the child saw committed"
    elif loaded is not None and not _same(loaded.shards, expected_shards(loaded.step)):
        problem = f"step {step} loaded with tensors other than those saved"
    if problem:
        report.bad_loads += 1
        report.problems.append(problem)
    report.empty_loads += loaded is None
    report.newest_step = -1 if step is None else step


def _same(
    actual: dict[str, dict[str, torch.Tensor]], wanted: dict[str, dict[str, torch.Tensor]]
) -> bool:
    if actual.keys() != wanted.keys():
        return False
    return all(
        actual[s].keys() == wanted[s].keys()
        and all(
            actual[s][k].dtype == v.dtype and torch.equal(actual[s][k], v)
            for k, v in wanted[s].items()
        )
        for s in wanted
    )


def _matches(data: bytes, checksum: str) -> bool:
    algorithm, _, expected = checksum.partition(":")
    if algorithm == "crc32":
        return f"{zlib.crc32(data):08x}" == expected
    return algorithm == "sha256" and hashlib.sha256(data).hexdigest() == expected


def _store(url: str, storage_options: dict[str, Any] | None) -> CheckpointStore:
    return CheckpointStore(
        url, retention=RetentionPolicy(keep_last=2), storage_options=storage_options
    )


def _child(
    url: str,
    storage_options: dict[str, Any] | None,
    start: int,
    use_async: bool,
    committed: Any,
    ready: Any,
) -> None:
    """Save steps ``start``, ``start + 1``, ... until killed; publish each committed step."""
    logging.getLogger("storage").setLevel(logging.ERROR)
    store = _store(url, storage_options)
    store.latest(_RUN_KEY, verify="manifest")  # as a trainer resuming would; warms the client
    ready.set()
    if not use_async:
        for step in range(start, sys.maxsize):
            store.save(_RUN_KEY, step=step, shards=expected_shards(step), metadata={"step": step})
            committed.value = step
    saver = AsyncCheckpointer(
        store, check_writable=False, on_commit=lambda c: setattr(committed, "value", c.step)
    )
    for step in range(start, sys.maxsize):
        saver.save(_RUN_KEY, step=step, shards=expected_shards(step), metadata={"step": step})
        time.sleep(0.002)  # a training step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--url", default=None, help="store URL (default: a temporary dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.15, help="seconds before a kill")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="ringflow-kill-") as tmp:
        url = args.url or tmp
        started = time.perf_counter()
        report = run_kills(
            url, kills=args.kills, seed=args.seed, max_delay_s=args.max_delay, progress=True
        )
        elapsed = time.perf_counter() - started
    print(f"store            {url}")
    print(f"kills            {report.kills}")
    print(f"loads checked    {report.loads} ({report.empty_loads} before any commit)")
    print(f"kills mid-write  {report.interrupted_writes} (left a newer, uncommitted step)")
    print(f"bad loads        {report.bad_loads}")
    print(f"last step loaded {report.newest_step}")
    print(f"elapsed          {elapsed:.1f} s")
    for problem in report.problems[:20]:
        print(f"  bad: {problem}")
    summary = asdict(report)
    summary.pop("problems")
    print(headline_json({**summary, "seconds": round(elapsed, 1)}, HEADLINE))
    return 1 if report.bad_loads else 0


if __name__ == "__main__":
    sys.exit(main())
