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

The last line is one JSON object: ``commit_s`` (ours, reused), ``per_tensor_s``, ``fresh_s``,
``queued_s`` (GPU), ``speedup`` and ``bytes`` (of the state).

    python -m bench.commit                        # GPU if there is one
    python -m bench.commit --device cpu --preset gpt2_small
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _state(preset: str, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from ringflow.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from ringflow.engine.worker import _host_copy

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default)
    parser.add_argument("--preset", default="gpt2_small", help="a GPT preset: gpt2_small, tiny")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
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
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
