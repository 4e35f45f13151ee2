"""What an in-memory commit costs: the model and optimizer state copied to host memory.

Every ``commit_every`` steps (10 by default) each worker copies its weights and optimizer
state to host memory, so survivors of a lost worker can roll back to it (``engine.worker``).
For GPT-2 small with AdamW that is 1.5 GB a commit, and training waits for it. Timed, on the
same state (``ringflow.models.gpt``, one AdamW step taken so its state exists):

- ``per tensor``: a fresh host copy of each tensor, ``{k: v.to("cpu")}`` over both state
  dicts, as a hand-written snapshot does (and ringflow's commits did);
- ``ours, fresh``: the commit's copy into new host tensors (pinned on a GPU: all copies
  queued, one wait);
- ``ours, reused``: into the host tensors of a commit already dropped, as every commit after
  the first two does;
- ``ours, queued`` (GPU only): the same, queued on a copy stream as a worker's commit is,
  timed until the commit returns; the copies then land while the next steps' forward and
  backward passes run, and only the next optimizer step waits for them, on the GPU.

With ``--train-steps N`` it also trains (one fixed batch of ``--batch`` sequences, copied from
pinned host memory at every step as a worker's input is, bf16 autocast on a GPU) and commits
every ``--every`` steps, the device synchronised there as where a worker's call of steps
ends, to tell what a commit costs *inside* training: the time over the same steps with only
the synchronisations, per commit, with the host waiting for the copies (``waited``) and, on a
GPU, with them queued before the host waits (``queued``) or after the next step's input
(``deferred``, as ``engine.worker`` commits where a call of steps ends), the next optimizer
step waiting for them on the GPU.

The last line is one JSON object: ``commit_s`` (ours, reused), ``per_tensor_s``, ``fresh_s``,
``queued_s`` (GPU), ``speedup``, ``bytes`` (of the state) and, with ``--train-steps``,
``step_ms`` and ``in_training_ms`` (per commit, by how it waits).

    python -m bench.commit                        # GPU if there is one
    python -m bench.commit --train-steps 60 --every 10
    python -m bench.commit --device cpu --preset gpt2_small
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench import headline_json

HEADLINE = ("speedup", "commit_s", "queued_s")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""


def _state(preset: str, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from ringflow.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset)).to(device)
    # Fused on a GPU, as GPTModule's (its step counts live on the GPU too).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    return model, optimizer


def _per_tensor(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _per_tensor(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_per_tensor(v) for v in value)
    return value


def _timed(copy: Callable[[], Any], rounds: int, settle: Callable[[], Any] = lambda: None) -> float:
    """The median of ``rounds`` copies, each kept until two newer ones exist (a worker keeps
    two commits), so fresh copies get fresh pages as in training; ``settle`` runs untimed
    before each."""
    kept: list[Any] = []
    times = []
    for _ in range(rounds):
        settle()
        started = time.perf_counter()
        kept = [*kept[-1:], copy()]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class _Training:
    """Training steps on one fixed batch, the device synchronised every ``every`` steps, with
    nothing more (``none``), a commit the host waits for after that (``waited``), or, on a
    GPU, a commit queued on a copy stream before it (``queued``) or once the next step's
    input is on its way (``deferred``), which the next optimizer step waits for."""

    def __init__(self, model, optimizer, states, *, device: str, batch: int, every: int):
        self.model, self.optimizer, self.states, self.every = model, optimizer, states, every
        self.on_gpu = device == "cuda"
        self.device = torch.device(device)
        self.ids = torch.randint(0, model.config.vocab_size, (batch, model.config.block_size))
        self.stream = torch.cuda.Stream() if self.on_gpu else None
        self.kinds = ["none", "waited"] + (["queued", "deferred"] if self.on_gpu else [])
        self.tensors: list[torch.Tensor] | None = None
        self.landed: torch.cuda.Event | None = None
        self.deferred: Any = None

    def synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()

    def steps_done(self) -> None:
        """Wait for the steps queued so far, not for a commit's copies (as
        ``engine.worker.collectives_succeeded``: the compute stream only)."""
        if self.on_gpu:
            torch.cuda.current_stream().synchronize()

    def step(self) -> None:
        from ringflow.engine.worker import to_device

        ids = to_device(self.ids, self.device)  # as a worker's input: pinned, not waited for
        self.queue_deferred()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.on_gpu):
            logits = self.model(ids)
        F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
        if self.landed is not None:  # as Worker.after_copies
            torch.cuda.current_stream().wait_event(self.landed)
            self.landed = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def queue_deferred(self) -> None:
        """A deferred commit's copies, behind the input (as ``Worker.queue_deferred``)."""
        from ringflow.storage.checkpointer import copy_to_host

        if self.deferred is not None:
            copies, self.deferred = self.deferred, None
            self.landed = copy_to_host(
                copies.targets, copies.sources, stream=self.stream, after=copies.at
            )

    def run(self, kind: str, steps: int) -> float:
        from ringflow.engine.worker import _host_copy, _host_targets, _stream_mark

        self.synchronize()
        started = time.perf_counter()
        for step in range(1, steps + 1):
            self.step()
            if step % self.every == 0:
                # Where a worker's call of steps ends: the host waits for the steps; a queued
                # commit's copies were queued before, while the GPU still ran them; a deferred
                # one's go behind the next step's input (Worker.train_steps); a waited-for
                # one's come after the wait.
                if kind == "queued":
                    _, self.tensors, self.landed = _host_copy(
                        self.states(), reuse=self.tensors, stream=self.stream
                    )
                elif kind == "deferred":
                    _, copies = _host_targets(self.states(), step, reuse=self.tensors)
                    self.tensors = copies.targets
                    self.deferred = copies._replace(at=_stream_mark(self.device))
                self.steps_done()
                if kind == "waited":
                    _, self.tensors, _ = _host_copy(self.states(), reuse=self.tensors)
        self.queue_deferred()  # the last commit's, with no step after it
        self.synchronize()
        if self.stream is not None:
            self.stream.synchronize()
        return time.perf_counter() - started

    def timed(self, steps: int, rounds: int) -> dict[str, float]:
        """Median seconds of ``steps`` steps by kind, after a warm-up round of each."""
        for kind in self.kinds:  # kernels, the pinned tensors
            self.run(kind, steps)
        times: dict[str, list[float]] = {kind: [] for kind in self.kinds}
        for _ in range(rounds):
            for kind in self.kinds:
                times[kind].append(self.run(kind, steps))
        return {kind: statistics.median(seconds) for kind, seconds in times.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from ringflow.engine.worker import _host_copy

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default)
    parser.add_argument("--preset", default="gpt2_small", help="a GPT preset: gpt2_small, tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--train-steps", type=int, default=0, help="also train this many steps (0: do not)"
    )
    parser.add_argument("--every", type=int, default=10, help="steps between commits, training")
    parser.add_argument("--batch", type=int, default=16, help="sequences a step, training")
    args = parser.parse_args(argv)
    if args.train_steps and not 1 <= args.every <= args.train_steps:
        parser.error(f"--every must be 1 to --train-steps ({args.train_steps}), got {args.every}")
    model, optimizer = _state(args.preset, args.device)

    def states() -> tuple[dict[str, Any], dict[str, Any]]:
        return model.state_dict(), optimizer.state_dict()

    _, tensors, _ = _host_copy(states())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    gigabytes = nbytes / 1e9
    reused = {"tensors": tensors}

    def into_reused() -> None:
        reused["tensors"] = _host_copy(states(), reuse=reused["tensors"])[1]

    rows = {
        "per tensor": _timed(lambda: _per_tensor(states()), args.rounds),
        "ours, fresh": _timed(lambda: _host_copy(states()), args.rounds),
        "ours, reused": _timed(into_reused, args.rounds),
    }
    if args.device == "cuda":
        stream = torch.cuda.Stream()

        def queued() -> None:
            reused["tensors"] = _host_copy(states(), reuse=reused["tensors"], stream=stream)[1]

        # Each round starts once the last one's copies landed.
        rows["ours, queued"] = _timed(queued, args.rounds, settle=stream.synchronize)
        stream.synchronize()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# commit: GPT {args.preset} + AdamW state, {gigabytes:.2f} GB, {name}")
    print(f"{'copy':<14} {'seconds':>8} {'GB/s':>7}")
    for label, seconds in rows.items():
        print(f"{label:<14} {seconds:8.3f} {gigabytes / seconds:7.1f}")
    summary = {
        "commit_s": round(rows["ours, reused"], 4),
        "per_tensor_s": round(rows["per tensor"], 4),
        "fresh_s": round(rows["ours, fresh"], 4),
        "queued_s": round(rows["ours, queued"], 4) if "ours, queued" in rows else None,
        "speedup": round(rows["per tensor"] / rows["ours, reused"], 2),
        "bytes": nbytes,
        "device": name,
        "preset": args.preset,
    }
    if args.train_steps:
        training = _Training(
            model, optimizer, states, device=args.device, batch=args.batch, every=args.every
        )
        trained = training.timed(args.train_steps, args.rounds)
        commits = args.train_steps // args.every
        step_ms = 1e3 * trained["none"] / args.train_steps
        costs = {
            k: 1e3 * (v - trained["none"]) / commits for k, v in trained.items() if k != "none"
        }
        print(
            f"# training: {args.train_steps} steps of {args.batch} x {model.config.block_size} "
            f"tokens, {step_ms:.1f} ms a step, a commit every {args.every}"
        )
        print(f"{'commit':<14} {'ms each':>8}")
        for label, ms in costs.items():
            print(f"{label:<14} {ms:8.1f}")
        summary["step_ms"] = round(step_ms, 2)
        summary["in_training_ms"] = {k: round(v, 2) for k, v in costs.items()}
    print(headline_json(summary, HEADLINE))
    return summary


if __name__ == "__main__":
    main()
