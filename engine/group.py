"""Where the ranks run: Ray actors gang-scheduled in a placement group, or this process."""

from __future__ import annotations

import os
from typing import Any

from engine.config import DataSpec, TrainConfig
from engine.errors import EngineError, WorkerFailedError
from engine.worker import RankWorker

__all__ = ["InProcessGroup", "RayWorkerGroup", "WorkerGroup"]


class WorkerGroup:
    """Calls one method on every rank and returns their results in rank order."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        raise NotImplementedError

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InProcessGroup(WorkerGroup):
    """A single rank in the caller's process: no actor, no process group."""

    def __init__(self, module_cls: type, *, hparams: dict, data: DataSpec, config: TrainConfig):
        if config.workers != 1:
            raise ValueError(f"an in-process group has exactly 1 worker, got {config.workers}")
        self._worker = RankWorker(module_cls, hparams=hparams, data=data, config=config, rank=0)
        self._worker.connect()

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self._worker, method)(*args, **kwargs)]

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._worker, method)(*args, **kwargs)

    def shutdown(self) -> None:
        self._worker.close()


class RayWorkerGroup(WorkerGroup):
    """``config.workers`` Ray actors, started together or not at all.

    Raises:
        EngineError: the cluster cannot place the workers within ``config.timeout_s``.
    """

    def __init__(self, module_cls: type, *, hparams: dict, data: DataSpec, config: TrainConfig):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._timeout = config.timeout_s
        _check_capacity(config)
        bundles = [{"CPU": config.cpus_per_worker} for _ in range(config.workers)]
        self._pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=config.timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._pg)
            raise EngineError(
                f"Ray could not place {config.workers} workers of {config.cpus_per_worker} CPU "
                f"within {config.timeout_s:.0f} s; free resources, lower workers or raise timeout_s"
            ) from None
        actor = ray.remote(RankWorker)
        env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        self._actors = [
            actor.options(
                num_cpus=config.cpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": env} if _single_node() else None,
            ).remote(module_cls, hparams=hparams, data=data, config=config, rank=rank)
            for rank in range(config.workers)
        ]
        try:
            init_method = self.call_rank0("rendezvous_address")
            self.call("connect", init_method)
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        refs = [getattr(a, method).remote(*args, **kwargs) for a in self._actors]
        return self._get(refs)

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._get([getattr(self._actors[0], method).remote(*args, **kwargs)])[0]

    def _get(self, refs: list) -> list[Any]:
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as err:
            rank = _failed_rank(refs)
            raise WorkerFailedError(f"worker rank {rank} died: {err}", rank=rank) from err
        except ray.exceptions.RayTaskError as err:
            rank = _failed_rank(refs)
            raise WorkerFailedError(
                f"worker rank {rank} raised {type(err.cause).__name__}: {err.cause}", rank=rank
            ) from err.cause

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in getattr(self, "_actors", []):
            ray.kill(a)
        remove_placement_group(self._pg)


def _failed_rank(refs: list) -> int | None:
    """The first rank whose call failed, for the error message."""
    import ray

    for rank, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.GetTimeoutError:
            continue
        except Exception:
            return rank
    return None


def _check_capacity(config: TrainConfig) -> None:
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    need = config.workers * config.cpus_per_worker
    if need > total:
        raise EngineError(
            f"{config.workers} workers x {config.cpus_per_worker} CPU need {need:g} CPUs but the "
            f"Ray cluster has {total:g}; lower workers or cpus_per_worker, or add Ray nodes"
        )


def _single_node() -> bool:
    """gloo must be told to use loopback when every worker shares this one machine."""
    import ray

    return len([n for n in ray.nodes() if n["Alive"]]) == 1
