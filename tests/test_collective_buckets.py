"""Gradient buckets, with a fake collective: no processes, so each property is checked alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringflow.engine.collective import Collective, CollectiveWork, GradientBuckets
from ringflow.engine.collective.base import CompletedWork


class _RecordingCollective(Collective):
    """Sums over ``copies`` identical ranks; records what was reduced and when."""

    def __init__(self, model: nn.Module, *, copies: int = 1) -> None:
        super().__init__(rank=0, world_size=1)
        self.model, self.copies = model, copies
        self.calls: list[tuple[int, bool]] = []  # (bucket length, first layer still waiting)
        self.ops: list[str] = []

    def allreduce_async_(self, tensor: torch.Tensor, *, op: str = "sum") -> CollectiveWork:
        first_layer_waiting = self.model[0].weight.grad is None
        self.calls.append((tensor.numel(), first_layer_waiting))
        self.ops.append(op)
        return CompletedWork(tensor.mul_(self.copies) if op == "sum" else tensor)

    def broadcast_(self, tensor: torch.Tensor, *, src: int = 0) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))


def _backward(model: nn.Module, buckets: GradientBuckets, **start) -> None:
    model.zero_grad(set_to_none=True)
    buckets.start(**start)
    model(torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    buckets.finish()


def test_buckets_take_parameters_last_first_until_they_reach_the_size():
    model = _model()
    buckets = GradientBuckets(
        list(model.parameters()), _RecordingCollective(model), bucket_bytes=300 * 4
    )
    # Last layer first: bias 4 + weight 64 + bias 16 + weight 256 (now 340 >= 300: closed),
    # then bias 16 + weight 128. As DDP: no bias goes out alone before its weight.
    assert buckets.bucket_sizes == [340, 144]
    assert GradientBuckets(
        list(model.parameters()), _RecordingCollective(model), bucket_bytes=84 * 4
    ).bucket_sizes == [84, 256, 144]  # exactly full: closed at once


def test_buckets_start_during_backward_in_reverse_order():
    model = _model()
    collective = _RecordingCollective(model)
    buckets = GradientBuckets(list(model.parameters()), collective, bucket_bytes=1)
    _backward(model, buckets)
    sizes = [p.numel() for p in reversed(list(model.parameters()))]
    assert [length for length, _ in collective.calls] == sizes
    # The later layers' buckets went out before backward reached the first layer.
    waiting = [w for _, w in collective.calls]
    assert waiting[:4] == [True] * 4
    assert waiting[-1] is False


def test_sums_are_weighted_and_written_back_into_grad():
    model, reference = _model(), _model()
    buckets = GradientBuckets(
        list(model.parameters()), _RecordingCollective(model, copies=2), bucket_bytes=200
    )
    _backward(model, buckets, weight=0.25)
    reference(
        torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    ).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad * 0.25 * 2)


def test_where_every_share_is_alike_the_collective_averages_and_nothing_is_weighted():
    model, reference = _model(), _model()
    collective = _RecordingCollective(model, copies=2)  # the mean of 2 equal copies: itself
    buckets = GradientBuckets(list(model.parameters()), collective, bucket_bytes=200)
    _backward(model, buckets, average=True)
    reference(
        torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    ).square().sum().backward()
    assert set(collective.ops) == {"avg"}
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # not multiplied on the way in
    with pytest.raises(ValueError, match="one of weight, average or over"):
        buckets.start(weight=0.5, average=True)


def test_over_divides_the_sums_once_reduced_by_the_shares_a_batch_was_split_into():
    """A rank that summed the parts of several ranks of the full size itself: the members'
    sum is divided by that size once it is in, as the full ring divides its sum."""
    model, reference = _model(), _model()
    collective = _RecordingCollective(model, copies=2)
    buckets = GradientBuckets(list(model.parameters()), collective, bucket_bytes=200)
    _backward(model, buckets, over=3)
    reference(
        torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    ).square().sum().backward()
    assert set(collective.ops) == {"sum"}
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, (q.grad * 2) / 3)
    _backward(model, buckets)  # the next pass divides by nothing
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad * 2)
    with pytest.raises(ValueError, match="one of weight, average or over"):
        buckets.start(average=True, over=3)


def test_a_parameter_without_gradient_still_takes_part():
    model = _model()
    unused = nn.Parameter(torch.ones(3))
    params = [unused, *model.parameters()]  # first in module order: its bucket goes out last
    collective = _RecordingCollective(model)
    buckets = GradientBuckets(params, collective, bucket_bytes=1)
    _backward(model, buckets)
    assert len(collective.calls) == len(params)
    assert torch.equal(unused.grad, torch.zeros(3))


def test_hooks_are_ignored_outside_a_step_and_removed_on_close():
    model = _model()
    collective = _RecordingCollective(model)
    buckets = GradientBuckets(list(model.parameters()), collective)
    model(torch.randn(2, 8)).sum().backward()  # no start(): evaluation-style backward
    assert collective.calls == []
    buckets.close()
    buckets.start()
    model(torch.randn(2, 8)).sum().backward()
    assert collective.calls == []  # no hooks left: nothing started during backward


def test_grads_become_views_of_their_buckets_so_later_steps_copy_nothing():
    model, reference = _model(), _model()
    collective = _RecordingCollective(model, copies=2)
    buckets = GradientBuckets(list(model.parameters()), collective, bucket_bytes=200)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    storages = set()
    for _ in range(2):  # the first step re-points .grad; the second accumulates in place
        model.zero_grad(set_to_none=False)
        buckets.start(weight=0.5)
        model(x).square().sum().backward()
        buckets.finish()
        storages.add(frozenset(p.grad.untyped_storage().data_ptr() for p in model.parameters()))
        reference.zero_grad()
        reference(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad * 0.5 * 2)
    buffers = {b.buffer.untyped_storage().data_ptr() for b in buckets._buckets}
    assert storages == {frozenset(buffers)}  # the same bucket storage both steps


def test_closing_gives_each_gradient_its_own_memory_and_keeps_its_values():
    """A ring that is left (a peer lost) may free its buckets' memory: the sums stay."""
    model = _model()
    buckets = GradientBuckets(list(model.parameters()), _RecordingCollective(model))
    _backward(model, buckets)
    buffers = {b.buffer.untyped_storage().data_ptr() for b in buckets._buckets}
    sums = [p.grad.clone() for p in model.parameters()]
    buckets.close()
    for p, want in zip(model.parameters(), sums, strict=True):
        assert p.grad.untyped_storage().data_ptr() not in buffers
        assert torch.equal(p.grad, want)


def test_buckets_are_allocated_by_the_collective():
    """So a transport can place them where it reduces fastest (symmetric memory on GPUs)."""
    model = _model()
    collective = _RecordingCollective(model)
    allocated = []

    def empty(numel, dtype, device):
        allocated.append(numel)
        return torch.zeros(numel, dtype=dtype, device=device)

    collective.empty = empty
    buckets = GradientBuckets(list(model.parameters()), collective, bucket_bytes=300 * 4)
    assert allocated == buckets.bucket_sizes == [340, 144]


def _flat_grads(model: nn.Module, buckets: GradientBuckets) -> list[torch.Tensor]:
    """Each bucket's parameters' gradients, flat and in its order (the padding aside)."""
    return [torch.cat([p.grad.reshape(-1) for p in params]) for params, _, _ in buckets.shards]


def test_reduce_scattered_buckets_closed_or_zeroed_leave_no_gradient_to_add_to():
    """Outside a rank's shard a reduce-scattered bucket holds partial sums: closed, the
    gradients go (kept, the next backward pass would add to them, which nothing zeroes
    under sharding); zeroed, one that is not its bucket's view (a pass cut short) goes."""
    model = _model()
    buckets = GradientBuckets(list(model.parameters()), _RecordingCollective(model), scatter=True)
    _backward(model, buckets)
    stray = model[0].weight
    stray.grad = stray.grad.clone()  # as a backward pass cut short before its bucket leaves it
    buckets.zero_()
    assert stray.grad is None
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    _backward(model, buckets)
    buckets.close()
    assert all(p.grad is None for p in model.parameters())


def test_buckets_that_keep_their_shards_leave_the_parameters_no_gradient_and_add_up():
    """ZeRO-2: the sums land in the kept shards (here the one rank's: the whole bucket), the
    parameters let their gradients go, and a second pass adds to the first until zeroed."""
    model = _model()
    plain = GradientBuckets(
        list(model.parameters()), _RecordingCollective(model), bucket_bytes=300 * 4
    )
    _backward(model, plain)
    want = _flat_grads(model, plain)
    plain.close()
    kept = GradientBuckets(
        list(model.parameters()),
        _RecordingCollective(model),
        bucket_bytes=300 * 4,
        scatter=True,
        keep_shards=True,
    )
    kept.zero_()
    _backward(model, kept)
    assert all(p.grad is None for p in model.parameters())
    shards = [shard for _, _, shard in kept.shards]
    assert [s.numel() for s in shards] == kept.bucket_sizes == [340, 144]
    for shard, sums in zip(shards, want, strict=True):
        assert torch.equal(shard, sums)
    _backward(model, kept)
    for shard, sums in zip(shards, want, strict=True):
        assert torch.equal(shard, 2 * sums)
    kept.zero_()
    assert not any(shard.any() for shard in shards)
    with pytest.raises(ValueError, match="set scatter"):
        GradientBuckets(list(model.parameters()), _RecordingCollective(model), keep_shards=True)


class _Ranks(_RecordingCollective):
    """One rank of ``size``: the layout of its buckets, nothing reduced."""

    def __init__(self, model: nn.Module, *, rank: int, size: int) -> None:
        super().__init__(model)
        self.rank, self.world_size = rank, size


@pytest.mark.parametrize("rank", [0, 3])
def test_a_sharded_optimizer_that_would_leave_a_worker_nothing_to_step_is_refused(rank):
    """A model smaller than the workers' shards would leave a worker no piece to step, and
    its commits waiting on gathers the others never join: every worker refuses it alike."""
    from ringflow.engine.errors import ModelError
    from ringflow.engine.sharding import ShardedOptimizer

    tiny = nn.Sequential(nn.Linear(1, 1))  # 2 elements, 4 workers
    collective = _Ranks(tiny, rank=rank, size=4)
    buckets = GradientBuckets(list(tiny.parameters()), collective, scatter=True)
    optimizer = torch.optim.Adam(tiny.parameters())
    with pytest.raises(ModelError, match=r"^shard: on 4 workers, worker 2 would step no param"):
        ShardedOptimizer(optimizer, buckets, collective)
    model = _model()  # 484 elements: every worker has some
    collective = _Ranks(model, rank=rank, size=4)
    buckets = GradientBuckets(list(model.parameters()), collective, scatter=True)
    sharded = ShardedOptimizer(torch.optim.Adam(model.parameters()), buckets, collective)
    assert sum(p.numel() for g in sharded.inner.param_groups for p in g["params"]) > 0
