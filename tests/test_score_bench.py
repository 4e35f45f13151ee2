"""``bench.score`` on a tiny table: the library path, the plain Ray Data script and ``/predict``
score the same rows, agree on every compared class, and the last line holds the figures
docs/benchmarks.md reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.score import HEADLINE

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.integration


def test_the_scoring_benchmark_compares_ours_ray_data_and_predict_on_one_table():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private Ray
    done = subprocess.run(
        [sys.executable, "-m", "bench.score", "--rows", "3000", "--block-rows", "1000"]
        + ["--batch-size", "500", "--predict-rows", "500", "--sample", "200"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(summary)[: len(HEADLINE)] == list(HEADLINE)
    assert all(summary[key] > 0 for key in HEADLINE), summary
    assert (summary["rows"], summary["ray_data_rows"], summary["predict_rows"]) == (3000, 3000, 500)
    assert summary["ids_once"]  # every row scored once by the library path
    assert summary["ray_data_agrees"]
    assert summary["predict_agrees"]
    assert summary["engine"] == "ray"
