"""``score-pipeline`` at scale as a user runs it, on the running local stack: a generated table
scored through the command line and through the ``score-pipeline/local`` deployment with the
registry's production model, each output checked against the input and the served model.

Start the stack and train the demo model first (``./deployments/demo.sh``), then, with
``deployments/env.sh`` sourced::

    python -m bench.score_stack --gib 1 --table /data/scoring-table

It generates ``--table`` (digits-like rows keyed by ``id``, with whole pixel values as the
demo's data has them: ``bench.score.make_table``) unless it is there already, then scores it
twice, into ``scores/<run key>`` under the stack's storage:

- ``cli``: ``python -m ringflow.flows.score_pipeline`` in a process of its own (reporting to
  the stack's Prefect server, on its Ray head, as ``env.sh`` sets up);
- ``deployment``: a run of ``score-pipeline/local`` created through Prefect's API and
  executed by the stack's process worker.

Each output must hold every input ``id`` exactly once (the manifest's prediction files read
whole), and for ``--sample`` rows chosen at random its class and probabilities must equal
what the served ``/predict`` answers (``RINGFLOW_SERVE_PORT``) for the same pixels. It prints
a table, then one JSON line whose first keys are ``rows``, ``ids_once`` and
``predict_agrees`` (both outputs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np

from bench import headline_json
from bench.score import BYTES_PER_ROW, PIXELS, make_table, predictions

HEADLINE = ("rows", "ids_once", "predict_agrees")
_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def _table(folder: str, gib: float) -> tuple[int, int]:
    """The table's rows and bytes, generated first where ``folder`` holds none."""
    import pyarrow.dataset as ds

    if not os.path.isdir(folder) or not os.listdir(folder):
        make_table(folder, max(1, round(gib * (1 << 30) / BYTES_PER_ROW)), integers=True)
    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder))]
    return ds.dataset(files, format="parquet").count_rows(), sum(map(os.path.getsize, files))


def _parameters(table: str, run_key: str) -> dict[str, Any]:
    return {"input_url": table, "run_key": run_key, "key_columns": ["id"]}


def score_cli(table: str, run_key: str, storage: str) -> dict[str, Any]:
    """The command line's run: its result (the last line it prints) and seconds."""
    args = [sys.executable, "-m", "ringflow.flows.score_pipeline"]
    for name, value in _parameters(table, run_key).items():
        flag = f"--{name.replace('_', '-')}"
        args += [flag, ",".join(value) if isinstance(value, list) else value]
    started = time.perf_counter()
    done = subprocess.run([*args, "--storage-url", storage], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"score_pipeline exited {done.returncode}: {done.stderr[-2000:]}")
    return {"result": json.loads(done.stdout.strip().splitlines()[-1]), "seconds": seconds}


def score_deployment(table: str, run_key: str, api: str) -> dict[str, Any]:
    """A run of ``score-pipeline/local`` on the stack's worker: its result and seconds."""
    import httpx

    with httpx.Client(base_url=api, timeout=30, trust_env=False) as http:
        deployment = http.get("/deployments/name/score-pipeline/local").raise_for_status().json()
        started = time.perf_counter()
        run = http.post(
            f"/deployments/{deployment['id']}/create_flow_run",
            json={"parameters": _parameters(table, run_key)},
        )
        run_id = run.raise_for_status().json()["id"]
        while (state := http.get(f"/flow_runs/{run_id}").json()["state"])["type"] not in _FINAL:
            time.sleep(2)
        seconds = time.perf_counter() - started
    if state["type"] != "COMPLETED":
        raise SystemExit(f"score-pipeline/local run {run_id} ended {state['name']}")
    result = subprocess.run(
        [sys.executable, "-m", "ringflow.flows.result", run_id, "--json"],
        capture_output=True,
        text=True,
    )
    return {"result": json.loads(result.stdout.strip().splitlines()[-1]), "seconds": seconds}


def _served(port: int, pixels: np.ndarray) -> list[dict[str, Any]]:
    import httpx

    answers = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, trust_env=False) as http:
        for start in range(0, len(pixels), 250):
            chunk = pixels[start : start + 250].tolist()
            reply = http.post("/predict", json={"instances": chunk}).raise_for_status()
            answers += reply.json()["predictions"]
    return answers


def check(output: str, table: str, rows: int, sample: int, port: int) -> dict[str, Any]:
    """Every id of the table once in ``output``; ``sample`` rows as ``/predict`` answers."""
    import pyarrow.dataset as ds

    ours = predictions(output, ("id", "digit", "probabilities"))
    ids = ours["id"].to_numpy()
    ids_once = len(ids) == rows and bool(np.array_equal(np.sort(ids), np.arange(rows)))
    rng = np.random.default_rng(0)
    picked = np.sort(rng.choice(rows, size=min(sample, rows), replace=False))
    source = ds.dataset(table, format="parquet").to_table(
        columns=["id"] + [f"p{i}" for i in range(PIXELS)]
    )
    where = np.empty(rows, dtype=np.int64)
    where[source["id"].to_numpy()] = np.arange(rows)
    taken = source.take(where[picked])
    pixels = np.stack([taken[f"p{i}"].to_numpy() for i in range(PIXELS)], axis=1)
    served = _served(port, pixels)
    position = np.empty(rows, dtype=np.int64)
    position[ids] = np.arange(len(ids))
    mine = ours.take(position[picked])
    digits_equal = mine["digit"].to_pylist() == [p["digit"] for p in served]
    probabilities = np.array(mine["probabilities"].to_pylist())
    gap = float(np.abs(probabilities - np.array([p["probabilities"] for p in served])).max())
    return {
        "ids_once": ids_once,
        "predict_agrees": digits_equal and gap <= 1e-6,
        "probabilities_max_diff": gap,
        "sample": len(picked),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of a generated table")
    parser.add_argument("--table", required=True, help="the table's folder (kept)")
    parser.add_argument("--sample", type=int, default=1000, help="rows compared with /predict")
    args = parser.parse_args(argv)
    missing = [
        v
        for v in ("RINGFLOW_STATE", "PREFECT_API_URL", "RINGFLOW_SERVE_PORT")
        if v not in os.environ
    ]
    if missing:
        parser.error(f"{', '.join(missing)} not set: source deployments/env.sh first")
    storage = os.path.join(os.environ["RINGFLOW_STATE"], "storage")
    port = int(os.environ["RINGFLOW_SERVE_PORT"])
    table = os.path.abspath(args.table)
    rows, size = _table(table, args.gib)
    tag = uuid.uuid4().hex[:8]
    runs = {
        "cli": score_cli(table, f"stack-cli-{tag}", storage),
        "deployment": score_deployment(
            table, f"stack-deployment-{tag}", os.environ["PREFECT_API_URL"]
        ),
    }
    checked = {
        way: check(run["result"]["output_url"], table, rows, args.sample, port)
        for way, run in runs.items()
    }
    print(
        f"{'way':<11} {'rows':>10} {'seconds':>8} {'rows/s':>8} {'ids once':>9} {'= /predict':>10}"
    )
    for way, run in runs.items():
        seen = checked[way]
        print(
            f"{way:<11} {rows:>10,} {run['seconds']:>8.1f} {rows / run['seconds']:>8,.0f} "
            f"{str(seen['ids_once']):>9} {str(seen['predict_agrees']):>10}"
        )
    figures = {
        "rows": rows,
        "ids_once": all(c["ids_once"] for c in checked.values()),
        "predict_agrees": all(c["predict_agrees"] for c in checked.values()),
        "gib": round(size / (1 << 30), 3),
        "sample": args.sample,
        **{f"{way}_rows_per_s": round(rows / run["seconds"]) for way, run in runs.items()},
        **{f"{way}_engine": run["result"].get("engine") for way, run in runs.items()},
        "probabilities_max_diff": max(c["probabilities_max_diff"] for c in checked.values()),
    }
    print(headline_json(figures, HEADLINE))
    return 0 if figures["ids_once"] and figures["predict_agrees"] else 1


if __name__ == "__main__":
    sys.exit(main())
