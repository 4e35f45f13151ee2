"""``ringflow.horovod.ray.RayExecutor``: Horovod's ``horovod.ray`` API, its import changed,
on 2 CPU ranks of the session's private Ray."""

from __future__ import annotations

import pytest
import torch

import ringflow.horovod as hvd
from ringflow.horovod.ray import RayExecutor


def simple_fn():
    """Horovod's docs/ray.rst example."""
    hvd.init()
    print("hvd rank", hvd.rank())
    return hvd.rank()


class Model:
    """A stateful executable, as in Horovod's "Stateful Execution" example."""

    def __init__(self, learning_rate):
        self.weight = torch.ones(2)
        self.learning_rate = learning_rate

    def step(self):
        hvd.init()
        gradient = hvd.allreduce(torch.full((2,), float(hvd.rank() + 1)))
        self.weight -= self.learning_rate * gradient
        return self.weight.tolist()


def test_the_executor_runs_horovods_basic_function_on_two_ranks_each_ones_output_prefixed(
    ray_session, capsys
):
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=2, cpus_per_worker=0.5, use_gpu=False)
    executor.start(executable_cls=Model, executable_kwargs={"learning_rate": 0.5})
    try:
        assert sorted(executor.run(simple_fn)) == [0, 1]
        out = capsys.readouterr().out
        assert "[0] hvd rank 0\n" in out
        assert "[1] hvd rank 1\n" in out
        assert executor.run(lambda x, y: x + y + hvd.size(), args=[1], kwargs={"y": 2}) == [5, 5]
        # the average of 1 and 2 is 1.5: 1 - 0.5 * 1.5 on both ranks
        assert executor.execute(lambda model: model.step()) == [[0.25, 0.25]] * 2
        assert executor.execute_single(lambda model: model.learning_rate) == 0.5
        with pytest.raises(hvd.RankFailedError, match="rank 1 raised ValueError: no"):
            executor.run(_fails_on_rank_1)
    finally:
        executor.shutdown()


def _fails_on_rank_1():
    if hvd.rank() == 1:
        raise ValueError("no")
    return 0


def test_the_executor_refuses_what_it_cannot_do():
    settings = RayExecutor.create_settings()
    with pytest.raises(hvd.HorovodError, match=r"elastic \(max_workers, min_workers\).*min_np="):
        RayExecutor(settings, min_workers=1, max_workers=2)
    with pytest.raises(ValueError, match="give num_workers"):
        RayExecutor(settings)
    with pytest.raises(hvd.HorovodError, match="call start"):
        RayExecutor(settings, num_workers=2).run(simple_fn)
