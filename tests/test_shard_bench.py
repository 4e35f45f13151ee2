"""bench/shard.py runs on CPU (gloo, the tiny GPT, 2 workers): every shard mode has its row
(``parameters`` measured once ``TrainConfig`` takes it, else marked not built), ZeRO-1 and
ZeRO-2 hold less state per worker than ``shard="none"``, FSDP2 has its row or a note saying
why not, and the last line's JSON is the summary returned."""

from __future__ import annotations

import json

import pytest

from bench import shard


@pytest.mark.integration
def test_the_shard_benchmark_runs_on_cpu(ray_session, capsys):
    argv = "--model-size tiny --workers 2 --steps 2 --warmup-steps 1 --no-fresh-workers"
    summary = shard.main(argv.split())
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(summary))
    assert list(summary)[: len(shard.HEADLINE)] == list(shard.HEADLINE)
    table = "\n".join(out[:-1])
    assert "state MiB" in table
    assert "fsdp2/ours" in table

    parameters = shard._built("parameters")
    for mode in shard.MODES:
        status = summary["modes"][mode]
        assert status == "measured" or (mode == "parameters" and status.startswith("not built"))
    rows = {(r["runner"], r["mode"]): r for r in summary["rows"]}
    assert {("ours", m) for m in shard.MODES} <= rows.keys()
    assert rows["ours", "parameters"]["status"] == (
        "measured" if parameters is None else "not built"
    )
    for mode in ("none", "optimizer", "gradients"):
        row = rows["ours", mode]
        assert min(row["state_bytes"], row["peak_rss_bytes"], row["step_ms"]) > 0
        assert len(row["per_worker"]) == 2
    state, optimizer = summary["state_vs_none"], summary["optimizer_state_vs_none"]
    for mode in ("optimizer", "gradients"):
        assert 0 < state[mode][2] < 1, mode
        assert 0 < optimizer[mode][2] <= 0.55, mode  # about half of AdamW's state each
    assert state["gradients"][2] < state["optimizer"][2]  # ZeRO-2 drops half the gradients too
    assert state["none"][2] == 1.0

    fsdp2 = rows["fsdp2", "fsdp2"]
    if fsdp2["status"] == "measured":
        assert 0 < state["fsdp2"][2] < 1
        assert all(summary["speed_vs_fsdp2"][m][2] > 0 for m in ("none", "optimizer", "gradients"))
    else:
        assert any(note.startswith("fsdp2") for note in summary["notes"])
