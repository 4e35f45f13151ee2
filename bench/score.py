"""Batch scoring throughput: ``score-pipeline``'s library path against a plain Ray Data script
and against the served ``/predict``, on one generated Parquet table, in one run.

``python -m bench.score`` generates a table of digits-like rows (the 64 pixels of a random
digit plus uniform noise, float64, an ``id`` key; ``--rows``, or ``--gib`` for about that many
GiB of Parquet), saves one untrained digits model (``--hidden``) and scores the table three
ways on a private local Ray (``--cpus``, by default ``--concurrency`` + 1, no dashboard):

- ``ours``: :func:`ringflow.serving.score.score`, what the ``score`` task runs
  (``--engine``: ``ray``, Ray Data actors, by default; ``local`` or ``auto``), with its
  checks, rejected rows, block commits and manifest;
- ``ray_data``: the script a user writes by hand, ``read_parquet`` -> ``map_batches`` over
  ``--concurrency`` actors that each load the model -> ``write_parquet``, with the same
  batch size;
- ``predict``: the first ``--predict-rows`` rows sent to ``/predict`` (``serve_model`` on
  127.0.0.1) as ``{"instances": [...]}`` of ``--request-rows`` rows, ``--clients`` requests
  in flight.

It checks that the three agree (the class of every ``predict`` row and of a sample of
``--sample`` rows between ``ours`` and ``ray_data``, and that ``ours`` wrote every id once),
prints a table, and last one JSON line whose first keys are ``rows_per_s`` (ours),
``ours_vs_ray_data`` and ``ours_vs_predict``.

``--keep DIR`` writes the table and outputs under DIR and keeps them (the 1 GiB run in
docs/scoring.md); by default they go to a temporary folder that is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import headline_json
from bench.ports import free_port

HEADLINE = ("rows_per_s", "ours_vs_ray_data", "ours_vs_predict")
"""The figures in docs/benchmarks.md's summary table, first in the JSON line printed last."""

DIGITS = "ringflow.models.digits:DigitsClassifier"
PIXELS = 64
FILE_ROWS = 1 << 20
"""Rows per generated Parquet file."""
BYTES_PER_ROW = 530
"""About what a generated row takes in Parquet (64 noisy float64 and an int64 key)."""


def make_table(folder: str, rows: int, seed: int = 0, integers: bool = False) -> int:
    """Write ``rows`` digits-like rows as Parquet files under ``folder``; their total bytes.
    ``integers``: whole pixel values (a digit's plus 0 or 1, int64), as the demo's own data
    holds them, so that the demo's model (whose schema says integers) takes every row;
    written uncompressed (about :data:`BYTES_PER_ROW` a row, as the noisy floats compressed):
    compressed, small integers take 40 bytes a row and a GiB 27 M rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    digits = load_digits().data
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    size = 0
    for n, start in enumerate(range(0, rows, FILE_ROWS)):
        count = min(FILE_ROWS, rows - start)
        noise = rng.integers(0, 2, (count, PIXELS)) if integers else rng.random((count, PIXELS))
        pixels = digits[rng.integers(0, len(digits), count)] + noise
        np.clip(pixels, 0.0, 16.0, out=pixels)
        if integers:
            pixels = pixels.astype(np.int64)
        table = pa.table(
            {"id": np.arange(start, start + count, dtype=np.int64)}
            | {f"p{i}": pixels[:, i] for i in range(PIXELS)}
        )
        path = os.path.join(folder, f"part-{n:05d}.parquet")
        plain = {"compression": "none", "use_dictionary": False} if integers else {}
        pq.write_table(table, path, row_group_size=65_536, **plain)
        size += os.path.getsize(path)
    return size


def run_ours(table: str, out: str, uri: str, args: argparse.Namespace) -> dict[str, Any]:
    from ringflow.serving.score import ModelSource, ScoringOptions, score

    started = time.perf_counter()
    result = score(
        table,
        out,
        model=ModelSource(checkpoint=uri, name="digits"),
        allowed=DIGITS,
        key_columns=["id"],
        options=ScoringOptions(
            engine=args.engine,
            block_rows=args.block_rows,
            batch_size=args.batch_size,
            concurrency=args.concurrency,
        ),
    )
    return {
        "seconds": time.perf_counter() - started,
        "rows": result.rows_scored,
        "rejected": result.rows_rejected,
        "engine": result.engine,
    }


class _Predictor:
    """The plain script's actor: loads the model once, answers a batch of rows."""

    def __init__(self, uri: str) -> None:
        from ringflow.storage.checkpoint import load_model

        self.module, _ = load_model(uri, allowed=DIGITS)
        self.module.eval()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        x = np.stack([batch[f"p{i}"] for i in range(PIXELS)], axis=1).astype(np.float32)
        with torch.no_grad():
            probabilities = torch.softmax(self.module(torch.from_numpy(x)), dim=1).numpy()
        return {
            "id": batch["id"],
            "digit": probabilities.argmax(axis=1),
            "probabilities": probabilities,
        }


def run_ray_data(table: str, out: str, uri: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray.data

    started = time.perf_counter()
    ray.data.read_parquet(table).map_batches(
        _Predictor,
        fn_constructor_args=(uri,),
        batch_size=args.batch_size,
        batch_format="numpy",
        concurrency=args.concurrency,
        num_cpus=1,
    ).write_parquet(out)
    return {"seconds": time.perf_counter() - started}


async def _post_all(url: str, rows: np.ndarray, args: argparse.Namespace) -> list[int]:
    import httpx

    chunks = [rows[i : i + args.request_rows] for i in range(0, len(rows), args.request_rows)]
    answers: list[list[int]] = [[] for _ in chunks]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for n in range(len(chunks)):
        queue.put_nowait(n)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            n = queue.get_nowait()
            reply = await http.post("/predict", json={"instances": chunks[n].tolist()})
            reply.raise_for_status()
            answers[n] = [p["digit"] for p in reply.json()["predictions"]]

    async with httpx.AsyncClient(base_url=url, timeout=120.0, trust_env=False) as http:
        await asyncio.gather(*(client(http) for _ in range(args.clients)))
    return [digit for chunk in answers for digit in chunk]


def run_predict(table: str, uri: str, args: argparse.Namespace) -> dict[str, Any]:
    import pyarrow.dataset as ds

    from ringflow.serving import serve_model, shutdown_serving

    head = ds.dataset(table, format="parquet").head(args.predict_rows)
    pixels = np.stack([head[f"p{i}"].to_numpy() for i in range(PIXELS)], axis=1)
    url = serve_model(
        uri,
        allowed=DIGITS,
        port=free_port(),
        app_name="bench-score",
        route_prefix="/score",
        token_env="RINGFLOW_BENCH_TOKEN_NEVER_SET",
        max_body_bytes=16_000_000,
    )
    try:
        asyncio.run(_post_all(url, pixels[: args.request_rows], args))  # warm-up
        started = time.perf_counter()
        digits = asyncio.run(_post_all(url, pixels, args))
        seconds = time.perf_counter() - started
    finally:
        shutdown_serving()
    ids = head["id"].to_pylist()
    return {"seconds": seconds, "rows": len(digits), "ids": ids, "digits": digits}


def _read(folder: str, columns: list[str]):
    import pyarrow.dataset as ds

    return ds.dataset(folder, format="parquet").to_table(columns=columns)


def predictions(out: str, columns: tuple[str, ...] = ("id", "digit")):
    """``columns`` of a scoring output's predictions, from the files its manifest lists."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(os.path.join(out, "_manifest.json")) as f:
        files = [e["path"] for e in json.load(f)["files"] if e["path"].startswith("predictions/")]
    return pa.concat_tables(
        [pq.read_table(os.path.join(out, p), columns=list(columns)) for p in files]
    )


def agreement(rows: int, ours_out: str, ray_out: str, predict: dict, sample: int) -> dict:
    """Every id once in ours; the classes of a sample of rows equal between ours and the
    plain script, and of every /predict row between ours and /predict."""
    ours = predictions(ours_out)
    ids = ours["id"].to_numpy()
    ids_once = len(ids) == rows and bool(np.array_equal(np.sort(ids), np.arange(rows)))
    if not ids_once:
        return {"ids_once": False, "ray_data_agrees": False, "predict_agrees": False}
    by_id = np.empty(rows, dtype=np.int64)
    by_id[ids] = ours["digit"].to_numpy()
    plain = _read(ray_out, ["id", "digit"])
    rng = np.random.default_rng(1)
    pick = rng.choice(plain.num_rows, size=min(sample, plain.num_rows), replace=False)
    plain_ids = plain["id"].to_numpy()[pick]
    plain_digits = plain["digit"].to_numpy()[pick]
    return {
        "ids_once": ids_once,
        "ray_data_rows": plain.num_rows,
        "ray_data_agrees": bool(np.array_equal(by_id[plain_ids], plain_digits)),
        "predict_agrees": by_id[np.asarray(predict["ids"])].tolist() == predict["digits"],
        "sample": int(len(pick)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.score", description=__doc__)
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the table")
    parser.add_argument("--gib", type=float, help="about this many GiB of Parquet instead")
    parser.add_argument("--engine", default="ray", choices=("auto", "local", "ray"))
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--block-rows", type=int, default=65_536)
    parser.add_argument("--concurrency", type=int, default=2, help="Ray actors, both scripts")
    parser.add_argument(
        "--cpus",
        type=int,
        help="logical CPUs of the private Ray; default concurrency + 1, so the plain "
        "script's read and write tasks have one beside its actors",
    )
    parser.add_argument("--hidden", type=int, default=64, help="the digits model's width")
    parser.add_argument("--predict-rows", type=int, default=20_000)
    parser.add_argument("--request-rows", type=int, default=256, help="rows per /predict")
    parser.add_argument("--clients", type=int, default=4, help="/predict requests in flight")
    parser.add_argument("--sample", type=int, default=1000, help="rows compared with ray_data")
    parser.add_argument("--keep", help="write the table and outputs here, and keep them")
    args = parser.parse_args(argv)
    rows = int(args.gib * (1 << 30) / BYTES_PER_ROW) if args.gib else args.rows
    args.predict_rows = min(args.predict_rows, rows)
    args.cpus = args.cpus or args.concurrency + 1

    from ringflow.engine.cluster import quiet_environment

    quiet_environment()  # before Ray is imported: a local Ray stays on loopback
    import ray
    import torch

    from ringflow.models.digits import SCHEMA, DigitsClassifier
    from ringflow.storage.checkpoint import save_model

    root = args.keep or tempfile.mkdtemp(prefix="bench-score-")
    table = os.path.join(root, "table")
    try:
        started = time.perf_counter()
        if os.path.isdir(table):  # kept from an earlier run
            rows, size = _existing(table)
            args.predict_rows = min(args.predict_rows, rows)
        else:
            size = make_table(table, rows)
        made = time.perf_counter() - started
        torch.manual_seed(0)
        module = DigitsClassifier(hidden=args.hidden).eval()
        uri = save_model(
            os.path.join(root, "model"),
            module,
            hparams=dict(module.hparams),
            meta={"data_schema": SCHEMA.to_json()},
        )
        for name in ("ours", "ray_data"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        try:
            ours = run_ours(table, os.path.join(root, "ours"), uri, args)
            plain = run_ray_data(table, os.path.join(root, "ray_data"), uri, args)
            predict = run_predict(table, uri, args)
        finally:
            ray.shutdown()
        agree = agreement(
            rows, os.path.join(root, "ours"), os.path.join(root, "ray_data"), predict, args.sample
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    rates = {
        "ours": rows / ours["seconds"],
        "ray_data": rows / plain["seconds"],
        "predict": predict["rows"] / predict["seconds"],
    }
    print(f"table: {rows} rows, {size / (1 << 30):.3f} GiB Parquet, generated in {made:.1f} s")
    print(f"{'path':<10} {'rows':>10} {'seconds':>9} {'rows/s':>10}")
    for name, result, count in (
        ("ours", ours, rows),
        ("ray_data", plain, rows),
        ("predict", predict, predict["rows"]),
    ):
        print(f"{name:<10} {count:>10} {result['seconds']:>9.2f} {rates[name]:>10.0f}")
    print(
        f"agreement: every id once {agree['ids_once']}; ray_data {agree['ray_data_agrees']} "
        f"({args.sample} sampled); /predict {agree['predict_agrees']} ({predict['rows']} rows)"
    )
    summary = {
        "rows_per_s": round(rates["ours"], 1),
        "ours_vs_ray_data": round(rates["ours"] / rates["ray_data"], 3),
        "ours_vs_predict": round(rates["ours"] / rates["predict"], 3),
        "rows": rows,
        "parquet_bytes": size,
        "engine": ours["engine"],
        "rejected": ours["rejected"],
        "seconds": {k: round(v["seconds"], 3) for k, v in (("ours", ours), ("ray_data", plain))}
        | {"predict": round(predict["seconds"], 3)},
        "ray_data_rows_per_s": round(rates["ray_data"], 1),
        "predict_rows_per_s": round(rates["predict"], 1),
        "predict_rows": predict["rows"],
        **agree,
        "batch_size": args.batch_size,
        "block_rows": args.block_rows,
        "concurrency": args.concurrency,
        "cpus": args.cpus,
        "hidden": args.hidden,
    }
    print(headline_json(summary, HEADLINE))
    return 0 if agree["ids_once"] and agree["ray_data_agrees"] and agree["predict_agrees"] else 1


def _existing(folder: str) -> tuple[int, int]:
    """The rows and bytes of a table generated earlier."""
    import pyarrow.dataset as ds

    size = sum(p.stat().st_size for p in Path(folder).glob("*.parquet"))
    return ds.dataset(folder, format="parquet").count_rows(), size


if __name__ == "__main__":
    sys.exit(main())
