"""One pipeline stage of one data-parallel replica: its layers, optimizer, links and data.

The same class runs in a Ray actor (``engine.fit`` with a ``PipelineConfig``) or in a thread
of the caller's process (``in_process=True``). Every worker is called with the same methods in
the same order.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from ringflow.engine.collective import Collective, create_collective
from ringflow.engine.collective._rendezvous import tcp_store
from ringflow.engine.config import DataSpec, TensorData, TrainConfig
from ringflow.engine.data import Samples
from ringflow.engine.metrics import Logged
from ringflow.engine.module import Optimization
from ringflow.engine.pipeline.config import PipelineConfig
from ringflow.engine.pipeline.data import SplitShape, first_rows, stage_split
from ringflow.engine.pipeline.execute import MicroBatches, run_forward, run_schedule
from ringflow.engine.pipeline.p2p import StageLink
from ringflow.engine.pipeline.partition import Partition
from ringflow.engine.pipeline.schedule import stage_actions
from ringflow.engine.pipeline.stage import PipelineStage
from ringflow.engine.worker import (
    collectives_succeeded,
    epoch_batches,
    free_address,
    split_global_batch,
    worker_device,
)
from ringflow.storage.reshard import load_pipeline_stage, load_training_state, training_state
from ringflow.storage.store import CheckpointStore, CommittedCheckpoint

__all__ = ["PipelineWorker", "pipeline_batch"]


def pipeline_batch(
    module: torch.nn.Module, features: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first stage's input and the loss target: ``module.pipeline_batch`` if defined."""
    hook = getattr(module, "pipeline_batch", None)
    return hook(features, labels) if callable(hook) else (features, labels)


class PipelineWorker:
    """Trains stage ``stage`` of pipeline replica ``replica``.

    Args:
        module_cls: the user's module class (a layer sequence with ``pipeline_loss``).
        hparams: keyword arguments for ``module_cls``.
        data: the dataset.
        config: the run's engine configuration (``workers`` is the number of replicas).
        pipeline: stages, micro-batches, schedule.
        partition: the layers of every stage, decided once by the caller.
        replica: this worker's data-parallel replica.
        stage: this worker's stage.
    """

    def __init__(
        self,
        module_cls: type[torch.nn.Module],
        *,
        hparams: dict[str, Any],
        data: DataSpec | TensorData,
        config: TrainConfig,
        pipeline: PipelineConfig,
        partition: Partition,
        replica: int,
        stage: int,
    ) -> None:
        torch.set_num_threads(max(1, int(config.cpus_per_worker)))
        self.device = worker_device(config)
        self.config, self.pipeline, self.data = config, pipeline, data
        self.replica, self.replicas = replica, config.workers
        torch.manual_seed(config.seed)  # every stage builds the unsplit model's weights
        self.module = module_cls(**hparams)
        last = stage == partition.stages - 1
        # The first stage reads inputs, the last targets; the others only the split's layout,
        # which sets the global order as for data-parallel workers (engine.pipeline.data).
        self.reads_rows = stage == 0 or last
        self.train = stage_split(data, "train", reads_rows=self.reads_rows)
        self._evaluated: dict[str, Samples | SplitShape] = {}
        example, _ = pipeline_batch(self.module, *first_rows(data, 1))
        self.stage = PipelineStage(
            self.module,
            partition=partition,
            stage=stage,
            example=example,
            loss_fn=self.module.pipeline_loss if last else None,
            recompute=pipeline.recompute,
            device=self.device,
        )
        self.optimization = Optimization(self.module)
        self.optimizer = self.optimization.optimizer
        self.params = self.stage.parameters()
        self.link: StageLink | None = None
        self.collective: Collective | None = None
        self._stores: list[dist.Store] = []

    # ------------------------------------------------------------------ connecting

    def rendezvous_addresses(self) -> tuple[str, str]:
        """Two ``tcp://host:port`` on this worker's node: one for its pipeline's store (used
        when this is stage 0), one for its stage's data-parallel ring (when replica 0)."""
        return free_address(), free_address()

    def connect(self, pipeline_address: str, ring_address: str, world_address: str = "") -> None:
        """Join this replica's pipeline, then this stage's data-parallel ring.

        On GPUs every worker of the run also joins one NCCL world through ``world_address``
        (replica 0's pipeline store), in which each pipeline and each stage's ring get NCCL
        groups of their own.
        """
        store = tcp_store(
            pipeline_address, is_master=self.stage.is_first, timeout_s=self.config.timeout_s
        )
        self._stores.append(store)
        links, ring = self._nccl_groups(world_address or pipeline_address, store)
        gpu = {"backend": "nccl"} if self.device.type == "cuda" else {}
        self.link = StageLink(
            store=store,
            stage=self.stage.stage,
            stages=self.stage.stages,
            timeout_s=self.config.collective_timeout_s,
            connect_timeout_s=self.config.timeout_s,
            groups=links,
            **gpu,
        )
        if self.replicas > 1:
            if gpu:
                gpu["group"] = ring
                if self.config.collective == "ring":
                    gpu["transport"] = self.config.ring_transport
            self.collective = create_collective(
                self.config.collective,
                rank=self.replica,
                world_size=self.replicas,
                init_method=ring_address,
                timeout_s=self.config.collective_timeout_s,
                connect_timeout_s=self.config.timeout_s,
                compression=self.config.compression,
                **gpu,
            )

    def _nccl_groups(
        self, world_address: str, pipeline_store: dist.Store
    ) -> tuple[tuple[dist.ProcessGroup, dist.ProcessGroup] | None, dist.ProcessGroup | None]:
        """On GPUs: this pipeline's two link groups and this stage's ring group (else Nones).

        Every worker of the run is one rank of a default NCCL group, replica-major; groups are
        made by every rank in the same order, as ``dist.new_group`` requires.
        """
        if self.device.type != "cuda":
            return None, None
        from ringflow.engine.collective._p2p import _survivable_nccl_errors

        stages, replicas = self.stage.stages, self.replicas
        if self.replica == 0:
            store = pipeline_store  # replica 0's stage 0 hosts it
        else:
            store = tcp_store(world_address, is_master=False, timeout_s=self.config.timeout_s)
            self._stores.append(store)
        # NCCL's own watchdog stays behind our deadlines (see engine.collective._p2p).
        timeout = dt.timedelta(
            seconds=max(self.config.timeout_s, self.config.collective_timeout_s) + 60
        )
        with _survivable_nccl_errors():
            dist.init_process_group(
                "nccl",
                store=dist.PrefixStore("world", store),
                rank=self.replica * stages + self.stage.stage,
                world_size=replicas * stages,
                timeout=timeout,
            )
            links: tuple = ()
            for r in range(replicas):
                ranks = [r * stages + s for s in range(stages)]
                made = tuple(dist.new_group(ranks, timeout=timeout) for _ in range(2))
                links = made if r == self.replica else links
            ring = None
            for s in range(stages):
                made = dist.new_group([r * stages + s for r in range(replicas)], timeout=timeout)
                ring = made if s == self.stage.stage else ring
        return links, ring

    # ------------------------------------------------------------------ training

    def train_steps(self, epoch: int, first: int, count: int) -> Logged:
        """Run steps ``first .. first + count - 1`` of ``epoch`` (``engine.worker.epoch_batches``:
        the global batches a data-parallel worker sees).

        Returns:
            On the last stage, the loss summed over its samples and their count; elsewhere
            nothing (the driver averages over the last stages).
        """
        total, samples = 0.0, 0
        for step, mine, global_size in epoch_batches(
            self.train,
            self.config,
            epoch=epoch,
            first=first,
            count=count,
            rank=self.replica,
            world_size=self.replicas,
            device=self.device,
        ):
            total += self.train_step(mine, global_size=global_size)
            self.optimization.step(
                step,
                last=step == self.epoch_steps() - 1,
                clip_val=self.config.gradient_clip_val,
                clip_algorithm=self.config.gradient_clip_algorithm,
            )
            samples += len(mine)
        collectives_succeeded(self.collective, self.device)  # none aborted after its wait
        if not self.stage.is_last:
            return Logged()
        return Logged.means({"train_loss": total}, samples)

    def train_step(self, mine: torch.Tensor, *, global_size: int) -> float:
        """The gradients of this replica's samples ``mine`` of a global batch, summed over the
        replicas (the optimizer steps after it: ``train_steps``).

        Returns:
            On the last stage, the loss summed over ``mine`` (0.0 elsewhere).
        """
        assert self.link is not None, "connect() must run before training"
        micro = self._micro_batches(self.train, mine, global_size)
        self.optimizer.zero_grad(set_to_none=False)
        actions = stage_actions(
            self.pipeline.schedule,
            stage=self.stage.stage,
            stages=self.stage.stages,
            micro_batches=len(micro.sizes),
        )
        losses = run_schedule(self.stage, actions, link=self.link, micro=micro)
        self._reduce_gradients()
        if not self.stage.is_last:
            return 0.0
        return sum(loss * size for loss, size in zip(losses, micro.sizes, strict=True))

    def _micro_batches(
        self, samples: Samples | SplitShape, mine: torch.Tensor, global_size: int
    ) -> MicroBatches:
        """The micro-batches of this replica's samples ``mine``. The stages that read rows ask
        ``samples`` for all of ``mine`` at once (a stream hands over the batch it read ahead)
        and cut it; the others need only the sizes."""
        # Fewer samples than micro-batches (a short last batch): one sample per micro-batch.
        parts = torch.tensor_split(mine, min(self.pipeline.micro_batches, len(mine)))
        sizes = tuple(len(part) for part in parts)
        pairs = []
        if self.reads_rows:
            x, y = samples.batch(mine)
            pairs = [
                pipeline_batch(self.module, *part)
                for part in zip(torch.split(x, sizes), torch.split(y, sizes), strict=True)
            ]
        return MicroBatches(
            sizes=sizes,
            inputs=[first for first, _ in pairs] if self.stage.is_first else None,
            targets=[target for _, target in pairs] if self.stage.is_last else None,
            weights=tuple(size / global_size for size in sizes),
        )

    def _reduce_gradients(self) -> None:
        """Sum this stage's gradients over the replicas (each already weighted by its share)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.collective is None:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.collective.allreduce_(flat, op="sum")
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    # ------------------------------------------------------------------ evaluation, state

    def evaluate(self, split: str) -> Logged:
        """Forward this replica's part of ``split`` through the pipeline; the last stage
        returns ``val_loss`` (``{split}_loss`` for other splits) and ``pipeline_metrics``."""
        assert self.link is not None, "connect() must run before evaluating"
        if split not in self._evaluated:  # opened once: evaluation runs every epoch
            self._evaluated[split] = stage_split(self.data, split, reads_rows=self.reads_rows)
        samples = self._evaluated[split]
        mine = split_global_batch(
            torch.arange(len(samples)), rank=self.replica, world_size=self.replicas
        )
        prefix = "val" if split == "validation" else split
        sums: dict[str, float] = defaultdict(float)
        for start in range(0, len(mine), self.config.batch_size):
            micro = self._micro_batches(samples, mine[start : start + self.config.batch_size], 1)
            outputs = run_forward(self.stage, link=self.link, micro=micro)
            for out, target in zip(outputs, micro.targets or [], strict=True):
                for name, value in self._metrics(out, target.to(out.device)).items():
                    sums[f"{prefix}_{name}"] += value * len(out)
        return Logged.means(dict(sums), len(mine)) if self.stage.is_last else Logged()

    @torch.no_grad()
    def _metrics(self, out: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        values = {"loss": float(self.module.pipeline_loss(out, target))}
        extra = getattr(self.module, "pipeline_metrics", None)
        if callable(extra):
            values.update({k: float(v) for k, v in extra(out, target).items()})
        return values

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's module tensors under their full names."""
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def training_state(
        self,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """This stage's model and optimizer state by full name, for ``pipeline_shards``, and
        its schedulers' states."""
        tensors, metadata = training_state(self.module, self.optimizer)
        tensors = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        return tensors, metadata, self.optimization.state_dict()

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        """After epoch ``epoch``'s validation: step the schedulers that wait for its metrics."""
        self.optimization.after_validation(epoch, metrics)

    # A pipeline stage holds part of a module: the module's own hooks and ``self.log`` are
    # not called (``engine.layout.Pipeline`` names what it does not honour).
    def fit_start(self) -> None:
        pass

    def fit_end(self, epochs: int) -> None:
        pass

    def train_epoch_end(self, epoch: int) -> Logged:
        return Logged()

    def epoch_steps(self) -> int:
        """Steps (global batches) in one epoch of the training split."""
        return -(-len(self.train) // self.config.batch_size)

    def restore(self, store_url: str, checkpoint: CommittedCheckpoint) -> None:
        """Load this stage's model and optimizer state from a pipeline checkpoint, whatever
        number of stages wrote it (``storage.reshard.load_pipeline_stage``)."""
        store = CheckpointStore(store_url)
        tensors = load_pipeline_stage(store, checkpoint, names=self.module.state_dict().keys())
        load_training_state(self.module, self.optimizer, tensors, checkpoint.metadata["optimizer"])
        self.optimization.load_state_dict(checkpoint.metadata.get("optimization", {}))

    def peak_in_flight(self) -> int:
        return self.stage.peak_in_flight

    def close(self) -> None:
        for samples in (self.train, *self._evaluated.values()):
            if hasattr(samples, "close"):  # a stream's reading thread
                samples.close()
        if self.collective is not None:
            self.collective.close()
            self.collective = None
        if self.link is not None:
            self.link.close()
            self.link = None
        if dist.is_initialized() and self.device.type == "cuda":
            dist.destroy_process_group()
        self._stores = []
