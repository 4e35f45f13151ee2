"""Serving throughput and latency: POST /predict with and without server-side batching.

Two modes:

- ``python -m bench.serve`` starts its own Ray (2 CPUs, no dashboard) and Serve on
  127.0.0.1, deploys one small digits model twice (one application with ``@serve.batch``,
  one without), drives each from a separate load-generator process for ``--duration``
  seconds with ``--concurrency`` requests in flight, prints a table, shuts down what it
  started, and prints one JSON line last: ``rps``, ``p50_ms``, ``p99_ms``,
  ``failed_requests`` (of the batched run; both runs under ``runs``).
- ``python -m bench.serve load --url URL`` is only the load generator (tests use it to
  load a server from a second process while a new model is promoted). It prints one JSON
  line: counts, latency percentiles, and which model versions answered, in order.

The load generator imports only httpx and the standard library, so it starts in well under
a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PIXELS = 64
_VERSION_HEADER = "x-model-version"


# --------------------------------------------------------------------------- load generator


@dataclass(kw_only=True)
class _Tally:
    """What the workers saw, in completion order."""

    latencies_ms: list[float] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    versions: list[tuple[float, str]] = field(default_factory=list)
    """``(seconds since start, version)`` of every good answer, in completion order."""

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.errors) < 5:
            self.errors.append(why)


async def _worker(
    client: httpx.AsyncClient, tally: _Tally, start: float, deadline: float, seed: int
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        body = {"pixels": [rng.randint(0, 16) for _ in range(PIXELS)]}
        sent = time.monotonic()
        try:
            response = await client.post("/predict", json=body)
        except httpx.HTTPError as err:
            tally.fail(f"{type(err).__name__}: {err}")
            continue
        done = time.monotonic()
        if response.status_code != 200:
            tally.fail(f"HTTP {response.status_code}: {response.text[:200]}")
            continue
        if not tally.latencies_ms:  # tells a caller waiting on stderr that the load is on
            print("first answer", file=sys.stderr, flush=True)
        tally.latencies_ms.append((done - sent) * 1000.0)
        tally.versions.append((done - start, response.headers.get(_VERSION_HEADER, "?")))


async def run_load(
    url: str, *, duration_s: float, concurrency: int, token: str | None = None
) -> dict[str, Any]:
    """Keep ``concurrency`` single-input requests in flight for ``duration_s`` seconds."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    tally = _Tally()
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=30.0, trust_env=False
    ) as client:
        start = time.monotonic()
        deadline = start + duration_s
        await asyncio.gather(
            *(_worker(client, tally, start, deadline, seed) for seed in range(concurrency))
        )
        elapsed = time.monotonic() - start
    return _summary(tally, elapsed, concurrency)


def _summary(tally: _Tally, elapsed: float, concurrency: int) -> dict[str, Any]:
    ok = len(tally.latencies_ms)
    order: list[str] = []
    first_seen: dict[str, float] = {}
    for at, version in tally.versions:
        if version not in first_seen:
            first_seen[version] = round(at, 3)
            order.append(version)
    tail = [v for _, v in tally.versions[-min(50, ok) :]]
    return {
        "requests": ok + tally.failed,
        "ok": ok,
        "failed_requests": tally.failed,
        "errors": tally.errors,
        "seconds": round(elapsed, 3),
        "concurrency": concurrency,
        "rps": round(ok / elapsed, 1) if elapsed > 0 else 0.0,
        **{f"{name}_ms": _percentile(tally.latencies_ms, q) for name, q in _PERCENTILES},
        "versions": {v: sum(1 for _, x in tally.versions if x == v) for v in order},
        "version_order": order,
        "first_seen_s": first_seen,
        "last_versions": sorted(set(tail)),
    }


_PERCENTILES = (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
    return round(ordered[index], 2)


def _load_main(args: argparse.Namespace) -> int:
    token = os.environ.get(args.token_env) if args.token_env else None
    result = asyncio.run(
        run_load(args.url, duration_s=args.duration, concurrency=args.concurrency, token=token)
    )
    print(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- full benchmark


def load_in_subprocess(url: str, *, duration_s: float, concurrency: int) -> dict[str, Any]:
    """Run the load generator in a second process; return its summary."""
    command = [
        sys.executable,
        "-m",
        "bench.serve",
        "load",
        "--url",
        url,
        "--duration",
        str(duration_s),
        "--concurrency",
        str(concurrency),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=duration_s + 60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bench_main(args: argparse.Namespace) -> int:
    from ringflow.engine.cluster import quiet_environment

    quiet_environment()  # before Ray is imported: a local Ray stays on loopback
    import ray
    import torch
    from ray import serve

    from ringflow.engine.serving import serve_model, shutdown_serving
    from ringflow.models.digits import DigitsClassifier
    from ringflow.storage.checkpoint import save_model

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    apps = {"batched": True, "unbatched": False}
    runs = []
    try:
        torch.manual_seed(0)
        module = DigitsClassifier(hidden=args.hidden).eval()
        with tempfile.TemporaryDirectory() as tmp:
            uri = save_model(f"{tmp}/model", module, hparams={"hidden": args.hidden})
            port = args.port or _free_port()
            urls = {
                name: serve_model(
                    uri,
                    port=port,
                    app_name=f"bench-{name}",
                    route_prefix=f"/{name}",
                    batching=batching,
                    max_batch_size=args.max_batch_size,
                    token_env="RINGFLOW_BENCH_TOKEN_NEVER_SET",
                )
                for name, batching in apps.items()
            }
            for name, url in urls.items():
                load_in_subprocess(url, duration_s=1.0, concurrency=args.concurrency)  # warm-up
                result = load_in_subprocess(
                    url, duration_s=args.duration, concurrency=args.concurrency
                )
                runs.append({"server": name, **result})
    finally:
        for name in apps:
            shutdown_serving(f"bench-{name}")
        serve.shutdown()
        ray.shutdown()
    _print_table(runs)
    batched = runs[0]
    print(
        json.dumps(
            {
                "rps": batched["rps"],
                "p50_ms": batched["p50_ms"],
                "p99_ms": batched["p99_ms"],
                "failed_requests": sum(r["failed_requests"] for r in runs),
                "concurrency": args.concurrency,
                "duration_s": args.duration,
                "runs": [
                    {k: r[k] for k in ("server", "rps", "p50_ms", "p99_ms", "failed_requests")}
                    for r in runs
                ],
            }
        )
    )
    return 0


def _print_table(runs: list[dict[str, Any]]) -> None:
    header = f"{'server':<10} {'requests':>9} {'failed':>7} {'rps':>8} {'p50 ms':>8} "
    header += f"{'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}"
    print(header)
    print("-" * len(header))
    for r in runs:
        print(
            f"{r['server']:<10} {r['requests']:>9} {r['failed_requests']:>7} {r['rps']:>8.1f} "
            f"{r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['max_ms']:>8.2f}"
        )


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__)
    sub = parser.add_subparsers(dest="mode")
    load = sub.add_parser("load", help="only the load generator, against a running server")
    load.add_argument("--url", required=True, help="endpoint, e.g. http://127.0.0.1:8000")
    load.add_argument("--token-env", default=None, help="env var holding the bearer token")
    for p in (parser, load):
        p.add_argument("--duration", type=float, default=10.0, help="seconds of load per run")
        p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width of the model")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--port", type=int, default=0, help="Serve's HTTP port; 0 picks one")
    args = parser.parse_args(argv)
    if not 0 < args.duration <= 3600 or not 1 <= args.concurrency <= 1024:
        parser.error("--duration must be in (0, 3600] and --concurrency in 1..1024")
    return _load_main(args) if args.mode == "load" else _bench_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
