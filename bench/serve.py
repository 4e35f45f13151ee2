"""Serving throughput and latency: POST /predict with and without server-side batching.

Two modes:

- ``python -m bench.serve`` starts its own Ray (2 CPUs, no dashboard) and Serve on
  127.0.0.1, deploys one small digits model twice (one application with ``@serve.batch``,
  one without), drives each from a separate load-generator process for ``--duration``
  seconds with ``--concurrency`` requests in flight, prints a table, shuts down what it
  started, and prints one JSON line last: ``rps``, ``p50_ms``, ``p99_ms``,
  ``failed_requests`` (of the batched run; both runs under ``runs``).
- ``python -m bench.serve redeploy`` measures serving through a flow run that promotes
  and serves a new version: a Prefect flow (the pipeline's own ``register``, ``promote``
  and ``serve-production`` tasks) puts an untrained digits model in production and serves
  it; then, while the load generator keeps ``--concurrency`` requests in flight for
  ``--duration`` seconds, a second run of the same flow registers a trained model, the
  gate promotes it and the run serves it again (``serve_registry`` on the running app).
  It prints a table, then one JSON line: ``failed_requests``, ``p99_ms`` (and ``p99``),
  the versions that answered in order, and when the flow run started and ended. The
  second run serves exactly what runs, so the app follows the pointer in place; with
  ``--rolling`` it serves with another ``poll_s``, which Serve rolls out as a new
  deployment (what a changed token or option does).
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

from bench import headline_json
from bench.ports import free_port

HEADLINE = ("failed_requests", "rps", "p99_ms")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

PIXELS = 64
DIGITS = "ringflow.models.digits:DigitsClassifier"
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
    return _collect(_start_load(url, duration_s=duration_s, concurrency=concurrency), duration_s)


def _start_load(url: str, *, duration_s: float, concurrency: int) -> subprocess.Popen:
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
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(load: subprocess.Popen, duration_s: float) -> dict[str, Any]:
    stdout, stderr = load.communicate(timeout=duration_s + 60)
    if load.returncode != 0:
        raise RuntimeError(f"load generator failed ({load.returncode}): {stderr[-2000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def _wait_first_answer(load: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Block until the load generator reports its first good answer on stderr."""
    deadline = time.monotonic() + timeout_s
    for line in load.stderr:
        if line.startswith("first answer"):
            return
        if time.monotonic() > deadline:
            break
    raise RuntimeError("the load generator got no answer; is the server up?")


def _bench_main(args: argparse.Namespace) -> int:
    from ringflow.engine.cluster import quiet_environment

    quiet_environment()  # before Ray is imported: a local Ray stays on loopback
    import ray
    import torch
    from ray import serve

    from ringflow.models.digits import DigitsClassifier
    from ringflow.serving import serve_model, shutdown_serving
    from ringflow.storage.checkpoint import save_model

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    apps = {"batched": True, "unbatched": False}
    runs = []
    try:
        torch.manual_seed(0)
        module = DigitsClassifier(hidden=args.hidden).eval()
        with tempfile.TemporaryDirectory() as tmp:
            uri = save_model(f"{tmp}/model", module, hparams={"hidden": args.hidden})
            port = args.port or free_port()
            urls = {
                name: serve_model(
                    uri,
                    allowed=DIGITS,
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
        headline_json(
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
            },
            HEADLINE,
        )
    )
    return 0


# --------------------------------------------------------------------------- redeploy


def _redeploy_flow():
    """The serving end of ``train-pipeline`` as a flow of its own: register a trained
    checkpoint, gate its promotion, serve production (redeploying the Serve app)."""
    from prefect import flow

    from ringflow.tasks.registry import promote, register
    from ringflow.tasks.serve import serve_production

    @flow(name="bench-promote-and-serve")
    def promote_and_serve(
        checkpoint: str,
        storage_url: str,
        dataset_url: str,
        metrics: dict,
        run_key: str,
        port: int,
        poll_s: float = 1.0,
    ) -> dict:
        version = register(
            checkpoint,
            storage_url,
            metrics=metrics,
            dataset_url=dataset_url,
            run_key=run_key,
            model="digits",
        )
        gate = promote(version["version"], storage_url, model="digits", allowed=[DIGITS])
        served = serve_production(
            storage_url, dataset_url, port=port, model="digits", model_path=DIGITS, poll_s=poll_s
        )
        return {"version": version["version"], "promoted": gate["promoted"], **served}

    return promote_and_serve


def _two_models(root: str) -> tuple[str, list[tuple[str, dict[str, float]]]]:
    """The digits dataset, an untrained model and a trained one, with their test metrics."""
    import torch

    from ringflow.engine import DataSpec, TrainConfig, evaluate, fit
    from ringflow.models.digits import SCHEMA, DigitsClassifier, write_digits_csv
    from ringflow.storage.checkpoint import save_model
    from ringflow.storage.dataset import preprocess

    write_digits_csv(f"{root}/raw/digits.csv")
    dataset_url = preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0).dataset_url
    data = DataSpec(dataset_url=dataset_url, schema=SCHEMA)
    torch.manual_seed(0)
    untrained = save_model(f"{root}/untrained", DigitsClassifier(hidden=32), hparams={"hidden": 32})
    trained = fit(
        DigitsClassifier,
        hparams={"hidden": 32, "lr": 0.01},
        data=data,
        config=TrainConfig(workers=1, epochs=4, batch_size=64, seed=0),
        checkpoint_uri=f"{root}/trained",
        in_process=True,
    ).checkpoint
    return dataset_url, [
        (uri, evaluate(uri, data, model=DigitsClassifier)) for uri in (untrained, trained)
    ]


def _redeploy_main(args: argparse.Namespace) -> int:
    from ringflow.engine.cluster import quiet_environment

    quiet_environment()  # before Ray is imported: a local Ray stays on loopback
    os.environ.pop("RINGFLOW_SERVE_TOKEN", None)  # the load generator sends no token
    import ray
    from ray import serve

    from ringflow.serving import shutdown_serving

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("PREFECT_HOME", f"{tmp}/prefect")  # a throwaway local server
        storage = f"{tmp}/storage"
        dataset_url, models = _two_models(f"{tmp}/data")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        port = args.port or free_port()
        promote_and_serve = _redeploy_flow()
        try:
            (first, first_metrics), (second, second_metrics) = models
            before = promote_and_serve(first, storage, dataset_url, first_metrics, "first", port)
            url = f"http://127.0.0.1:{port}"
            load = _start_load(url, duration_s=args.duration, concurrency=args.concurrency)
            _wait_first_answer(load)
            started = time.monotonic()
            time.sleep(min(2.0, args.duration / 4))  # some load on the old version first
            flow_start = time.monotonic() - started
            poll_s = 0.5 if args.rolling else 1.0  # another poll_s: another deployment
            after = promote_and_serve(
                second, storage, dataset_url, second_metrics, "second", port, poll_s
            )
            flow_end = time.monotonic() - started
            result = _collect(load, args.duration)
        finally:
            shutdown_serving()
            serve.shutdown()
            ray.shutdown()
    result["server"] = "rolling" if args.rolling else "in place"
    _print_table([result])
    print(
        f"flow run 2 ({after['version']}, promoted={after['promoted']}) ran from "
        f"{flow_start:.1f} s to {flow_end:.1f} s after the first answer; versions answered in "
        f"order: {', '.join(result['version_order'])}"
    )
    summary = {
        k: result[k] for k in ("failed_requests", "requests", "rps", "p50_ms", "p99_ms", "max_ms")
    }
    summary |= {
        "p99": result["p99_ms"],
        "errors": result["errors"],
        "version_order": result["version_order"],
        "versions": result["versions"],
        "served_before": before["model_version"],
        "served_after": after["model_version"],
        "flow_run_s": [round(flow_start, 2), round(flow_end, 2)],
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "rolling": args.rolling,
    }
    print(headline_json(summary, HEADLINE))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__)
    sub = parser.add_subparsers(dest="mode")
    redeploy = sub.add_parser(
        "redeploy", help="load the server while a flow run promotes and serves a new version"
    )
    redeploy.add_argument("--port", type=int, default=0, help="Serve's HTTP port; 0 picks one")
    redeploy.add_argument(
        "--rolling", action="store_true", help="serve with another poll_s: a Serve rolling update"
    )
    load = sub.add_parser("load", help="only the load generator, against a running server")
    load.add_argument("--url", required=True, help="endpoint, e.g. http://127.0.0.1:8000")
    load.add_argument("--token-env", default=None, help="env var holding the bearer token")
    for p in (parser, load, redeploy):
        p.add_argument("--duration", type=float, default=10.0, help="seconds of load per run")
        p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width of the model")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--port", type=int, default=0, help="Serve's HTTP port; 0 picks one")
    args = parser.parse_args(argv)
    if not 0 < args.duration <= 3600 or not 1 <= args.concurrency <= 1024:
        parser.error("--duration must be in (0, 3600] and --concurrency in 1..1024")
    if args.mode == "redeploy":
        return _redeploy_main(args)
    return _load_main(args) if args.mode == "load" else _bench_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
