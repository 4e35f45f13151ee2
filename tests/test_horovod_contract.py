"""What Horovod's ``horovod.torch`` answers where a script relies on it, on 2 ranks: its build
queries, the min, max and product reductions, its error types, ``alltoall``'s received
splits, the async and grouped collectives with their handles, gradients through the
collectives, ``HOROVOD_*`` from the launcher, and rounds of ``init``/``shutdown``.

Each distributed check runs on 2 ranks (``hvd.run``, or ``ringflow-run`` for a script) and
returns what it saw; the test asserts on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ringflow.horovod as hvd

pytestmark = pytest.mark.integration
TWO = {"np": 2, "cpus_per_worker": 0.5}


def test_build_queries_answer_for_ringflows_ring():
    assert hvd.gloo_built() is True
    assert hvd.gloo_enabled() is True
    assert (hvd.mpi_built(), hvd.mpi_enabled(), hvd.ccl_built()) == (False, False, False)
    assert (hvd.ddl_built(), hvd.rocm_built()) == (False, False)
    assert hvd.cuda_built() == torch.backends.cuda.is_built()
    if torch.cuda.is_available():
        major, minor, patch = torch.cuda.nccl.version()[:3]
        assert hvd.nccl_built() == major * 10000 + minor * 100 + patch
    else:
        assert hvd.nccl_built() == 0  # Horovod's answer where NCCL was not built
    with pytest.raises(ValueError, match="MPI is not enabled"):
        hvd.mpi_threads_supported()


def elementwise() -> dict:
    hvd.init()
    me = hvd.rank()
    seen = {}
    for dtype in (torch.int8, torch.int32, torch.int64, torch.float16, torch.float32):
        mine = torch.tensor([[1, -2], [3, 4]], dtype=dtype) * (me + 2)  # rank 0: x2, rank 1: x3
        seen[str(dtype)] = {
            op: hvd.allreduce(mine, op=getattr(hvd, op)).tolist()
            for op in ("Min", "Max", "Product")
        }
        seen[f"{dtype} dtype"] = hvd.allreduce(mine, op=hvd.Product).dtype == dtype
    in_place = torch.tensor([float(me), 5.0])
    hvd.allreduce_(in_place, op=hvd.Max, postscale_factor=2.0)
    seen["in place, scaled"] = in_place.tolist()
    return seen


def test_min_max_and_product_reduce_every_ranks_tensor_elementwise(ray_session):
    for seen in hvd.run(elementwise, **TWO):
        for dtype in ("torch.int8", "torch.int32", "torch.int64", "torch.float16", "torch.float32"):
            assert seen[dtype]["Min"] == [[2, -6], [6, 8]], dtype
            assert seen[dtype]["Max"] == [[3, -4], [9, 12]], dtype
            assert seen[dtype]["Product"] == [[6, 24], [54, 96]], dtype
            assert seen[f"{dtype} dtype"], dtype
        assert seen["in place, scaled"] == [2.0, 10.0]


def refusals() -> dict:
    """Horovod's error types, raised on every rank so that the ranks stay in step."""
    hvd.init()
    me, seen = hvd.rank(), {}
    cases = {
        "bad splits, every rank": lambda: hvd.alltoall(
            torch.zeros(3), torch.ones(2, dtype=torch.int32)
        ),
        "float splits": lambda: hvd.alltoall(torch.zeros(2), torch.ones(2)),
        "unequal rows": lambda: hvd.alltoall(torch.zeros(3)),
        "bad splits on rank 1": lambda: hvd.alltoall(torch.zeros(2), [1, 1] if me == 0 else [2, 1]),
        "scalar reducescatter": lambda: hvd.reducescatter(torch.tensor(1.0)),
        "product while joined": lambda: hvd.allreduce(torch.ones(2), op=hvd.Product),
    }
    for case, call in cases.items():
        if case == "product while joined" and me == 0:
            hvd.join()
            continue
        try:
            call()
            seen[case] = "no error"
        except (ValueError, RuntimeError) as err:
            seen[case] = f"{type(err).__name__}: {err}"
    if me == 1:
        hvd.join()
    seen["after them"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
    model = torch.nn.Linear(2, 1)
    for case, named in {
        "duplicate names": [("w", model.weight), ("w", model.bias)],
        "missing names": [("weight", model.weight)],
    }.items():
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named)
            seen[case] = "no error"
        except ValueError as err:
            seen[case] = f"ValueError: {err}"
    return seen


def test_wrong_arguments_raise_horovods_errors_on_every_rank_and_the_ring_goes_on(ray_session):
    first, second = hvd.run(refusals, **TWO)
    for seen in (first, second):
        assert seen["bad splits, every rank"].startswith("ValueError: alltoall: splits [1, 1]")
        assert seen["float splits"].startswith("ValueError: alltoall: splits must be a tensor of")
        assert seen["unequal rows"].startswith("ValueError: alltoall: 3 rows do not split into 2")
        assert seen["scalar reducescatter"].startswith("ValueError: reducescatter takes a tensor")
        assert seen["after them"] == [2.0, 2.0]
        assert seen["duplicate names"] == "ValueError: named_parameters has a name twice: w"
        assert seen["missing names"].startswith("ValueError: named_parameters lacks 1 of the")
    assert first["bad splits on rank 1"].startswith("HorovodError: alltoall: rank 1 refused")
    assert second["bad splits on rank 1"].startswith("ValueError: alltoall: splits [2, 1] must")
    assert second["product while joined"].startswith("HorovodError: allreduce product cannot run")


def async_and_grouped() -> dict:
    hvd.init()
    me, n = hvd.rank(), hvd.size()
    rows = torch.arange(4.0).reshape(4, 1) + 10 * me  # rank 0: 0..3, rank 1: 10..13
    handles = {
        "allgather": hvd.allgather_async(torch.full((me + 1, 2), float(me)), name="g"),
        "broadcast": hvd.broadcast_async(torch.full((2,), float(me)), root_rank=1),
        "alltoall": hvd.alltoall_async(rows, splits=[1, 3]),
        "reducescatter": hvd.reducescatter_async(rows, op=hvd.Sum),
        "grouped allreduce": hvd.grouped_allreduce_async([rows, rows[:2]], op=hvd.Sum),
        "grouped allgather": hvd.grouped_allgather_async([rows[:1], rows[:2]]),
        "grouped reducescatter": hvd.grouped_reducescatter_async([rows, rows[:2]]),
    }
    try:
        hvd.allgather_async(torch.zeros(1), name="g")
        duplicate = "no error"
    except ValueError as err:
        duplicate = str(err)
    seen = {kind: _listed(hvd.synchronize(h)) for kind, h in handles.items()}
    seen["polled"] = all(hvd.poll(h) for h in handles.values())
    seen["duplicate"] = duplicate
    in_place = [rows.clone(), rows[:2].clone()]
    hvd.grouped_allreduce_(in_place, op=hvd.Max)
    seen["grouped in place"] = _listed(in_place)
    seen["grouped"] = _listed(hvd.grouped_allreduce([rows, rows[:1]], op=hvd.Average))
    seen["size"] = n
    return seen


def _listed(result):
    if isinstance(result, (list, tuple)):
        return [_listed(r) for r in result]
    return result.tolist()


def test_async_and_grouped_collectives_give_horovods_results_through_their_handles(ray_session):
    first, second = hvd.run(async_and_grouped, **TWO)
    for seen in (first, second):
        assert seen["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert seen["broadcast"] == [1.0, 1.0]
        assert seen["grouped allreduce"] == [
            [[10.0], [12.0], [14.0], [16.0]],
            [[10.0], [12.0]],
        ]
        assert seen["grouped allgather"] == [[[0.0], [10.0]], [[0.0], [1.0], [10.0], [11.0]]]
        assert seen["grouped in place"] == [[[10.0], [11.0], [12.0], [13.0]], [[10.0], [11.0]]]
        assert seen["grouped"] == [[[5.0], [6.0], [7.0], [8.0]], [[5.0]]]
        assert seen["polled"]
        assert seen["duplicate"] == "allgather 'g': an operation of that name is still in flight"
    # rank 0 sends 1 row to rank 0 and 3 to rank 1: (tensor, received splits), as Horovod's
    assert first["alltoall"] == [[[0.0], [10.0]], [1, 1]]
    assert second["alltoall"] == [[[1.0], [2.0], [3.0], [11.0], [12.0], [13.0]], [3, 3]]
    assert first["reducescatter"] == [[10.0], [12.0]]
    assert second["reducescatter"] == [[14.0], [16.0]]
    assert first["grouped reducescatter"] == [[[5.0], [6.0]], [[5.0]]]
    assert second["grouped reducescatter"] == [[[7.0], [8.0]], [[6.0]]]


def gradients() -> dict:
    """The gradient of each rank's weighted sum of a collective's output, as Horovod's
    autograd gives it (rank r's weights are r + 1 times rank 0's)."""
    hvd.init()
    me = hvd.rank()

    def weighted(out: torch.Tensor) -> torch.Tensor:
        return (out.reshape(-1) * torch.arange(1.0, out.numel() + 1) * (me + 1)).sum()

    cases = {
        "allreduce sum": lambda x: weighted(hvd.allreduce(x, op=hvd.Sum)),
        "allreduce average": lambda x: weighted(hvd.allreduce(x)),
        "allgather": lambda x: weighted(hvd.allgather(x.reshape(2, 2))[2 * me : 2 * me + 2]),
        "broadcast": lambda x: weighted(hvd.broadcast(x, root_rank=0)),
        "alltoall": lambda x: weighted(hvd.alltoall(x, torch.tensor([1, 3], dtype=torch.int32))[0]),
        "reducescatter": lambda x: weighted(hvd.reducescatter(x, op=hvd.Sum)),
    }
    grads = {}
    for case, loss in cases.items():
        x = torch.ones(4, requires_grad=True)
        loss(x).backward()
        grads[case] = x.grad.tolist()
    return grads


def test_gradients_flow_back_through_the_collectives_as_horovods(ray_session):
    first, second = hvd.run(gradients, **TWO)
    for seen, r in ((first, 0), (second, 1)):
        w = [(r + 1) * v for v in (1.0, 2.0, 3.0, 4.0)]
        assert seen["allreduce sum"] == [3.0, 6.0, 9.0, 12.0]  # the sum of both ranks' weights
        assert seen["allreduce average"] == [1.5, 3.0, 4.5, 6.0]
        assert seen["allgather"] == [v / 2 for v in w]  # its own rows of the average
        assert seen["reducescatter"] == [2.0, 4.0, 4.0, 8.0]  # every rank's part, times 2 ranks
    assert first["broadcast"] == [1.5, 3.0, 4.5, 6.0]  # the root: the average of both ranks'
    assert second["broadcast"] == [0.0, 0.0, 0.0, 0.0]
    # rank 0's row 0 went to its own output's row 0, its rows 1-3 to rank 1's rows 0-2
    assert first["alltoall"] == [1.0, 2.0, 4.0, 6.0]
    assert second["alltoall"] == [2.0, 8.0, 10.0, 12.0]


def process_sets() -> dict:
    """Collectives in process sets of 2 ranks and of 1 among 3 ranks, then on every rank."""
    hvd.init()
    me = hvd.rank()
    pair, alone = hvd.add_process_set([0, 2]), hvd.add_process_set(hvd.ProcessSet([1]))
    mine = pair if me in (0, 2) else alone
    seen = {"set rank": (mine.rank(), mine.size(), mine.included(), pair.process_set_id)}
    seen["sum"] = hvd.allreduce(torch.tensor([me + 1.0]), op=hvd.Sum, process_set=mine).item()
    seen["from 2"] = hvd.broadcast(
        torch.tensor([float(me)]), 2 if mine is pair else 1, process_set=mine
    ).item()
    seen["gathered"] = hvd.allgather(torch.tensor([me]), process_set=mine).tolist()
    hvd.barrier(process_set=mine)
    seen["every rank"] = hvd.allreduce(torch.tensor([me + 1.0]), op=hvd.Sum).item()
    try:
        hvd.allreduce(torch.ones(1), process_set=alone if mine is pair else pair)
    except ValueError as err:
        seen["not mine"] = str(err)
    seen["removed"] = (hvd.remove_process_set(pair), hvd.remove_process_set(pair))
    return seen


def test_collectives_in_a_process_set_run_among_its_ranks_only(ray_session):
    first, second, third = hvd.run(process_sets, np=3, cpus_per_worker=0.5)
    assert first["set rank"] == (0, 2, True, 1)
    assert third["set rank"] == (1, 2, True, 1)
    assert second["set rank"] == (0, 1, True, 1)
    assert [r["sum"] for r in (first, second, third)] == [4.0, 2.0, 4.0]
    assert [r["from 2"] for r in (first, second, third)] == [2.0, 1.0, 2.0]
    assert [r["gathered"] for r in (first, second, third)] == [[0, 2], [1], [0, 2]]
    assert {r["every rank"] for r in (first, second, third)} == {6.0}
    assert first["not mine"].startswith("rank 0 is not one of ProcessSet(process_set_id=2")
    assert first["removed"] == (True, False)


SCRIPTS = Path(__file__).parent / "horovod_scripts"


def _ringflow_run(ray: str, *args: str) -> subprocess.CompletedProcess:
    """``ringflow-run ARGS`` from the repository root, its ranks on the Ray cluster at
    ``ray``."""
    import os

    env = {**os.environ, "RAY_ADDRESS": ray}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ringflow.horovod.runner",
            "-np",
            "2",
            "--cpus-per-worker",
            "0.5",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).parents[1],
    )


def test_ringflow_run_tells_each_rank_what_horovodrun_does(launcher_ray):
    names = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
    told = f"import os; print(*(os.environ['HOROVOD_' + k] for k in {names!r}))"
    done = _ringflow_run(launcher_ray, sys.executable, "-c", told)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line[:1] == "[") == [
        "[0] 0 2 0 2 0 1",
        "[1] 1 2 1 2 0 1",
    ]


def test_a_failing_rank_leaves_the_others_time_to_finish_before_they_are_stopped(launcher_ray):
    script = (
        "import os, sys, time\n"
        "if os.environ['HOROVOD_RANK'] == '1': sys.exit(3)\n"
        "time.sleep(1)\n"
        "print('rank 0 wrote its results', flush=True)\n"
        "time.sleep(60)\n"  # past the grace period: stopped
    )
    done = _ringflow_run(launcher_ray, "--grace-s", "4", sys.executable, "-c", script)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "[0] rank 0 wrote its results" in done.stdout.splitlines()
    assert "ringflow-run: rank 1 exited with status 3; 1 stopped after 4 s" in done.stderr


def test_ten_rounds_of_init_and_shutdown_each_form_a_ring_and_release_it(launcher_ray):
    done = _ringflow_run(launcher_ray, sys.executable, str(SCRIPTS / "rounds.py"))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        rounds = [
            line.split()[2:]
            for line in done.stdout.splitlines()
            if line.startswith(f"[{rank}] round")
        ]
        assert [r[2] for r in rounds] == [f"{2 * i + 1:g}" for i in range(10)]  # each round's sum
        held = [(r[4], r[6], r[8]) for r in rounds]
        assert held[-1] == held[1], held  # nothing piles up from round to round
        assert {m for _, _, m in held} == {"0"}  # no shared memory mapped after a shutdown


def test_a_rank_never_joins_another_runs_rendezvous():
    import torch.distributed as dist

    from ringflow.horovod import basics

    store = dist.HashStore()
    basics._check_run(
        store,
        basics._Ranks(
            rank=0,
            size=2,
            local_rank=0,
            local_size=2,
            cross_rank=0,
            cross_size=1,
            address="tcp://127.0.0.1:1",
            timeout_s=5,
            job="run-a",
        ),
    )
    theirs = basics._Ranks(
        rank=1,
        size=2,
        local_rank=1,
        local_size=2,
        cross_rank=0,
        cross_size=1,
        address="tcp://127.0.0.1:1",
        timeout_s=5,
        job="run-b",
    )
    with pytest.raises(hvd.HorovodError, match="belongs to another run"):
        basics._check_run(store, theirs)


CONTRACT = Path(__file__).parent / "horovod_contract"

WITHOUT_A_GPU = {
    "test_broadcast_state_gpu",
    "test_delta_optimizer",  # Adasum on GPUs, with MPI
    "test_gpu_required",
    "test_horovod_allreduce_cpu_gpu_error",
    "test_horovod_allreduce_multi_gpu",
    "test_horovod_alltoall_splits_on_gpu",
    "test_horovod_grouped_allreduce_cpu_gpu_error",
    "test_horovod_sync_batch_norm",
    "test_model_parallelism",
}
"""Horovod's tests that skip themselves where there is no GPU."""
SKIPPED_BY_HOROVOD = {"test_timeline_api"}  # marked skip in Horovod's file (its issue 2496)

REFUSED = {
    **dict.fromkeys(
        ("test_broadcast_state", "test_broadcast_state_options", "test_force_allreduce"),
        "torch's Muon takes only 2-D parameters (Horovod's test builds every torch.optim one)",
    ),
}
"""Horovod's tests that fail here, each for a reason docs/horovod.md lists under "What is
refused"."""


def _outcomes(junit_xml: Path) -> dict[str, str]:
    """Each test's outcome in a rank's JUnit XML: passed, failed or skipped."""
    import xml.etree.ElementTree as ET

    outcomes = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        found = {child.tag for child in case}
        outcome = "failed" if found & {"failure", "error"} else "passed"
        outcomes[case.get("name")] = "skipped" if "skipped" in found else outcome
    return outcomes


def test_horovods_own_torch_tests_pass_on_two_ranks_but_those_refused(tmp_path, launcher_ray):
    """Horovod's ``test/parallel/test_torch.py``, unchanged, on 2 ranks through
    ``ringflow-run``: one pytest process per rank, ``horovod.torch`` being ringflow's."""
    done = _ringflow_run(launcher_ray, sys.executable, str(CONTRACT / "rank.py"), str(tmp_path))
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: some failed
    documented = (Path(__file__).parents[1] / "docs" / "horovod.md").read_text()
    for rank in (0, 1):
        outcomes = _outcomes(tmp_path / f"rank{rank}.xml")
        assert len(outcomes) == 115, rank
        skipped = {name for name, outcome in outcomes.items() if outcome == "skipped"}
        assert skipped == WITHOUT_A_GPU | SKIPPED_BY_HOROVOD, rank
        failed = {name for name, outcome in outcomes.items() if outcome == "failed"}
        assert failed == set(REFUSED), (rank, done.stdout[-6000:])
    assert [name for name in REFUSED if f"`{name}`" not in documented] == []


def test_horovods_own_elastic_state_tests_pass_in_one_process(tmp_path):
    """Horovod's ``test/single/test_torch_elastic.py``, unchanged: ``TorchState`` and
    ``ElasticSampler`` on one rank, run without the launcher as Horovod runs it."""
    import os

    shimmed = os.pathsep.join(filter(None, [str(CONTRACT / "shim"), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(CONTRACT / "pytest.ini"),
            "--rootdir",
            str(CONTRACT),
            "--noconftest",
            "-q",
            f"--junitxml={tmp_path / 'single.xml'}",
            str(CONTRACT / "single" / "test_torch_elastic.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": shimmed},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _outcomes(tmp_path / "single.xml") == {
        "test_elastic_state": "passed",
        "test_elastic_sampler": "passed",
    }


def test_horovods_timeline_test_which_its_file_skips_passes_on_two_ranks(launcher_ray):
    """Horovod's ``test_timeline_api`` (skipped in Horovod's own file, its issue 2496), run
    as it is on 2 ranks: ``start_timeline``/``stop_timeline`` four times over, rank 0's file
    holding the named allreduce, its negotiation and (with ``mark_cycles``) the cycles."""
    done = _ringflow_run(launcher_ray, sys.executable, str(CONTRACT / "timeline_api.py"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if "passed" in line) == [
        "[0] test_timeline_api passed",
        "[1] test_timeline_api passed",
    ]
