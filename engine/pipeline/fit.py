"""``fit_pipeline``: pipeline-parallel (optionally times data-parallel) training on Ray actors."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ringflow.engine.config import PLACEMENTS, DataSpec, TrainConfig
from ringflow.engine.errors import EngineError, PeerLostError, WorkerFailedError
from ringflow.engine.group import _check_capacity, _describe, _worker_bundle
from ringflow.engine.pipeline.config import PipelineConfig
from ringflow.engine.pipeline.partition import Partition, model_layers, partition_model
from ringflow.engine.pipeline.worker import PipelineWorker, TensorData, pipeline_batch, read_tensors
from ringflow.engine.spec import build_module
from ringflow.engine.trainer import (
    EpochCallback,
    EpochMetrics,
    FitResult,
    _fmt,
    _mean,
    find_checkpoint,
    resumed_events,
    run_meta,
)
from ringflow.engine.worker import NOSET_VISIBLE_DEVICES
from ringflow.storage.checkpoint import save_model
from ringflow.storage.reshard import merge_optimizer_metadata, pipeline_shards
from ringflow.storage.store import CheckpointStore, CommittedCheckpoint

__all__ = ["check_pipeline", "fit_pipeline"]

log = logging.getLogger("ringflow.engine.pipeline")


def fit_pipeline(
    module_cls: type[torch.nn.Module],
    *,
    hparams: dict[str, Any],
    data: DataSpec | TensorData,
    config: TrainConfig,
    pipeline: PipelineConfig,
    checkpoint_uri: str,
    on_epoch: EpochCallback | None = None,
    meta: dict[str, Any] | None = None,
    in_process: bool = False,
    store_url: str | None = None,
    run_key: str | None = None,
) -> FitResult:
    """Train ``module_cls(**hparams)`` cut into ``pipeline.stages`` stages, replicated
    ``config.workers`` times (data parallel over the replicas).

    Each global batch of ``config.batch_size`` samples is split across the replicas as
    ``engine.fit`` splits it across workers, then into ``pipeline.micro_batches`` micro-batches
    per replica; every stage's gradients are summed over its replicas through
    ``config.collective``. The result does not depend on the number of stages or replicas.

    Args:
        module_cls: a layer sequence (``pipeline_layers()`` or ``nn.Sequential``) with
            ``pipeline_loss(output, target)`` and ``configure_optimizers()``; see
            docs/pipeline.md.
        hparams: keyword arguments for ``module_cls``.
        data: the preprocessed dataset, or ``TensorData``.
        config: replicas (``workers``), epochs, global batch, seed, collective, deadlines;
            every stage actor reserves ``cpus_per_worker`` CPUs (fractions allowed).
        pipeline: stages, micro-batches, schedule, balance, recompute.
        checkpoint_uri: where the trained whole model is committed (``save_model``).
        on_epoch: called after every epoch with its metrics.
        meta: extra JSON metadata recorded in the checkpoint.
        in_process: run the stages as threads of this process (one replica only).
        store_url: a checkpoint store: the whole training state (every stage's weights and
            optimizer state, one shard per stage) is committed there at every epoch end,
            and a run whose ``run_key`` has a checkpoint resumes after its epoch, bit for
            bit with the same layout (any number of stages can load it).
        run_key: the name checkpoints are kept under (needed with ``store_url``).

    Returns:
        The checkpoint URL, per-epoch metrics (``train_loss``, ``val_loss``, ...) and the
        whole model's final weights.

    Raises:
        ValueError: bad input, found before any worker starts (see ``check_pipeline``).
        WorkerFailedError: a stage died or raised; names the replica and stage.
    """
    partition = check_pipeline(
        module_cls, hparams=hparams, data=data, config=config, pipeline=pipeline
    )
    resume = _EpochResume.find(module_cls, hparams, data, config, store_url, run_key)
    group_cls = _ThreadGroup if in_process else _RayGroup
    group = group_cls(
        module_cls,
        hparams=hparams,
        data=data,
        config=config,
        pipeline=pipeline,
        partition=partition,
    )
    history: list[EpochMetrics] = list(resume.history)
    try:
        resume.steps_per_epoch = group.call_replica0("epoch_steps")[0]
        if resume.checkpoint is not None:
            group.call("restore", resume.store.url, resume.checkpoint)
            log.info("run %s resumes after epoch %d", run_key, len(history))
        for epoch in range(len(history), config.epochs):
            started = time.perf_counter()
            metrics = _mean(group.call("train_epoch", epoch))
            metrics.update(_mean(group.call("evaluate", "validation")))
            history.append(
                EpochMetrics(epoch=epoch, metrics=metrics, seconds=time.perf_counter() - started)
            )
            log.info("epoch %d/%d %s", epoch + 1, config.epochs, _fmt(metrics))
            resume.commit(group.call_replica0("training_state"), history)
            if on_epoch is not None:
                on_epoch(history[-1])
        state = {}
        for part in group.call_replica0("state_dict"):
            state.update(part)
    finally:
        group.shutdown()
    module = module_cls(**hparams)
    module.load_state_dict(state, strict=True)
    uri = save_model(
        checkpoint_uri,
        module,
        hparams=hparams,
        metrics=history[-1].metrics,
        meta={
            **run_meta(config, data),
            "pipeline_stages": pipeline.stages,
            "micro_batches": pipeline.micro_batches,
            "schedule": pipeline.schedule,
            "partition": [list(partition.layers_of(s)) for s in range(partition.stages)],
            **(meta or {}),
        },
    )
    return FitResult(
        checkpoint=uri,
        history=history,
        metrics=history[-1].metrics,
        state_dict=state,
        resumed_from=resume.checkpoint.step if resume.checkpoint is not None else None,
        events=resumed_events(run_key, resume.checkpoint),
    )


@dataclass
class _EpochResume:
    """A pipeline run's checkpoints: committed at epoch ends, read back when it starts."""

    store: CheckpointStore | None = None
    run_key: str = ""
    fingerprint: dict[str, Any] = field(default_factory=dict)
    checkpoint: CommittedCheckpoint | None = None
    history: list[EpochMetrics] = field(default_factory=list)
    steps_per_epoch: int = 1
    """Checkpoints are numbered by training step, as ``engine.fit`` numbers them."""

    @classmethod
    def find(
        cls,
        module_cls: type,
        hparams: dict[str, Any],
        data: DataSpec | TensorData,
        config: TrainConfig,
        store_url: str | None,
        run_key: str | None,
    ) -> _EpochResume:
        """Check the store is writable and read its newest checkpoint of ``run_key``.

        Raises:
            ValueError: no ``run_key``, or its checkpoint was written by another model,
                hyperparameters, seed, batch or dataset.
        """
        if store_url is None:
            return cls()
        store, fingerprint, latest = find_checkpoint(
            module_cls,
            hparams,
            config,
            store_url,
            run_key,
            dataset_url=getattr(data, "dataset_url", "tensors"),
            pipeline=True,
        )
        resume = cls(store=store, run_key=run_key, fingerprint=fingerprint)
        if latest is None:
            return resume
        resume.checkpoint = latest
        resume.history = [EpochMetrics(**entry) for entry in latest.metadata["history"]]
        return resume

    def commit(
        self,
        stages: list[tuple[dict[str, torch.Tensor], dict[str, Any]]],
        history: list[EpochMetrics],
    ) -> None:
        """Commit every stage's state after the last epoch of ``history``."""
        if self.store is None:
            return
        self.store.save(
            self.run_key,
            step=len(history) * self.steps_per_epoch,
            shards=pipeline_shards([tensors for tensors, _ in stages]),
            metadata={
                "fingerprint": self.fingerprint,
                "history": [dataclasses.asdict(entry) for entry in history],
                "optimizer": merge_optimizer_metadata([meta for _, meta in stages]),
                "stages": len(stages),
            },
            metrics=history[-1].metrics,
        )


def check_pipeline(
    module_cls: type[torch.nn.Module],
    *,
    hparams: dict[str, Any],
    data: DataSpec | TensorData,
    config: TrainConfig,
    pipeline: PipelineConfig,
) -> Partition:
    """Check everything that can be checked before a worker starts; return the partition.

    Raises:
        ValueError: hparams the module refuses, a module that is not a layer sequence or has
            no ``pipeline_loss``, more stages than layers, bad split points, or a global batch
            too small for ``micro_batches`` micro-batches on each of ``workers`` replicas.
    """
    if config.batch_size < pipeline.micro_batches * config.workers:
        raise ValueError(
            f"batch_size ({config.batch_size}) is smaller than micro_batches "
            f"({pipeline.micro_batches}) x replicas (workers={config.workers}): a micro-batch "
            "would be empty; raise batch_size or lower micro_batches"
        )
    module = build_module(module_cls, hparams)
    for hook in ("pipeline_loss", "configure_optimizers"):
        if not callable(getattr(module, hook, None)):
            raise ValueError(f"{module_cls.__name__} must define {hook}() to train as a pipeline")
    model_layers(module)  # not a layer sequence: say so before profiling anything
    example = None
    if pipeline.balance == "time":
        x, y = read_tensors(data, "train")
        size = max(1, config.batch_size // (config.workers * pipeline.micro_batches))
        example, _ = pipeline_batch(module, x[:size], y[:size])
    return partition_model(module, pipeline, example=example)


class _ThreadGroup:
    """Every stage of one replica as a thread of this process (real gloo links on loopback).

    For tests and debugging: the stages share torch's random generator, so a model with
    dropout draws other masks than it would in separate processes.
    """

    def __init__(self, module_cls: type, *, config: TrainConfig, **kwargs: Any) -> None:
        if config.workers != 1:
            raise ValueError(f"in_process runs exactly 1 replica (workers=1), got {config.workers}")
        if config.gpus_per_worker:
            raise ValueError(
                "in_process runs the stages as threads on CPU: set gpus_per_worker=0, or run "
                "GPU stages as Ray actors (in_process=False)"
            )
        stages = kwargs["partition"].stages
        self._pool = concurrent.futures.ThreadPoolExecutor(stages, "ringflow-stage")
        # One at a time: the workers seed torch's generator, which threads share.
        self._workers = [
            PipelineWorker(module_cls, config=config, replica=0, stage=s, **kwargs)
            for s in range(stages)
        ]
        try:
            pipeline_address, _ = self._workers[0].rendezvous_addresses()
            self.call("connect", pipeline_address, "")
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, *args: Any) -> list[Any]:
        return self._gather([self._pool.submit(getattr(w, method), *args) for w in self._workers])

    def call_replica0(self, method: str, *args: Any) -> list[Any]:
        return self.call(method, *args)

    @staticmethod
    def _gather(futures: list[concurrent.futures.Future]) -> list[Any]:
        errors = [f.exception() for f in futures]
        failed = [(s, e) for s, e in enumerate(errors) if e is not None]
        if failed:
            # Prefer the stage that failed by itself over its neighbours that then lost it.
            stage, err = next(
                ((s, e) for s, e in failed if not isinstance(e, PeerLostError)), failed[0]
            )
            raise WorkerFailedError(
                f"pipeline stage {stage} raised {type(err).__name__}: {err}", rank=stage
            ) from err
        return [f.result() for f in futures]

    def shutdown(self) -> None:
        for worker in getattr(self, "_workers", []):
            worker.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _RayGroup:
    """``workers`` x ``stages`` Ray actors, placed together or not at all.

    Actor ``replica * stages + stage`` runs that stage of that replica.
    """

    def __init__(
        self, module_cls: type, *, config: TrainConfig, pipeline: PipelineConfig, **kwargs: Any
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._stages, count = pipeline.stages, pipeline.stages * config.workers
        _check_capacity(config, count=count, what="stage workers", lower="workers, stages")
        self._pg = placement_group(
            [_worker_bundle(config)] * count, strategy=PLACEMENTS[config.placement]
        )
        try:
            ray.get(self._pg.ready(), timeout=config.timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._pg)
            raise EngineError(
                f"Ray could not place {count} stage workers of {_describe(config)} "
                f"within {config.timeout_s:.0f} s; free resources, lower workers or stages, "
                "or raise timeout_s"
            ) from None
        env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        if config.gpus_per_worker:
            env[NOSET_VISIBLE_DEVICES] = "1"  # each stage on its own GPU index (worker_device)
        actor = ray.remote(PipelineWorker)
        self._actors = [
            actor.options(
                num_cpus=config.cpus_per_worker,
                num_gpus=config.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i
                ),
                runtime_env={"env_vars": env} if _single_node() else None,
            ).remote(
                module_cls,
                config=config,
                pipeline=pipeline,
                replica=i // self._stages,
                stage=i % self._stages,
                **kwargs,
            )
            for i in range(count)
        ]
        try:
            addresses = self._get([a.rendezvous_addresses.remote() for a in self._actors])
            self._get(
                [
                    a.connect.remote(
                        addresses[i - i % self._stages][0],
                        addresses[i % self._stages][1],
                        addresses[0][0],
                    )
                    for i, a in enumerate(self._actors)
                ]
            )
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, *args: Any) -> list[Any]:
        return self._get([getattr(a, method).remote(*args) for a in self._actors])

    def call_replica0(self, method: str, *args: Any) -> list[Any]:
        actors = self._actors[: self._stages]
        return self._get([getattr(a, method).remote(*args) for a in actors])

    def _get(self, refs: list) -> list[Any]:
        """Results in order; the first call to fail (usually the cause) is raised at once.

        A stage that saw its neighbour vanish (``PeerLostError``) may report before Ray has
        noticed the neighbour's death: then the others get a moment to fail too, and a
        stage that died is named rather than the one that saw it.
        """
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as err:
                index, err = refs.index(done[0]), err
                if _saw_a_peer_lost(err) and pending:
                    index, err = self._died_meanwhile(refs, pending) or (index, err)
                raise self._failure(index, err) from err
        return ray.get(refs)

    def _died_meanwhile(self, refs: list, pending: list) -> tuple[int, Exception] | None:
        import ray

        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=_DEATH_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                return refs.index(ref), err
            except ray.exceptions.RayError:
                continue
        return None

    def _failure(self, index: int, err: Exception) -> WorkerFailedError:
        import ray

        where = f"replica {index // self._stages} stage {index % self._stages}"
        if isinstance(err, ray.exceptions.RayTaskError):
            cause = err.cause
            return WorkerFailedError(f"{where} raised {type(cause).__name__}: {cause}", rank=index)
        return WorkerFailedError(f"{where} died: {err}", rank=index)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in getattr(self, "_actors", []):
            ray.kill(a)
        remove_placement_group(self._pg)


_DEATH_GRACE_S = 5.0
"""How long a neighbour's loss waits for Ray to report the lost stage's death."""


def _saw_a_peer_lost(err: Exception) -> bool:
    return isinstance(getattr(err, "cause", None), PeerLostError)


def _single_node() -> bool:
    import ray

    return len([n for n in ray.nodes() if n["Alive"]]) == 1
