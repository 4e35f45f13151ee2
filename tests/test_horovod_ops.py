"""``ringflow.horovod``'s collectives against what Horovod's own ``test/parallel/test_torch.py``
checks: sums and averages of every dtype and 1-3 dimensions, allgather of ragged first
dimensions, broadcast from each root, async handles, and the errors on ranks that disagree
(shapes, dtypes, roots, names), each raised on every rank before anything travels.

Each check runs on 2 ranks (``hvd.run``) and returns what it saw; the test asserts on it."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import ringflow.horovod as hvd

DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16)
DTYPES += (torch.float32, torch.float64)
pytestmark = pytest.mark.integration


def _tensor(dtype: torch.dtype, dim: int, seed: int = 1234) -> torch.Tensor:
    torch.manual_seed(seed)
    low = 0 if dtype == torch.uint8 else -100
    return torch.empty([17] * dim).random_(low, 100).to(dtype)


def reductions() -> list[str]:
    """What differs from Horovod's expectations (nothing, when all is right)."""
    hvd.init()
    n, wrong = hvd.size(), []
    for dtype, dim in itertools.product(DTYPES, (1, 2, 3)):
        tensor = _tensor(dtype, dim)
        summed = hvd.allreduce(tensor, op=hvd.Sum)
        want = tensor.double() * n
        if dtype == torch.uint8 or dtype == torch.int8:  # they wrap, as in torch
            want = (tensor.to(torch.int64) * n).to(dtype).double()
        if summed.dtype != dtype or not torch.equal(summed.double(), want):
            wrong.append(f"sum {dtype} {dim}d")
        if dtype == torch.int8:
            continue  # its sums wrap: no average or scaling to compare (nor in Horovod)
        averaged = hvd.allreduce(tensor, average=True)
        exact = not dtype.is_floating_point or dtype == torch.float64
        if not torch.allclose(averaged.double(), tensor.double(), atol=0 if exact else 1e-2):
            wrong.append(f"average {dtype} {dim}d")
        in_place = tensor.clone()
        pre, post = (0.5, 2.0) if dtype.is_floating_point else (2.0, 0.5)  # ints truncate
        if dtype != torch.uint8:  # 2 x 99 x 2 ranks would wrap
            hvd.allreduce_(in_place, op=hvd.Sum, prescale_factor=pre, postscale_factor=post)
            if not torch.allclose(in_place.double(), summed.double(), atol=1e-2):
                wrong.append(f"pre/postscale {dtype} {dim}d")
    return wrong


def gathers_and_broadcasts() -> list[str]:
    hvd.init()
    n, me, wrong = hvd.size(), hvd.rank(), []
    for dtype, dim in itertools.product(DTYPES, (1, 2, 3)):
        mine = torch.full([me + 1] + [17] * (dim - 1), me).to(dtype)  # rank r: r + 1 rows
        gathered = hvd.allgather(mine)
        if gathered.shape[0] != sum(range(1, n + 1)) or gathered.dtype != dtype:
            wrong.append(f"allgather shape {dtype} {dim}d")
        start = 0
        for rank in range(n):
            rows = gathered[start : start + rank + 1]
            start += rank + 1
            if not torch.equal(rows, torch.full_like(rows, rank)):
                wrong.append(f"allgather rank {rank} {dtype} {dim}d")
        for root in range(n):
            tensor = torch.full([17] * dim, me).to(dtype)
            if not torch.equal(hvd.broadcast(tensor, root), torch.full_like(tensor, root)):
                wrong.append(f"broadcast from {root} {dtype} {dim}d")
            if not torch.equal(tensor, torch.full_like(tensor, me)):
                wrong.append(f"broadcast changed its input {dtype} {dim}d")
    return wrong


def handles() -> dict:
    hvd.init()
    tensors = [torch.full((5,), float(i + hvd.rank())) for i in range(10)]
    started = [hvd.allreduce_async(t, op=hvd.Sum, name=f"t{i}") for i, t in enumerate(tensors)]
    results = [hvd.synchronize(h).tolist() for h in reversed(started)][::-1]
    return {"results": results, "polled": all(hvd.poll(h) for h in started)}


def disagreements() -> dict[str, str]:
    """Each kind of disagreement Horovod's tests check, and the error it raised here."""
    hvd.init()
    me, seen = hvd.rank(), {}
    cases = {
        "shape": lambda: hvd.allreduce(torch.zeros([17 + me] * 3)),
        "same size, other dims": lambda: hvd.allreduce(
            torch.zeros([17, 23 * 57] if me == 0 else [17, 23, 57])
        ),
        "dtype": lambda: hvd.allreduce(torch.zeros(17, dtype=torch.int32 if me else torch.float32)),
        "op": lambda: hvd.allreduce(torch.zeros(17), op=hvd.Sum if me else hvd.Average),
        "broadcast shape": lambda: hvd.broadcast(torch.zeros(17, 10 * (me + 1), 17), 0),
        "broadcast root": lambda: hvd.broadcast(torch.zeros(17), me),
        "broadcast no such root": lambda: hvd.broadcast(torch.zeros(17), 5),
        "allgather other dims": lambda: hvd.allgather(torch.zeros(2, 3 + me)),
        "name": lambda: hvd.allreduce(torch.zeros(3), name=f"rank{me}"),
    }
    for case, call in cases.items():
        try:
            call()
            seen[case] = "no error"
        except RuntimeError as err:
            seen[case] = f"{type(err).__name__}: {err}"
    hvd.allreduce_async(torch.zeros(3), name="twice")
    try:
        hvd.allreduce_async(torch.zeros(3), name="twice")
        seen["duplicate name"] = "no error"
    except ValueError as err:
        seen["duplicate name"] = f"ValueError: {err}"
    seen["after them"] = str(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist())
    return seen


def out_of_order() -> dict:
    """Rank 0 starts ``a`` then ``g``, rank 1 ``g`` then ``a``; then rank 0 starts ``late``
    and polls it before a barrier, rank 1 starts it only after the barrier."""
    hvd.init()
    me = hvd.rank()
    start = {
        "a": lambda: hvd.allreduce_async(torch.full((3,), 1.0 + me), name="a", op=hvd.Sum),
        "g": lambda: hvd.allgather_async(torch.full((me + 1, 2), float(me)), name="g"),
    }
    handles = {n: start[n]() for n in (("a", "g") if me == 0 else ("g", "a"))}
    seen = {n: hvd.synchronize(h).tolist() for n, h in handles.items()}
    if me == 0:
        late = hvd.allreduce_async(torch.tensor([5.0]), name="late", op=hvd.Sum)
        seen["late polled before the barrier"] = hvd.poll(late)
    hvd.barrier()
    if me == 1:
        late = hvd.allreduce_async(torch.tensor([7.0]), name="late", op=hvd.Sum)
    seen["late"] = hvd.synchronize(late).tolist()
    seen["after them"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist()
    return seen


def test_operations_match_by_name_in_any_order_and_one_waiting_blocks_no_barrier(ray_session):
    """As Horovod's: each operation runs once every rank started one of its name, whatever
    order they started them in; one only some ranks started waits there without holding up
    the operations (a barrier) the others go on with."""
    first, second = hvd.run(out_of_order, np=2, cpus_per_worker=0.5)
    for seen in (first, second):
        assert seen["a"] == [3.0, 3.0, 3.0]
        assert seen["g"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert seen["late"] == [12.0]
        assert seen["after them"] == [2.0]
    assert first["late polled before the barrier"] is False


def another_model() -> str:
    hvd.init()
    model = torch.nn.Linear(4, 3 if hvd.rank() == 0 else 2)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    try:
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_sums_and_averages_of_every_dtype_and_dimension_are_horovods(ray_session):
    assert hvd.run(reductions, np=2, cpus_per_worker=0.5) == [[], []]


def test_ragged_allgathers_and_broadcasts_from_each_root_are_horovods(ray_session):
    assert hvd.run(gathers_and_broadcasts, np=2, cpus_per_worker=0.5) == [[], []]


def test_async_handles_finish_in_any_order_of_waiting(ray_session):
    for seen in hvd.run(handles, np=2, cpus_per_worker=0.5):
        assert seen["results"] == [[2.0 * i + 1] * 5 for i in range(10)]
        assert seen["polled"]


def test_ranks_that_disagree_get_one_error_each_naming_what_and_the_ring_goes_on(ray_session):
    first, second = hvd.run(disagreements, np=2, cpus_per_worker=0.5)
    said = {
        "shape": "allreduce: the ranks disagree on the shape: rank 0 has (17, 17, 17), "
        "rank 1 has (18, 18, 18)",
        "same size, other dims": "the ranks disagree on the number of dimensions",
        "dtype": "the ranks disagree on the dtype: rank 0 has torch.float32, rank 1 has "
        "torch.int32",
        "op": "the ranks disagree on the op",
        "broadcast shape": "broadcast: the ranks disagree on the shape",
        "broadcast root": "broadcast: the ranks disagree on the root rank: rank 0 has 0, "
        "rank 1 has 1",
        "broadcast no such root": "broadcast: root_rank 5 is not one of the 2 ranks",
        "allgather other dims": "allgather: the ranks disagree on the shape",
        "name": "the ranks disagree on the name: rank 0 and rank 1 gave it different names",
        "duplicate name": "ValueError: allreduce 'twice': an operation of that name is still",
    }
    for seen in (first, second):
        for case, words in said.items():
            assert words in seen[case], (case, seen[case])
            assert "\n" not in seen[case]
        assert seen["after them"] == "[2.0, 2.0]"
    assert first["shape"].startswith("HorovodError: ")


def test_a_rank_with_another_model_is_told_at_the_first_backward(ray_session):
    for said in hvd.run(another_model, np=2, cpus_per_worker=0.5):
        assert "parameter 0 is ('weight', (3, 4), 'torch.float32') on rank 0 and" in said
        assert "every rank must build the same model" in said


def _batch_norm_training(norm: type) -> dict:
    """Three SGD steps of a convolution and a batch norm on a global batch of 16 split over
    the ranks there are (the whole batch without ``hvd.init``); the weights, the running
    statistics and the evaluation output after them."""
    ranks = hvd.size() if hvd.is_initialized() else 1
    me = hvd.rank() if hvd.is_initialized() else 0
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 5), torch.randn(16, 3, 5)
    net = torch.nn.Sequential(torch.nn.Conv1d(3, 3, 1), norm(3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    if ranks > 1:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x[me::ranks]), y[me::ranks]).backward()
        optimizer.step()
    net.eval()
    return {"state": net.state_dict(), "evaluated": net(x).detach()}


def sync_batch_norm() -> dict:
    hvd.init()
    return _batch_norm_training(hvd.SyncBatchNorm)


def test_sync_batch_norm_on_two_ranks_trains_as_batch_norm_on_the_whole_batch(ray_session):
    alone = _batch_norm_training(torch.nn.BatchNorm1d)
    for seen in hvd.run(sync_batch_norm, np=2, cpus_per_worker=0.5):
        assert seen["state"].keys() == alone["state"].keys()
        assert torch.equal(seen["state"]["1.num_batches_tracked"], torch.tensor(3))
        for name, tensor in alone["state"].items():
            assert torch.allclose(seen["state"][name].double(), tensor.double(), atol=1e-6), name
        assert torch.allclose(seen["evaluated"], alone["evaluated"], atol=1e-5)


def late_rank_one() -> float:
    """How long this rank waited in the barrier; rank 1 comes a second late."""
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(1.0)
    start = time.monotonic()
    hvd.barrier()
    return time.monotonic() - start


def test_a_barrier_waits_for_every_rank(ray_session):
    waited, _ = hvd.run(late_rank_one, np=2, cpus_per_worker=0.5)
    assert waited >= 0.9  # rank 0 left when rank 1 came, not before


def uneven() -> dict:
    """Rank 0 has 3 batches, rank 1 has 5: each trains on its own and then joins."""
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    batches = _uneven_batches()[hvd.rank()]
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    summed = hvd.allreduce(torch.ones(2), op=hvd.Sum) if hvd.rank() == 1 else None
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)  # Horovod's pattern
    return {"weights": model.state_dict(), "last": last, "summed": summed}


def _uneven_batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(7)
    return [
        [(torch.randn(4, 4, generator=generator), torch.randn(4, 1, generator=generator))] * n
        for n in (3, 5)
    ]


def test_join_lets_a_rank_with_less_data_finish_while_the_other_goes_on(ray_session):
    """Horovod's join: the joined rank's gradients count as zeros in the average (over both
    ranks); after join, the weights of the rank that joined last are broadcast."""
    first, second = hvd.run(uneven, np=2, cpus_per_worker=0.5)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _uneven_batches()
    for step in range(5):
        optimizer.zero_grad()
        losses = [
            torch.nn.functional.mse_loss(model(x), y)
            for x, y in (b[step] for b in batches if step < len(b))
        ]
        (sum(losses) / 2).backward()  # the average over both ranks, a joined one giving zeros
        optimizer.step()
    for seen in (first, second):
        assert seen["last"] == 1
        for name, tensor in model.state_dict().items():
            assert torch.allclose(seen["weights"][name], tensor, atol=1e-6), name
    assert second["summed"].tolist() == [1.0, 1.0]  # rank 0, joined, gave zeros


def fused_training(fusion: str, options: dict) -> dict:
    """Three Adam steps of a 3-layer MLP on this rank's half of a batch, with
    ``HOROVOD_FUSION_THRESHOLD=fusion`` (bytes); the weights and the elements each all-reduce
    of the gradients carried."""
    import os

    os.environ["HOROVOD_FUSION_THRESHOLD"] = fusion
    hvd.init()
    from ringflow.horovod.basics import ring as current_ring

    ring, sizes = current_ring(), []
    launch = ring.allreduce_async_

    def counted(tensor, **kwargs):
        sizes.append(tensor.numel())
        return launch(tensor, **kwargs)

    ring.allreduce_async_ = counted
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    net.append(torch.nn.Tanh()).append(torch.nn.Linear(4, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    optimizer = hvd.DistributedOptimizer(optimizer, net.named_parameters(), **options)
    x, y = torch.randn(16, 6), torch.randn(16, 1)
    for _ in range(3):
        optimizer.zero_grad()
        mine = slice(hvd.rank() * 8, hvd.rank() * 8 + 8)
        torch.nn.functional.mse_loss(net(x[mine]), y[mine]).backward()
        optimizer.step()
    return {"state": net.state_dict(), "sizes": sizes}


FUSIONS = ("0", "150", str(25 << 20))
OPTIONS = {
    "average": {},
    "predivide": {"gradient_predivide_factor": 2.0},
    "sum": {"op": hvd.Sum},
    "fp16": {"compression": hvd.Compression.fp16},
}
"""The ``DistributedOptimizer`` options each fusion threshold is trained with, by test id."""


def fused_trainings(runs: list[tuple[str, str, dict]]) -> dict[tuple[str, str], dict]:
    """:func:`fused_training` for each ``(options' id, fusion, options)`` in turn, each on a
    ring of its own (``hvd.init`` to ``hvd.shutdown``): what each saw."""
    seen = {}
    for name, fusion, options in runs:
        seen[(name, fusion)] = fused_training(fusion, options)
        hvd.shutdown()
    return seen


@pytest.fixture(scope="module")
def fused(ray_session) -> dict[str, dict[str, list[dict]]]:
    """Every way of :data:`OPTIONS` with every one of :data:`FUSIONS`, on the same 2 ranks:
    by options' id and fusion, each rank's :func:`fused_training`."""
    runs = [(name, fusion, options) for name, options in OPTIONS.items() for fusion in FUSIONS]
    ranks = hvd.run(fused_trainings, args=(runs,), np=2, cpus_per_worker=0.5)
    return {
        name: {fusion: [rank[(name, fusion)] for rank in ranks] for fusion in FUSIONS}
        for name in OPTIONS
    }


@pytest.mark.parametrize("options", list(OPTIONS))
def test_gradients_are_fused_into_buckets_with_the_weights_of_one_reduction_each(fused, options):
    """Horovod's tensor fusion: by default the MLP's 6 gradients (97 numbers) go as one
    all-reduce a step; a threshold of 150 bytes closes a bucket once it holds 150 bytes or more;
    0 turns fusion off (one all-reduce per gradient). Every way ends with the same weights."""
    runs = fused[options]
    per_tensor = [1, 4, 4, 32, 8, 48]  # backward's order: the last layer's bias first
    assert [r["sizes"] for r in runs["0"]] == [per_tensor * 3] * 2
    assert [r["sizes"] for r in runs["150"]] == [[1 + 4 + 4 + 32, 8 + 48] * 3] * 2
    assert [r["sizes"] for r in runs[str(25 << 20)]] == [[97] * 3] * 2
    reference = runs["0"][0]["state"]
    for fusion, ranks in runs.items():
        for rank in ranks:
            for name, tensor in rank["state"].items():
                assert torch.allclose(tensor, reference[name], rtol=1e-6, atol=1e-7), (
                    fusion,
                    name,
                )


@pytest.mark.parametrize("value", ["lots", "-1"])
def test_a_fusion_threshold_that_is_not_bytes_is_refused_in_one_line(monkeypatch, value):
    from ringflow.horovod.optimizer import _fusion_bytes

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", value)
    with pytest.raises(hvd.HorovodError, match="HOROVOD_FUSION_THRESHOLD must be a number of b"):
        _fusion_bytes()
