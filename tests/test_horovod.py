"""Horovod's PyTorch API on ringflow's ring (``ringflow.horovod``): a script written for
``horovod.torch`` runs with one changed import, started by ``ringflow.horovod.run`` on Ray.

The training script below is shaped as Horovod's own examples (``examples/pytorch/
pytorch_mnist.py``): ``hvd.init()``, each rank a shard of the data, the optimizer wrapped in
``hvd.DistributedOptimizer``, parameters and optimizer state broadcast from rank 0. Two ranks
end with the weights one process gets on the whole batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ringflow.horovod as hvd
from tests.support.fitting import relative_difference

SAMPLES, BATCH, STEPS, FEATURES = 64, 16, 8, 6


def collectives() -> dict:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    mine = torch.arange(4, dtype=torch.float32) + 10 * r
    handle = hvd.allreduce_async(mine, op=hvd.Sum)
    in_place = mine.clone()
    hvd.allreduce_(in_place)
    rows = torch.full((r + 1, 2), float(r))  # ranks give different numbers of rows
    # rank r sends rows [r] * (i + 1) to rank i: rank i gets i + 1 rows from each rank
    exchanged, received_splits = hvd.alltoall(torch.full((3, 1), float(r)), splits=[1, 2])
    return {
        "rank": r,
        "size": n,
        "local": (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()),
        "average": hvd.allreduce(mine).tolist(),
        "sum": hvd.synchronize(handle).tolist(),
        "untouched": mine.tolist(),
        "in_place": in_place.tolist(),
        "broadcast": hvd.broadcast(mine, root_rank=1).tolist(),
        "gathered": hvd.allgather(rows).tolist(),
        "object": hvd.broadcast_object({"from": r}, root_rank=1),
        "objects": hvd.allgather_object(("rank", r)),
        "alltoall": exchanged.tolist(),
        "received_splits": received_splits.tolist(),
        "alltoall_dtype": received_splits.dtype,
        "scattered": hvd.reducescatter(torch.arange(3.0) + r, op=hvd.Sum).tolist(),
    }


@pytest.mark.ray
def test_the_collectives_give_what_horovods_give(ray_session):
    results = hvd.run(collectives, np=2)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["size"] == 2
        assert r["average"] == [5.0, 6.0, 7.0, 8.0]
        assert r["sum"] == [10.0, 12.0, 14.0, 16.0]
        assert r["in_place"] == r["average"]
        assert r["broadcast"] == [10.0, 11.0, 12.0, 13.0]
        assert r["gathered"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert r["object"] == {"from": 1}
        assert r["objects"] == [("rank", 0), ("rank", 1)]
    assert [r["alltoall"] for r in results] == [[[0.0], [1.0]], [[0.0], [0.0], [1.0], [1.0]]]
    assert [r["received_splits"] for r in results] == [[1, 1], [2, 2]]  # Horovod's, as int32
    assert {r["alltoall_dtype"] for r in results} == {torch.int32}
    assert [r["scattered"] for r in results] == [[1.0, 3.0], [5.0]]  # 2 rows, then 1
    assert [r["untouched"] for r in results] == [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]]
    assert [r["local"] for r in results] == [(0, 2, 0, 1), (1, 2, 0, 1)]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return x, (x[:, :2].sum(1) > 0).long()


def train(backward_passes_per_step: int = 1, compression=None) -> dict[str, torch.Tensor]:
    """Horovod's example, shortened: each rank trains on its shard of every batch."""
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(1 + hvd.rank())  # different on each rank: the broadcast makes them equal
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        backward_passes_per_step=backward_passes_per_step,
        compression=compression or hvd.Compression.none,
    )
    x, y = _data()
    passes = backward_passes_per_step
    for step in range(STEPS):
        batch = slice(step * BATCH % SAMPLES, step * BATCH % SAMPLES + BATCH)
        xs, ys = x[batch], y[batch]
        share = slice(hvd.rank() * BATCH // hvd.size(), (hvd.rank() + 1) * BATCH // hvd.size())
        xs, ys = xs[share], ys[share]
        optimizer.zero_grad()
        for part in range(passes):  # the share in `passes` pieces, each its own backward
            piece = slice(part * len(ys) // passes, (part + 1) * len(ys) // passes)
            loss = nn.functional.cross_entropy(model(xs[piece]), ys[piece]) / passes
            loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _one_process(backward_passes_per_step: int = 1) -> dict[str, torch.Tensor]:
    """The same script without the launcher: one rank of one, on the whole batch."""
    try:
        return train(backward_passes_per_step)
    finally:
        hvd.shutdown()


TRAININGS = {
    "fp16": {"compression": hvd.Compression.fp16},
    "1 pass": {"backward_passes_per_step": 1},
    "2 passes": {"backward_passes_per_step": 2},
}
"""The ways the tests below train on 2 ranks, by name: ``train``'s keyword arguments."""


def trainings() -> dict[str, dict[str, torch.Tensor]]:
    """Each of :data:`TRAININGS` in turn, each on a ring of its own (``hvd.init`` to
    ``hvd.shutdown``): the weights each ended with."""
    ended = {}
    for name, kwargs in TRAININGS.items():
        ended[name] = train(**kwargs)
        hvd.shutdown()
    return ended


@pytest.fixture(scope="module")
def two_ranks(ray_session) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Each rank's :func:`trainings`, from one launch of 2 ranks."""
    return hvd.run(trainings, np=2, cpus_per_worker=0.5)


@pytest.mark.ray
@pytest.mark.parametrize("passes", [1, 2])
def test_two_ranks_end_with_the_weights_one_process_gets(passes, two_ranks):
    one = _one_process(passes)
    two = [ended["1 pass" if passes == 1 else "2 passes"] for ended in two_ranks]
    assert relative_difference(two[0], two[1]) == 0.0  # every rank steps on the same average
    assert relative_difference(two[0], one) < 1e-6


@pytest.mark.ray
def test_fp16_compression_trains_close_to_float32(two_ranks):
    one = _one_process()
    two = [ended["fp16"] for ended in two_ranks]
    assert 0 < relative_difference(two[0], one) < 1e-2


def fails_on_rank_one() -> None:
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one's data is bad")
    hvd.allreduce(torch.ones(2))  # rank 0 waits for rank 1 here


@pytest.mark.ray
def test_a_rank_that_raises_fails_the_run_naming_it(ray_session):
    with pytest.raises(hvd.RankFailedError, match="rank 1 raised ValueError: rank one's data"):
        hvd.run(fails_on_rank_one, np=2, cpus_per_worker=0.5)


def test_what_horovod_has_and_ringflow_does_not_is_refused_by_name():
    with pytest.raises(hvd.HorovodError, match="Adasum reduction is not supported"):
        hvd.Adasum  # noqa: B018
    with pytest.raises(hvd.HorovodError, match="MPI communicators are refused"):
        hvd.ProcessSet(object())
    with pytest.raises(hvd.HorovodError, match="not initialized: call hvd.init"):
        hvd.rank()
    with pytest.raises(hvd.HorovodError, match="MPI is not supported"):
        hvd.init(comm=[0, 1])


SCRIPT = Path(__file__).parent / "horovod_scripts" / "average.py"


def _python(
    *args: str, ray: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root (with ``env`` added to this process's
    environment), on the Ray cluster at ``ray`` (``RAY_ADDRESS``), else on a private Ray of
    its own."""
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(env or {})}
    if ray is not None:
        env["RAY_ADDRESS"] = ray
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).parents[1],
    )


def _ringflow_run(ray: str, *args: str) -> subprocess.CompletedProcess:
    """``ringflow-run ARGS``, its ranks on the Ray cluster at ``ray``."""
    return _python("-m", "ringflow.horovod.runner", *args, ray=ray)


@pytest.mark.integration
def test_ringflow_run_starts_a_script_on_its_ranks_and_prefixes_their_lines(launcher_ray):
    done = _ringflow_run(
        launcher_ray, "-np", "2", "--cpus-per-worker", "0.5", sys.executable, str(SCRIPT)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "[0] rank 0 of 2: mean 0.5" in lines
    assert "[1] rank 1 of 2: mean 0.5" in lines


@pytest.mark.integration
def test_ringflow_run_exits_with_the_first_failing_ranks_status(launcher_ray):
    done = _ringflow_run(
        launcher_ray,
        "-np",
        "2",
        "--cpus-per-worker",
        "0.5",
        sys.executable,
        str(SCRIPT),
        "--fail-rank",
        "1",
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "[1] giving up" in done.stdout.splitlines()
    assert "rank 1 exited with status 3" in done.stderr


def test_ringflow_run_refuses_what_it_does_not_take_yet_in_one_line(capsys):
    from ringflow.horovod.runner import main

    assert main(["-np", "2", "--hosts", "a:1,b:1", "python", "x.py"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("error: ringflow-run does not take --hosts: host lists are not")
    assert said.count("\n") == 1
    assert main(["-np", "2", "--min-np", "3", "python", "x.py"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("error: an elastic run needs 1 <= min_np (3) <= np (2)")
    assert said.count("\n") == 1


MNIST = Path(__file__).parent / "horovod_examples" / "pytorch_mnist.py"
MNIST_ARGS = ("--epochs", "1", "--samples", "512", "--batch-size", "64", "--log-interval", "2")


@pytest.mark.integration
def test_horovods_mnist_example_runs_under_ringflow_run_with_its_imports_changed(launcher_ray):
    done = _ringflow_run(
        launcher_ray,
        "-np",
        "2",
        "--cpus-per-worker",
        "0.5",
        sys.executable,
        str(MNIST),
        *MNIST_ARGS,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for rank in (0, 1):  # each rank trains on its half: 256 samples, 4 batches
        assert f"[{rank}] Train Epoch: 1 [128/256 (50%)]" in " ".join(lines), lines
    assert any(line.startswith("[0] Test set: Average loss:") for line in lines), lines
    assert not any(line.startswith("[1] Test set") for line in lines)


SYNTHETIC = Path(__file__).parent / "horovod_examples" / "pytorch_synthetic_benchmark.py"


@pytest.mark.integration
def test_horovods_synthetic_benchmark_runs_under_ringflow_run_with_its_imports_changed(
    launcher_ray,
):
    done = _ringflow_run(
        launcher_ray,
        *("-np", "2", "--cpus-per-worker", "0.5", sys.executable, str(SYNTHETIC)),
        *("--no-cuda", "--model", "resnet18", "--batch-size", "2", "--num-warmup-batches", "1"),
        *("--num-batches-per-iter", "2", "--num-iters", "2"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "[0] Number of CPUs: 2" in lines
    assert any(line.startswith("[0] Iter #1: ") for line in lines), lines
    assert any(line.startswith("[0] Total img/sec on 2 CPU(s): ") for line in lines), lines
    assert not any(line.startswith("[1] ") for line in lines)  # it logs on rank 0 only


@pytest.mark.integration
def test_horovods_mnist_example_runs_through_its_own_horovod_run(launcher_ray):
    """``--num-proc 2``: the script calls ``horovod.run(main, ..., hosts=None,
    use_gloo=None, use_mpi=None)`` itself."""
    done = _python(str(MNIST), "--num-proc", "2", *MNIST_ARGS, ray=launcher_ray)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Running training through horovod.run" in done.stdout


def test_horovod_run_refuses_what_it_cannot_honour_by_name():
    with pytest.raises(hvd.HorovodError, match="does not take use_mpi=True: MPI"):
        hvd.run(print, np=2, use_mpi=True)
    with pytest.raises(hvd.HorovodError, match="hosts='a:2'"):
        hvd.run(print, np=2, hosts="a:2")


@pytest.mark.integration
def test_the_synthetic_benchmark_against_ddp_prints_its_table_and_ratio():
    done = _python(
        *("-m", "bench.horovod_synthetic", "--image-size", "32", "--batch-size", "2"),
        *("--steps", "2", "--warmup", "1", "--repeats", "1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[1].split() == ["runner", "images/s"]
    assert [line.split()[0] for line in lines[2:4]] == ["ringflow.horovod", "torch"]
    summary = json.loads(lines[-1])
    assert summary["hvd_images_per_s"] > 0
    assert summary["ddp_images_per_s"] > 0
    hvd_rate, ddp_rate = summary["hvd_images_per_s"], summary["ddp_images_per_s"]
    ratio = hvd_rate / ddp_rate
    # The ratio is of the unrounded rates, to 0.001; the rates are printed to 0.01.
    slack = 1e-3 + ratio * 0.005 * (1 / hvd_rate + 1 / ddp_rate)
    assert summary["hvd_vs_ddp"] == pytest.approx(ratio, abs=slack)


@pytest.mark.integration
def test_the_horovod_train_flow_fails_once_with_the_scripts_status_and_no_retry(
    tmp_path, launcher_ray, prefect_api
):
    """From the command line: a rank's error fails the flow run at once, naming the script
    and its status, without a second start."""
    done = _python(
        *("-m", "ringflow.flows.horovod_train", "--script", str(SCRIPT), "--np", "2"),
        *("--args", '["--fail-rank", "1"]', "--cpus-per-worker", "0.5"),
        *("--storage-url", str(tmp_path)),
        ray=launcher_ray,
        env={"PREFECT_API_URL": prefect_api},
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stderr.strip().splitlines()
    failed = f"error: the run ended Failed: ScriptFailed: {SCRIPT} exited with status 3"
    assert failed in said, said[-12:]
    assert "[1] giving up" in done.stdout + done.stderr
    assert (done.stdout + done.stderr).count("Beginning flow run") == 1


@pytest.mark.integration
def test_the_timeline_holds_every_ranks_collectives_named_after_the_gradients(
    tmp_path, launcher_ray
):
    trace = tmp_path / "timeline.json"
    script = Path(__file__).parent / "horovod_scripts" / "elastic_linear.py"
    done = _ringflow_run(
        launcher_ray,
        *("-np", "2", "--cpus-per-worker", "0.5", "--timeline-filename", str(trace)),
        *(sys.executable, str(script), "--out", str(tmp_path / "w.pt"), "--epochs", "1"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"ringflow-run: the timeline of 2 ranks is in {trace}" in done.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert [p.name for p in tmp_path.iterdir() if ".rank-" in p.name] == []  # merged
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"rank 0", "rank 1"}
    spans = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):  # 8 steps, the weight and bias fused into one bucket each
        reduced = [e["name"] for e in spans if e["pid"] == rank and e["cat"] == "allreduce"]
        assert reduced == ["allreduce.bias, weight"] * 8  # Horovod's tensor names
    assert {e["cat"] for e in spans} >= {"allreduce", "broadcast", "negotiate"}
    assert all(e["dur"] >= 0 for e in spans)
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)


def recorded(directory: str) -> None:
    """Two recordings, each started and stopped by every rank at runtime; each rank asks for
    a file of its own (rank 0's is written, as Horovod's)."""
    hvd.init()
    me = hvd.rank()
    hvd.allreduce(torch.ones(2), name="before")
    hvd.start_timeline(f"{directory}/first-{me}.json", mark_cycles=True)
    hvd.allreduce(torch.ones(2), name="grad")
    hvd.broadcast(torch.ones(2), root_rank=1, name="weights")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(2), name="after")
    hvd.start_timeline(f"{directory}/second-{me}.json")
    hvd.allgather(torch.ones(1), name="rows")
    hvd.stop_timeline()
    hvd.stop_timeline()  # nothing recording: nothing to do


def test_start_and_stop_timeline_write_every_ranks_collectives_to_rank_0s_file(
    ray_session, tmp_path
):
    with pytest.raises(ValueError, match="Horovod has not been initialized"):
        hvd.start_timeline(str(tmp_path / "never.json"))
    hvd.run(recorded, args=(str(tmp_path),), np=2, cpus_per_worker=0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first-0.json", "second-0.json"]
    first = json.loads((tmp_path / "first-0.json").read_text())["traceEvents"]
    second = json.loads((tmp_path / "second-0.json").read_text())["traceEvents"]
    for events in (first, second):
        meta = [e for e in events if e["ph"] == "M"]
        assert [(e["pid"], e["args"]["name"]) for e in meta] == [(0, "rank 0"), (1, "rank 1")]
        assert all(e["args"]["start_time_since_epoch_in_micros"] > 0 for e in meta)
    for rank in (0, 1):
        spans = [e["name"] for e in first if e["ph"] == "X" and e["pid"] == rank]
        assert spans == [
            "NEGOTIATE_ALLREDUCE",
            "allreduce.grad",
            "NEGOTIATE_BROADCAST",
            "broadcast.weights",
        ]
        cycles = [e for e in first if e["name"] == "CYCLE_START" and e["pid"] == rank]
        assert len(cycles) == 2  # mark_cycles: one mark per negotiation
        spans = [e["name"] for e in second if e["ph"] == "X" and e["pid"] == rank]
        assert "allgather.rows" in spans
        assert "NEGOTIATE_ALLGATHER" in spans
    assert not any(e["name"] == "CYCLE_START" for e in second)


@pytest.mark.integration
def test_the_horovod_train_flow_runs_a_function_and_resumes_it_as_the_script_form(
    tmp_path, launcher_ray, prefect_api
):
    """The function form (``--function package.module:train --kwargs JSON``) from the command
    line, on a cluster whose nodes have the function's module installed: 6 steps,
    then the same run key asked for 10 resumes at step 6 and ends with the weights of the
    script form trained 10 steps straight, bit for bit."""
    from ringflow.storage import CheckpointStore

    scripts = Path(__file__).parent / "horovod_scripts"
    flow = ("-m", "ringflow.flows.horovod_train", "--np", "2", "--cpus-per-worker", "0.5")

    def function_run(steps: int) -> subprocess.CompletedProcess:
        kwargs = json.dumps({"steps": steps, "checkpoint_every": 3})
        return _python(
            *(*flow, "--function", "linear_training:train", "--kwargs", kwargs),
            *("--storage-url", str(tmp_path / "function"), "--run-key", "k"),
            ray=launcher_ray,
            env={"PYTHONPATH": str(scripts), "PREFECT_API_URL": prefect_api},
        )

    first = function_run(6)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert json.loads(first.stdout.strip().splitlines()[-1])["step"] == 6
    again = function_run(10)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    result = json.loads(again.stdout.strip().splitlines()[-1])
    assert (result["resumed_from_step"], result["step"]) == (6, 10)
    assert "rank 1 of 2: starting at step 6" in again.stdout + again.stderr
    script = _python(
        *(*flow, "--script", str(scripts / "checkpointed.py")),
        *("--args", '["--steps", "10", "--checkpoint-every", "3"]'),
        *("--storage-url", str(tmp_path / "script"), "--run-key", "k"),
        ray=launcher_ray,
        env={"PREFECT_API_URL": prefect_api},
    )
    assert script.returncode == 0, script.stdout[-3000:] + script.stderr[-3000:]
    ended = [
        CheckpointStore(str(tmp_path / where / "checkpoints")).load_latest("k")
        for where in ("function", "script")
    ]
    assert [e.checkpoint.step for e in ended] == [10, 10]
    for shard in ("model", "optimizer"):
        for name, tensor in ended[1].shards[shard].items():
            assert torch.equal(ended[0].shards[shard][name], tensor), (shard, name)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (("--function", "linear_training:train", "--script", "x.py"), "give a script or a fun"),
        ((), "give a script or a function"),
        (("--function", "no_such_module:train"), "cannot import 'no_such_module'"),
        (("--function", "json:no_such_function"), "json has no function 'no_such_function'"),
        (("--function", "json:dumps", "--args", '["--x"]'), "args are a script's"),
    ],
)
def test_the_horovod_train_flow_refuses_a_program_it_cannot_run_in_one_line(given, said):
    done = _python("-m", "ringflow.flows.horovod_train", *given)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert said in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
