"""bench/overlap.py runs on CPU (gloo): each variant plays the same backward pass, the
collectives' sums are checked, and its last line's JSON holds the ratios the GPU runs are
judged by."""

from __future__ import annotations

import json

from bench import overlap


def test_the_overlap_benchmark_runs_on_cpu(capsys):
    argv = ["--procs", "2", "--buckets", "3", "--bucket-mb", "0.25", "--matmul", "64"]
    summary = overlap.main([*argv, "--rounds", "1", "--skew-ms", "0,1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == summary
    assert set(summary["ring_vs_native"]["2"]) == {"0", "1"}
    assert all(ratio > 0 for by in summary["ring_vs_native"]["2"].values() for ratio in by.values())
    variants = {(row["skew_ms"], row["variant"]) for row in summary["rows"]}
    assert variants == {(s, v) for s in (0.0, 1.0) for v in ("compute", "native", "ring")}
    # Rank 1 starts a millisecond late: no variant's step is shorter than that.
    assert all(row["step_ms"] >= 1.0 for row in summary["rows"] if row["skew_ms"] == 1.0)
