"""Gradient compression on a slow link: fp32, bf16 and PowerSGD in one run.

A wide MLP on the digits (``--hidden`` units, ``--layers`` hidden layers: a few million
weights against a small batch), trained by ``engine.fit`` on 2 Ray workers of this machine,
whose ring all-reduces go over a link the benchmark limits to ``--link-gbps`` (1 Gb/s by
default, as between hosts on gigabit Ethernet): every all-reduce completes no earlier than
its bytes would take on that link, one transfer after another, while backward goes on
(``throttled_ring``, a collective registered in ``bench._compression_parts``). On a 1 x H200
host's CPU that link takes more than half of an fp32 step (docs/benchmarks.md), as between
hosts.

For each of ``none`` (fp32), ``bf16`` and ``powersgd`` (rank ``--powersgd-rank``, warm-up
``--powersgd-warmup``), the same model, data, seed and steps: bytes each worker put on the
wire, the mean step time and the share of it spent waiting for gradients, the validation
loss after every epoch and the time to reach the target (fp32's final validation loss, plus
``--target-slack``). It prints a table, then one
JSON object with ``powersgd_wire_ratio`` (PowerSGD bytes / fp32 bytes),
``powersgd_reached_target`` and ``powersgd_time_to_target_vs_fp32``.

    python -m bench.compression                      # 2 workers, 1 Gb/s, 12 epochs
    python -m bench.compression --link-gbps 10 --hidden 2048
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench import headline_json
from bench._compression_parts import LINK_GBPS, WIRE_LOG, WideDigits

HEADLINE = ("powersgd_time_to_target_vs_fp32", "powersgd_wire_ratio")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""


def _digits(root: str):
    from ringflow.engine import DataSpec
    from ringflow.models.digits import SCHEMA, write_digits_csv
    from ringflow.storage.dataset import preprocess

    write_digits_csv(f"{root}/raw/digits.csv")
    result = preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0)
    return DataSpec(dataset_url=result.dataset_url, schema=SCHEMA)


def run(args: argparse.Namespace, compression: str, data, root: str) -> dict:
    from ringflow.engine import TrainConfig, fit

    before = set(Path(root, "wire").iterdir())  # each run's workers write files of their own
    curve: list[tuple[float, float]] = []
    started = time.monotonic()
    result = fit(
        WideDigits,
        hparams={"hidden": args.hidden, "layers": args.layers, "lr": args.lr},
        data=data,
        config=TrainConfig(
            workers=2,
            epochs=args.epochs,
            batch_size=args.batch_size,
            seed=args.seed,
            collective="throttled_ring",
            compression=compression,
            powersgd_rank=args.powersgd_rank,
            powersgd_warmup_steps=args.powersgd_warmup,
            cpus_per_worker=1.0,
            timeline=True,
            timeline_warmup=5,
            timeline_steps=20,
        ),
        checkpoint_uri=f"{root}/model-{compression}",
        on_epoch=lambda m: curve.append((time.monotonic() - started, m.metrics["val_loss"])),
    )
    files = set(Path(root, "wire").glob("rank*.json")) - before
    sent = [json.loads(f.read_text()) for f in files]
    return {
        "curve": curve,
        "wire_bytes": max(sent) if sent else None,
        "step_ms": sum(result.timeline.step_ms.values()),
        "wait_ms": result.timeline.step_ms.get("gradient_wait", 0.0),
        "val_loss": result.metrics["val_loss"],
        "val_accuracy": result.metrics["val_accuracy"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link-gbps", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--powersgd-warmup", type=int, default=10)
    parser.add_argument("--target-slack", type=float, default=0.05, help="over fp32's final")
    args = parser.parse_args(argv)

    import ray

    rows = {}
    with tempfile.TemporaryDirectory() as root:
        Path(root, "wire").mkdir()
        # Ray's workers take this process's environment as it is when Ray starts.
        os.environ.update({LINK_GBPS: str(args.link_gbps), WIRE_LOG: f"{root}/wire"})
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            data = _digits(root)
            for compression in ("none", "bf16", "powersgd"):
                rows[compression] = run(args, compression, data, root)
        finally:
            ray.shutdown()
    target = rows["none"]["val_loss"] * (1 + args.target_slack)
    for row in rows.values():
        row["time_to_target_s"] = next((t for t, loss in row["curve"] if loss <= target), None)
    fp32 = rows["none"]
    print(
        f"{args.hidden}-wide MLP ({args.layers} hidden layers), 2 CPU workers, "
        f"{args.link_gbps:g} Gb/s link, {args.epochs} epochs; target val_loss {target:.4f}"
    )
    header = f"{'compression':<12} {'MB/worker':>10} {'step ms':>8} {'waiting':>8}"
    print(f"{header} {'val_loss':>9} {'to target s':>12}")
    for name, row in rows.items():
        to = row["time_to_target_s"]
        print(
            f"{name:<12} {row['wire_bytes'] / 1e6:>10.1f} {row['step_ms']:>8.1f} "
            f"{row['wait_ms'] / row['step_ms']:>8.0%} {row['val_loss']:>9.4f} "
            f"{'not reached' if to is None else f'{to:.1f}':>12}"
        )
    psgd = rows["powersgd"]
    summary = {
        "powersgd_wire_ratio": round(psgd["wire_bytes"] / fp32["wire_bytes"], 4),
        "bf16_wire_ratio": round(rows["bf16"]["wire_bytes"] / fp32["wire_bytes"], 4),
        "powersgd_reached_target": psgd["time_to_target_s"] is not None,
        "powersgd_time_to_target_vs_fp32": None
        if psgd["time_to_target_s"] is None or fp32["time_to_target_s"] is None
        else round(psgd["time_to_target_s"] / fp32["time_to_target_s"], 3),
        "step_ms": {name: round(row["step_ms"], 1) for name, row in rows.items()},
        "fp32_wait_share": round(fp32["wait_ms"] / fp32["step_ms"], 3),
        "val_loss": {name: row["val_loss"] for name, row in rows.items()},
        "target_val_loss": target,
        "link_gbps": args.link_gbps,
    }
    print(headline_json(summary, HEADLINE))
    return summary


if __name__ == "__main__":
    main()
