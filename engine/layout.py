"""How a run's workers hold the model: the one thing ``fit`` varies between layouts.

``DataParallel``: every worker holds the whole model and a part of every global batch.
``Pipeline``: every replica is ``stages`` workers, each holding a contiguous run of layers.

Both train through the same driver (``engine.trainer``), the same worker group
(``engine.group``), the same worker (``engine.worker.Worker``), the same checkpoint store and
the same resume. A layout says which step each worker runs (the ``plan`` in its
``worker_kwargs``), how the workers connect, which ``TrainConfig`` options it cannot honour
(refused before anything starts), how its training state is checkpointed and how the whole
model is gathered at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from ringflow.engine.config import TrainConfig
from ringflow.storage.reshard import merge_optimizer_metadata, pipeline_shards
from ringflow.storage.store import CheckpointStore

if TYPE_CHECKING:
    from ringflow.engine.pipeline.config import PipelineConfig
    from ringflow.engine.pipeline.partition import Partition

__all__ = ["DataParallel", "Layout", "Pipeline", "Workers", "layout_of"]


class Workers(Protocol):
    """What a layout calls on its started workers: the worker group (``engine.group``)."""

    def call_each(self, method: str, arguments: list[tuple]) -> list[Any]: ...

    def call_first(self, count: int, method: str, *args: Any) -> list[Any]: ...

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any: ...


class Layout:
    """What differs between layouts; see the module docstring."""

    elastic = False
    """Whether lost workers are replaced while the others roll back (in-memory commits)."""
    what = "workers"
    """The workers in words, for messages."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    @property
    def size(self) -> int:
        """How many workers (Ray actors) the layout has."""
        raise NotImplementedError

    def worker_cls(self) -> type:
        """The one worker class (``engine.worker.Worker``), whatever the layout."""
        from ringflow.engine.worker import Worker

        return Worker

    def worker_kwargs(self, index: int) -> dict[str, Any]:
        """Keyword arguments of worker ``index`` besides module, hparams, data and config:
        its ``rank`` and the ``plan`` of its step."""
        raise NotImplementedError

    def describe(self, index: int) -> str:
        """Worker ``index`` in words, for errors: ``worker rank 1``, ``replica 0 stage 1``."""
        raise NotImplementedError

    def connect(self, group: Workers) -> None:
        """Connect the started workers: collectives, pipeline links."""
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        """What a checkpoint's fingerprint records of the layout: resuming into another is
        refused."""
        return {}

    def meta(self) -> dict[str, Any]:
        """What the committed model records of the layout."""
        return {}

    def refused(self, *, init_from: str | None) -> list[str]:
        """The options of this run that the layout cannot honour, each with why."""
        return []

    def prepare(self, module_cls: type, hparams: dict[str, Any], data: Any) -> None:
        """Check the model for this layout before any worker starts (builds it once)."""
        raise NotImplementedError

    def checkpoint(
        self,
        group: Workers,
        store_url: str,
        run_key: str,
        *,
        step: int,
        metadata: dict[str, Any],
        metrics: dict[str, float],
    ) -> None:
        """Commit the training state of ``step`` to the store (manifest last)."""
        raise NotImplementedError

    def flush(self, group: Workers) -> list[str]:
        """Wait for checkpoints still being written; return their errors."""
        return []

    def model_state(self, group: Workers) -> dict[str, torch.Tensor]:
        """The whole model's weights, as CPU tensors."""
        raise NotImplementedError


class DataParallel(Layout):
    """``config.workers`` workers, each a whole replica; gradients averaged by the ring."""

    elastic = True

    @property
    def size(self) -> int:
        return self.config.workers

    def prepare(self, module_cls: type, hparams: dict[str, Any], data: Any) -> None:
        from ringflow.engine.module import refuse_manual_optimisation
        from ringflow.engine.spec import build_module

        refuse_manual_optimisation(build_module(module_cls, hparams))

    def worker_kwargs(self, index: int) -> dict[str, Any]:
        from ringflow.engine.data_parallel import WholeModel

        return {"rank": index, "plan": WholeModel()}

    def describe(self, index: int) -> str:
        return f"worker rank {index}"

    def connect(self, group: Workers) -> None:
        # One worker has no peers to meet (and may run where there is no Ray).
        init_method = group.call_rank0("addresses")[0] if self.size > 1 else ""
        group.call("connect", init_method)

    def checkpoint(self, group, store_url, run_key, *, step, metadata, metrics) -> None:
        # Rank 0 copies the replicated state to host memory and writes it in the background.
        group.call_rank0(
            "checkpoint", store_url, run_key, step=step, metadata=metadata, metrics=metrics
        )

    def flush(self, group: Workers) -> list[str]:
        return group.call_rank0("flush_checkpoints")["errors"]

    def model_state(self, group: Workers) -> dict[str, torch.Tensor]:
        return group.call_rank0("state_dict")


class Pipeline(Layout):
    """``config.workers`` replicas of ``pipeline.stages`` stage workers each; worker
    ``replica * stages + stage`` runs that stage of that replica."""

    what = "stage workers"

    def __init__(self, config: TrainConfig, pipeline: PipelineConfig) -> None:
        super().__init__(config)
        self.pipeline = pipeline
        self.partition: Partition | None = None
        """Which layers each stage owns: decided by :meth:`prepare`."""

    @property
    def size(self) -> int:
        return self.config.workers * self.pipeline.stages

    def prepare(self, module_cls: type, hparams: dict[str, Any], data: Any) -> None:
        from ringflow.engine.pipeline.checks import check_pipeline

        self.partition = check_pipeline(
            module_cls, hparams=hparams, data=data, config=self.config, pipeline=self.pipeline
        )

    def worker_kwargs(self, index: int) -> dict[str, Any]:
        from ringflow.engine.pipeline.step import StagePlan

        replica, stage = divmod(index, self.pipeline.stages)
        return {"rank": replica, "plan": StagePlan(self.pipeline, self.partition, stage)}

    def describe(self, index: int) -> str:
        replica, stage = divmod(index, self.pipeline.stages)
        return f"replica {replica} stage {stage}"

    def connect(self, group: Workers) -> None:
        """Each replica meets at its stage 0's store, each stage's ring at replica 0's
        worker of that stage, and (on GPUs) the whole run at replica 0's stage 0."""
        stages = self.pipeline.stages
        addresses = group.call("addresses")
        group.call_each(
            "connect",
            [
                (addresses[i - i % stages][0], addresses[i % stages][1], addresses[0][0])
                for i in range(self.size)
            ],
        )

    def identity(self) -> dict[str, Any]:
        return {"pipeline": True}

    def meta(self) -> dict[str, Any]:
        return {
            "pipeline_stages": self.pipeline.stages,
            "micro_batches": self.pipeline.micro_batches,
            "schedule": self.pipeline.schedule,
            "partition": [list(self.partition.layers_of(s)) for s in range(self.partition.stages)],
        }

    _UNSUPPORTED = {
        "min_workers": "pipeline stages do not go on with fewer workers: a lost stage fails "
        "the run, and a retried run resumes from its last checkpoint",
        "max_failures": "a lost pipeline stage fails the run (no in-run replacement)",
        "commit_every": "pipeline stages keep no in-memory commits",
        "bucket_mb": "pipeline stages reduce their gradients in one piece after the schedule",
        "timeline": "the timeline records data-parallel workers' steps",
    }

    def refused(self, *, init_from: str | None) -> list[str]:
        defaults = TrainConfig()
        return [
            f"{name}={getattr(self.config, name)!r} ({why})"
            for name, why in self._UNSUPPORTED.items()
            if getattr(self.config, name) != getattr(defaults, name)
        ]

    def checkpoint(self, group, store_url, run_key, *, step, metadata, metrics) -> None:
        # Replica 0's stages hold the whole state between them, one shard per stage.
        stages = group.call_first(self.pipeline.stages, "training_state")
        CheckpointStore(store_url).save(
            run_key,
            step=step,
            shards=pipeline_shards([tensors for tensors, _, _ in stages]),
            metadata={
                **metadata,
                "optimizer": merge_optimizer_metadata([meta for _, meta, _ in stages]),
                "optimization": stages[0][2],  # every stage steps its schedulers alike
                "stages": len(stages),
            },
            metrics=metrics,
        )

    def model_state(self, group: Workers) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for part in group.call_first(self.pipeline.stages, "state_dict"):
            state.update(part)
        return state


def layout_of(config: TrainConfig, pipeline: PipelineConfig | None) -> Layout:
    """The layout a run asks for: ``Pipeline`` with a ``PipelineConfig`` (one stage is a
    replica of a layer sequence trained by the pipeline's schedule), else ``DataParallel``."""
    if pipeline is None:
        return DataParallel(config)
    return Pipeline(config, pipeline)
