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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ringflow.engine.config import WIRE_FORMATS, TrainConfig
from ringflow.engine.elastic.membership import Elastic, Fixed, Membership
from ringflow.engine.worker import Worker
from ringflow.storage.reshard import merge_optimizer_metadata, merge_sharded_optimizer_metadata
from ringflow.storage.store import CheckpointStorageError, CheckpointStore

if TYPE_CHECKING:
    from ringflow.engine.pipeline.config import PipelineConfig
    from ringflow.engine.pipeline.partition import Partition

__all__ = ["DataParallel", "Layout", "Method", "Pipeline", "Workers", "layout_of"]

Method = Callable[..., Any]
"""A method of :class:`~ringflow.engine.worker.Worker` (``Worker.evaluate``): what the driver
calls on its workers, named by the method itself, never by a string."""


class Workers(Protocol):
    """What a layout calls on its started workers: the worker group (``engine.group``)."""

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]: ...

    def call_each(self, method: Method, arguments: list[tuple]) -> list[Any]: ...

    def call_first(self, count: int, method: Method, *args: Any) -> list[Any]: ...

    def call_rank0(self, method: Method, *args: Any, **kwargs: Any) -> Any: ...

    def call_ranked(
        self, method: Method, arguments: list[tuple], workers: list[int]
    ) -> list[Any]: ...

    @property
    def members(self) -> tuple[str, ...]: ...


class Layout:
    """What differs between layouts; see the module docstring."""

    elastic = False
    """Whether lost workers are replaced while the others roll back (in-memory commits)."""
    what = "workers"
    """The workers in words, for messages."""
    in_words = ""
    """How a message names a run of this layout after what it does: `` with pipeline stages``."""
    units = "workers"
    """What the elastic group counts, in words: workers, or pipeline replicas."""
    unit_kind = "worker"
    """One unit in words, which its id starts with: ``worker-3``, ``replica-1``."""
    unit = 1
    """Workers lost together and replaced together (a pipeline replica's stages)."""

    def membership(self) -> Membership:
        """How the run's workers live through losing one (``engine.elastic.membership``)."""
        return Elastic(self.config) if self.elastic else Fixed(self.config)

    def worker_names(self, unit: str) -> list[str]:
        """The names of ``unit``'s workers: the unit's own, or one per pipeline stage."""
        return [unit] if self.unit == 1 else [f"{unit}-stage-{i}" for i in range(self.unit)]

    @property
    def lower(self) -> str:
        """What a message asks to lower when the cluster cannot place the workers."""
        return "workers"

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    @property
    def size(self) -> int:
        """How many workers (Ray actors) the layout has."""
        raise NotImplementedError

    def worker_cls(self) -> type:
        """The one worker class (``engine.worker.Worker``), whatever the layout."""
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

    def rewire(self, group: Workers, joined: list[list[int]]) -> None:
        """Rebuild the rings among the members after a change of membership, keeping their
        state; ``joined`` lists the positions of each unit that just joined."""
        raise NotImplementedError

    def peer_of(self, index: int, error: Exception) -> int | None:
        """The position of the worker that ``error`` (raised by worker ``index`` of a call)
        names as its lost peer, if it names one."""
        return getattr(error, "peer", None)

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

    def refuse(self, *, data: Any = None, init_from: str | None = None) -> None:
        """Refuse, before anything starts, the data or an option this layout would not
        honour.

        Raises:
            ValueError: in one line, naming every such option and why.
        """

    def called_hooks(self) -> frozenset[str]:
        """The module's hooks a run of this layout calls (the others are named in a warning)."""
        from ringflow.engine.module import CALLED_HOOKS

        return CALLED_HOOKS

    def attach_callbacks(self, callbacks: Any, group: Workers, *, loggers: bool) -> None:
        """Give Lightning's callbacks (``engine.callbacks.Callbacks``) what they reach in the
        workers: files written by rank 0, callbacks that read the optimizer run there."""
        callbacks.write_files_with(group)
        if callbacks.in_workers:
            group.call_rank0(Worker.add_callbacks, callbacks.in_workers, loggers=loggers)

    def prepare(
        self, module_cls: type, hparams: dict[str, Any], data: Any, *, module: torch.nn.Module
    ) -> None:
        """Check the model for this layout before any worker starts; ``module`` is the
        driver's copy of it."""
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

    def settle(self, group: Workers, *, wait: bool = False) -> None:
        """Commit checkpoints whose files are written (the driver asks after every chunk)."""

    def flush(self, group: Workers) -> list[str]:
        """Wait for checkpoints still being written; return their errors."""
        return []

    def model_state(self, group: Workers) -> dict[str, torch.Tensor]:
        """The whole model's weights, as CPU tensors."""
        raise NotImplementedError


class DataParallel(Layout):
    """``config.workers`` workers, each a whole replica; gradients averaged by the ring."""

    elastic = True

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        self._written = _WrittenShards(lambda group, method, *args: group.call(method, *args))
        """Sharded: the checkpoint whose shards every worker is writing."""

    @property
    def size(self) -> int:
        return self.config.workers

    def prepare(self, module_cls, hparams, data, *, module) -> None:
        from ringflow.engine.errors import ModelError
        from ringflow.engine.module import check_manual_optimisation, optimises_manually

        check_manual_optimisation(module, self.config, pipeline=False)
        if self.config.shard != "none" and optimises_manually(module):
            raise ModelError(
                f"shard={self.config.shard!r} does not compose with manual optimisation yet: "
                f"{module_cls.__name__} steps its own optimizers, which would step whole "
                "parameters; use shard='none'"
            )

    def worker_kwargs(self, index: int) -> dict[str, Any]:
        from ringflow.engine.data_parallel import WholeModel

        return {"rank": index, "plan": WholeModel()}

    def describe(self, index: int) -> str:
        return f"worker rank {index}"

    def connect(self, group: Workers) -> None:
        # One worker has no peers to meet (and may run where there is no Ray).
        init_method = group.call_rank0(Worker.addresses)[0] if self.size > 1 else ""
        group.call(Worker.connect, init_method)

    def rewire(self, group: Workers, joined: list[list[int]]) -> None:
        size = len(group.members)
        init_method = group.call_ranked(Worker.addresses, [()], [0])[0][0]
        group.call_each(Worker.reconfigure, [(rank, size, init_method) for rank in range(size)])

    def checkpoint(self, group, store_url, run_key, *, step, metadata, metrics) -> None:
        if self.config.shard != "none":
            # Every worker writes its own shard (``zero-{rank}``) in the background, nothing
            # gathered; the manifest follows once all are written (``settle``).
            self._written.settle(group, wait=True)
            parts = group.call(Worker.write_own_shard, store_url, run_key, step)
            optimizer = merge_sharded_optimizer_metadata([part["optimizer"] for part in parts])
            pieces = optimizer.pop("pieces")
            self._written.pending = _PendingCheckpoint(
                store_url,
                run_key,
                step=step,
                metadata={
                    **metadata,
                    "optimizer": optimizer,
                    "pieces": pieces,
                    "optimization": parts[0]["optimization"],  # every worker's alike
                    "module": parts[0]["module"],
                },
                metrics=metrics,
            )
            return
        # Rank 0 copies the replicated state to host memory and writes it in the background,
        # with each rank's communication hook state (PowerSGD's errors differ by rank).
        hooked = self.config.compression not in WIRE_FORMATS
        group.call_rank0(
            Worker.checkpoint,
            store_url,
            run_key,
            step=step,
            metadata=metadata,
            metrics=metrics,
            comm_states=group.call(Worker.comm_state) if hooked else None,
        )

    def settle(self, group: Workers, *, wait: bool = False) -> None:
        self._written.settle(group, wait=wait)

    def flush(self, group: Workers) -> list[str]:
        return group.call_rank0(Worker.flush_checkpoints)["errors"] + self._written.flush(group)

    def attach_callbacks(self, callbacks: Any, group: Workers, *, loggers: bool) -> None:
        super().attach_callbacks(callbacks, group, loggers=loggers)
        if self.config.shard != "none":  # every worker gathers the state rank 0 writes
            callbacks.write_files_with(_Everyone(group))

    def model_state(self, group: Workers) -> dict[str, torch.Tensor]:
        if self.config.shard == "parameters":  # every worker gathers them, rank 0 returns them
            return group.call(Worker.state_dict)[0]
        return group.call_rank0(Worker.state_dict)


class _Everyone:
    """``group``, whose calls for rank 0 go to every worker (sharded state: reading the whole
    weights or optimizer state is collective), rank 0's answer returned."""

    def __init__(self, group: Workers) -> None:
        self.group = group

    def call_rank0(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        return self.group.call(method, *args, **kwargs)[0]


class Pipeline(Layout):
    """``config.workers`` replicas of ``pipeline.stages`` stage workers each; worker
    ``replica * stages + stage`` runs that stage of that replica."""

    what = "stage workers"
    in_words = " with pipeline stages"
    units = "replicas"
    unit_kind = "replica"

    @property
    def lower(self) -> str:
        return "workers" if self.size == self.config.workers else f"workers, {self.what}"

    @property
    def unit(self) -> int:
        return self.pipeline.stages

    @property
    def elastic(self) -> bool:
        """On CPU a lost stage's replica leaves and the others go on; on GPUs the replicas
        share one NCCL world, which is not rebuilt around a lost one."""
        return not self.config.gpus_per_worker

    def __init__(self, config: TrainConfig, pipeline: PipelineConfig) -> None:
        super().__init__(config)
        self.pipeline = pipeline
        self.partition: Partition | None = None
        """Which layers each stage owns: decided by :meth:`prepare`."""
        self._written = _WrittenShards(
            lambda group, method, *args: group.call_first(pipeline.stages, method, *args)
        )
        """The checkpoint whose shards the stages are writing."""

    @property
    def size(self) -> int:
        return self.config.workers * self.pipeline.stages

    def prepare(self, module_cls, hparams, data, *, module) -> None:
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
        addresses = group.call(Worker.addresses)
        group.call_each(
            Worker.connect,
            [
                (addresses[i - i % stages][0], addresses[i % stages][1], addresses[0][0])
                for i in range(self.size)
            ],
        )

    def rewire(self, group: Workers, joined: list[list[int]]) -> None:
        """A replica that joined first links its stages; then each stage's ring is made
        again among the replicas, at replica 0's worker of that stage."""
        stages, size = self.pipeline.stages, len(group.members)
        for unit in joined:
            addresses = group.call_ranked(Worker.addresses, [()] * stages, unit)
            group.call_ranked(Worker.connect, [(addresses[0][0], "")] * stages, unit)
        rings = group.call_ranked(Worker.addresses, [()] * stages, list(range(stages)))
        group.call_each(
            Worker.reconfigure,
            [(i // stages, size // stages, rings[i % stages][1]) for i in range(size)],
        )

    def peer_of(self, index: int, error: Exception) -> int | None:
        """A link's error names a stage of the worker's replica, a ring's a replica of its
        stage (workers are replica-major)."""
        peer, op = getattr(error, "peer", None), str(getattr(error, "op", ""))
        if peer is None or op == "train_steps":
            return None
        replica, stage = divmod(index, self.pipeline.stages)
        if op.startswith("pipeline"):
            return replica * self.pipeline.stages + peer
        return peer * self.pipeline.stages + stage

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
        "bucket_mb": "pipeline stages reduce their gradients in one piece after the schedule; "
        "shard='optimizer' reduce-scatters them in buckets of this size",
        "timeline": "the timeline records data-parallel workers' steps",
        "sync_batchnorm": "a stage's BatchNorm layers normalise its replica's micro-batches",
    }
    _SHARDS = {
        "gradients": "a stage sums its gradients once a batch, after all its micro-batches",
        "parameters": "a stage would gather its weights again at every micro-batch",
    }
    _ON_GPUS = (
        "on GPUs the replicas share one NCCL world, which is not rebuilt around a lost one: "
        "a lost stage fails the run, and a retried run resumes from its last checkpoint"
    )

    def refuse(self, *, data: Any = None, init_from: str | None = None) -> None:
        if data is not None and not hasattr(data, "read"):
            raise ValueError(
                f"pipeline stages train on tables (a DataSpec or TensorData), not on "
                f"{type(data).__name__}; train a DataModule or Dataset without pipeline stages"
            )
        refused = self.refused(init_from=init_from)
        if refused:
            raise ValueError(
                f"with {self.pipeline.stages} pipeline stages these options are not supported: "
                + "; ".join(refused)
                + ". Leave them at their defaults or train without pipeline stages"
            )

    def called_hooks(self) -> frozenset[str]:
        # A stage holds part of the module: none of its hooks run there but the step's
        # (prepare_data runs in the driver).
        return frozenset({"prepare_data", "optimizer_step"})

    def attach_callbacks(self, callbacks: Any, group: Workers, *, loggers: bool) -> None:
        if callbacks.in_workers:
            raise ValueError(
                "LearningRateMonitor is not supported with pipeline stages: each stage "
                "holds its own optimizer"
            )

    def refused(self, *, init_from: str | None) -> list[str]:
        defaults = TrainConfig()
        unsupported = dict(self._UNSUPPORTED)
        if self.config.shard == "optimizer":  # reduce-scattered in buckets of that size
            del unsupported["bucket_mb"]
        if not self.elastic:
            unsupported.update(dict.fromkeys(("min_workers", "commit_every"), self._ON_GPUS))
        refused = [
            f"{name}={getattr(self.config, name)!r} ({why})"
            for name, why in unsupported.items()
            if getattr(self.config, name) != getattr(defaults, name)
        ]
        if self.config.shard in self._SHARDS:
            refused.append(
                f"shard={self.config.shard!r} ({self._SHARDS[self.config.shard]}: "
                "shard='optimizer' shards the optimizer state over a stage's replicas)"
            )
        if self.config.compression not in WIRE_FORMATS:
            refused.append(
                f"compression={self.config.compression!r} (a communication hook reduces "
                "data-parallel gradient buckets; pipeline stages reduce theirs in one piece)"
            )
        if self.config.batch_follows_workers:
            refused.append(
                f"per_worker_batch_size={self.config.per_worker_batch_size} with "
                f"min_workers={self.config.min_workers} (the global batch would follow the "
                "replicas; the stages keep one: give batch_size)"
            )
        return refused

    def checkpoint(self, group, store_url, run_key, *, step, metadata, metrics) -> None:
        # Replica 0's stages hold the whole state between them, one shard per stage: each
        # writes its own in the background, and the manifest follows once all are written
        # (at the next chunk's end, checkpoint or flush: ``settle``).
        # Sharded (ZeRO-1), every replica of a stage gathers its state with replica 0's.
        self._written.settle(group, wait=True)
        writes = (store_url, run_key, step)
        if self.config.shard == "none":
            stages = group.call_first(self.pipeline.stages, Worker.write_shard, *writes)
        else:
            stages = group.call(Worker.write_shard, *writes)[: self.pipeline.stages]
        self._written.pending = _PendingCheckpoint(
            store_url,
            run_key,
            step=step,
            metadata={
                **metadata,
                "optimizer": merge_optimizer_metadata([meta for meta, _ in stages]),
                "optimization": stages[0][1],  # every stage steps its schedulers alike
                "stages": len(stages),
            },
            metrics=metrics,
        )

    def settle(self, group: Workers, *, wait: bool = False) -> None:
        self._written.settle(group, wait=wait)

    def flush(self, group: Workers) -> list[str]:
        return self._written.flush(group)

    def model_state(self, group: Workers) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for part in group.call_first(self.pipeline.stages, Worker.state_dict):
            state.update(part)
        return state


@dataclass(frozen=True)
class _PendingCheckpoint:
    """A checkpoint whose manifest waits for its workers' shards."""

    store_url: str
    run_key: str
    step: int
    metadata: dict[str, Any]
    metrics: dict[str, float]


class _WrittenShards:
    """Checkpoints each of whose shards one worker writes in the background (a pipeline's
    stages, sharded data-parallel workers): the manifest is committed once every shard is
    written, manifest last. ``writers`` calls a worker method on the workers that write."""

    def __init__(self, writers: Callable[..., list[Any]]) -> None:
        self._writers = writers
        self.pending: _PendingCheckpoint | None = None
        """The checkpoint whose shards the workers are writing."""
        self._not_saved: list[str] = []

    def settle(self, group: Workers, *, wait: bool = False) -> None:
        """Commit the checkpoint whose shards the workers finished writing (``wait``: once
        they have); one whose shard could not be written is not committed, and said."""
        pending = self.pending
        if pending is None:
            return
        writes = self._writers(group, Worker.shard_written, pending.step, wait)
        states = {write["state"] for write in writes}
        if states == {"written"}:
            self.pending = None
            try:
                CheckpointStore(pending.store_url).commit(
                    pending.run_key,
                    step=pending.step,
                    shards=[write["record"] for write in writes],
                    metadata=pending.metadata,
                    metrics=pending.metrics,
                )
            except CheckpointStorageError as err:  # retried there; the previous stays latest
                self._not_saved.append(f"step {pending.step}: {err}")
        elif "writing" not in states:  # a write failed, or a worker that wrote one was lost
            self.pending = None
            errors = [
                w.get("error", "its worker was replaced") for w in writes if w["state"] != "written"
            ]
            self._not_saved.append(f"step {pending.step}: {'; '.join(errors)}")

    def flush(self, group: Workers) -> list[str]:
        """Wait for the shards still being written and commit them; the errors since the
        last flush."""
        self.settle(group, wait=True)
        not_saved, self._not_saved = self._not_saved, []
        return not_saved


def layout_of(config: TrainConfig, pipeline: PipelineConfig | None) -> Layout:
    """The layout a run asks for: ``Pipeline`` with a ``PipelineConfig`` (one stage is a
    replica of a layer sequence trained by the pipeline's schedule), else ``DataParallel``."""
    if pipeline is None:
        return DataParallel(config)
    return Pipeline(config, pipeline)
