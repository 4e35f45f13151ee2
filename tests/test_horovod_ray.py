"""``ringflow.horovod.ray``: Horovod's ``horovod.ray`` API (``RayExecutor``,
``ElasticRayExecutor``, ``ray_logger``), its import changed, on 2 CPU ranks of the session's
private Ray."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch

import ringflow.horovod as hvd
from ringflow.horovod.ray import ElasticRayExecutor, RayExecutor, TestDiscovery, ray_logger


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


def test_the_executors_refuse_what_they_cannot_do():
    settings = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="give num_workers"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="max_workers needs a positive min_workers"):
        RayExecutor(settings, max_workers=2)
    with pytest.raises(hvd.HorovodError, match="call start"):
        RayExecutor(settings, num_workers=2).run(simple_fn)
    with pytest.raises(NotImplementedError, match="no execute_single: use execute"):
        RayExecutor(settings, min_workers=1).execute_single(lambda _: 0)
    with pytest.raises(ValueError, match="max_num_proc must be min_num_proc"):
        ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=1)
    with pytest.warns(DeprecationWarning, match="min_np is deprecated"):
        assert ElasticRayExecutor.create_settings(min_np=2).min_num_proc == 2
    elastic = ElasticRayExecutor.create_settings()
    with pytest.raises(ValueError, match="use_gpu=True"):
        ElasticRayExecutor(elastic, gpus_per_slot=1)
    with pytest.raises(hvd.HorovodError, match="call start"):
        ElasticRayExecutor(elastic).run(simple_fn)
    with pytest.raises(hvd.HorovodError, match="settings.discovery is None"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(), override_discovery=False).start()
    with pytest.raises(hvd.HorovodError, match="_graceful=False"):
        TestDiscovery(min_hosts=1, max_hosts=2, change_frequency_s=1, _graceful=False)


class _Discovery:
    """Hosts and their slots as a test says: one slot until the file ``grow_when`` exists,
    two after."""

    def __init__(self, grow_when: Path | None = None) -> None:
        self.grow_when = grow_when

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        grown = self.grow_when is not None and self.grow_when.exists()
        return {"127.0.0.1": 2 if grown else 1}


def elastic_fn():
    hvd.init()
    print("hvd rank", hvd.rank())
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    if hvd.rank() == 0:
        ray_logger.log({"ranks": total})
        ray_logger.log({"done": True})
    return hvd.rank(), total


def test_the_elastic_executor_runs_on_the_clusters_slots_its_output_and_logs_reach_the_caller(
    ray_session, capsys
):
    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=4, timeout_s=30)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)  # the session's Ray: 2 CPUs
    executor.start()
    logged = []
    assert executor.run(elastic_fn, callbacks=[logged.append]) == [(0, 2.0), (1, 2.0)]
    out = capsys.readouterr().out
    assert "[0] hvd rank 0\n" in out
    assert "[1] hvd rank 1\n" in out
    assert logged == [{"ranks": 2.0}, {"done": True}]


def grows(committed: str) -> list[int]:
    """Commit until the ranks are 2, writing the file ``committed`` at each commit; the sizes
    seen at each commit."""
    hvd.init()
    sizes = []

    @hvd.elastic.run
    def train(state):
        deadline = time.monotonic() + 120
        while hvd.size() < 2 and time.monotonic() < deadline:
            sizes.append(hvd.size())
            state.commits += 1
            state.commit()
            Path(committed).touch()
            time.sleep(0.05)
        sizes.append(hvd.size())

    train(hvd.elastic.ObjectState(commits=0))
    return sizes


def test_a_slot_the_discovery_finds_later_takes_a_worker_that_joins_at_a_commit(
    ray_session, tmp_path
):
    committed = tmp_path / "committed"
    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=2)
    settings.discovery = _Discovery(grow_when=committed)  # 1 slot until rank 0 committed
    executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
    executor.start()
    first, joined = executor.run(functools.partial(grows, str(committed)))
    assert first[0] == 1  # it started on the one slot found
    assert first[-1] == 2
    assert joined == [2]  # the worker started on the new slot joined the ranks


def test_start_waits_for_min_num_proc_slots_and_names_the_knobs(ray_session):
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, elastic_timeout=0.5)
    settings.discovery = _Discovery()
    executor = ElasticRayExecutor(settings, cpus_per_slot=2, override_discovery=False)
    with pytest.raises(hvd.HorovodError, match=r"found 1 slots, fewer than min_num_proc=2.*"
                       r"cpus_per_slot \(2\)"):  # fmt: skip
        executor.start()


def test_a_ray_executor_given_min_workers_runs_each_function_elastically(ray_session):
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, min_workers=1, max_workers=2, cpus_per_worker=1)
    executor.start(executable_cls=Model, executable_kwargs={"learning_rate": 0.5})
    assert executor.run(_added, args=[1], kwargs={"y": 2}) == [3, 4]
    # each run's executable is made anew: 1 - 0.5 * 1.5 on both ranks, every time
    assert executor.execute(lambda model: model.step()) == [[0.25, 0.25]] * 2
    with pytest.raises(hvd.RankFailedError, match="raised ValueError: no"):
        executor.run(_fails_on_rank_1_once_ranked)
    executor.shutdown()


def _added(x, y):
    hvd.init()
    return x + y + hvd.rank()


def _fails_on_rank_1_once_ranked():
    hvd.init()
    return _fails_on_rank_1()
