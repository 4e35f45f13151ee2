"""What a pipeline stage's worker does that a data-parallel worker does not: it holds a
contiguous run of the model's layers, runs its part of every batch's micro-batches through
the schedule with its neighbouring stages, and sums its stage's gradients over the replicas
(``engine.worker.Worker`` runs it; ``engine.layout.Pipeline`` chooses it).

Everything else is the worker's, as for data-parallel training: precision, gradient
accumulation, clipping (by norm over the whole model's gradient: the stages sum their
squared norms), in-memory commits, checkpoints, evaluation and logging.

With ``TrainConfig.shard="optimizer"`` (ZeRO-1, as DeepSpeed's pipeline engine offers it)
each replica of a stage keeps the optimizer state of its shard of the stage's parameters
only: the stage's gradients are reduce-scattered over the replicas in buckets, each replica
steps its pieces (``engine.sharding.ShardedOptimizer``) and the stage's parameters are
all-gathered. Clipping by norm takes the stage's norm as ``shard="none"`` does, bit for bit,
then the stages' as ever. A commit keeps two shards of the stage's state, the replica's and
the next one's (``engine.sharded_commit``): a lost replica's shard lives on in its
neighbour's. A checkpoint holds the stage's whole state as under ``shard="none"`` (the
replicas gather it, replica 0 writes it), so it loads into any layout.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ringflow.engine.collective import Collective, GradientBuckets
from ringflow.engine.collective._rendezvous import tcp_store
from ringflow.engine.data import Samples
from ringflow.engine.metrics import Logged
from ringflow.engine.pipeline.config import PipelineConfig
from ringflow.engine.pipeline.data import SplitShape, first_rows, stage_split
from ringflow.engine.pipeline.execute import MicroBatches, run_forward, run_schedule
from ringflow.engine.pipeline.p2p import StageLink
from ringflow.engine.pipeline.partition import Partition
from ringflow.engine.pipeline.schedule import stage_actions
from ringflow.engine.pipeline.stage import PipelineStage
from ringflow.engine.sharded_commit import ShardedCommits
from ringflow.engine.sharding import ShardedOptimizer
from ringflow.engine.worker import Batch, free_address, split_global_batch
from ringflow.storage.reshard import load_pipeline_stage, stage_shard
from ringflow.storage.store import CheckpointStore, CommittedCheckpoint

if TYPE_CHECKING:
    from ringflow.engine.worker import Worker

__all__ = ["PipelineStep", "StagePlan", "pipeline_batch"]


def pipeline_batch(
    module: torch.nn.Module, features: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first stage's input and the loss target: ``module.pipeline_batch`` if defined."""
    hook = getattr(module, "pipeline_batch", None)
    return hook(features, labels) if callable(hook) else (features, labels)


@dataclass(frozen=True)
class StagePlan:
    """The plan of a pipeline worker: stage ``stage`` of ``partition``, scheduled as
    ``pipeline`` says; its worker's rank is its replica."""

    pipeline: PipelineConfig
    partition: Partition
    stage: int

    def build(self, worker: Worker) -> PipelineStep:
        return PipelineStep(worker, self)


class PipelineStep(ShardedCommits):
    """A pipeline stage's part of the training: ``Worker`` holds the rest."""

    calls_hooks = False
    """A stage holds part of the module: the module's own hooks and ``self.log`` are not
    called (``engine.trainer`` names those it defines)."""

    def __init__(self, worker: Worker, plan: StagePlan) -> None:
        self.worker, self.pipeline, self.partition = worker, plan.pipeline, plan.partition
        self.index = plan.stage
        self.shard = stage_shard(plan.stage)
        self.is_last = plan.stage == plan.partition.stages - 1
        # The first stage reads inputs, the last targets; the others only the split's layout,
        # which sets the global order as for data-parallel workers (engine.pipeline.data).
        self.reads_rows = plan.stage == 0 or self.is_last
        self.stage: PipelineStage | None = None
        self.link: StageLink | None = None
        self.collective: Collective | None = None
        self._ring_group: dist.ProcessGroup | None = None
        self._stores: list[dist.Store] = []
        self.shards = worker.config.shard == "optimizer"
        """Whether each replica of the stage keeps the optimizer state of its shard of the
        stage's parameters only (ZeRO-1; the other modes are refused, ``engine.layout``)."""
        self.buckets: GradientBuckets | None = None
        self.sharded: ShardedOptimizer | None = None
        self.weights = None  # ZeRO-3's sharded parameters: never on a pipeline

    def split(self, split: str) -> Samples | SplitShape:
        return stage_split(self.worker.data, split, reads_rows=self.reads_rows)

    def prepare(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cut this stage's layers out of the whole module (built alike on every stage, so
        they start from the unsplit model's weights) and move them to the device."""
        w = self.worker
        module = w.precision.convert_module(module)
        example, _ = pipeline_batch(module, *first_rows(w.data, 1))
        precision = w.precision
        self.stage = PipelineStage(
            module,
            partition=self.partition,
            stage=self.index,
            example=precision.convert_input(example),
            loss_fn=module.pipeline_loss if self.is_last else None,
            recompute=self.pipeline.recompute,
            device=w.device,
            context=precision.forward_context,
            scale=precision.scaler.scale if precision.scaler is not None else None,
        )
        return module

    # ------------------------------------------------------------------ membership

    def addresses(self) -> tuple[str, ...]:
        """Two ``tcp://host:port`` on this worker's node: one for its pipeline's store (used
        when this is stage 0), one for its stage's data-parallel ring (when replica 0)."""
        return free_address(), free_address()

    def connect(self, pipeline_address: str, ring_address: str, world_address: str = "") -> None:
        """Join this replica's pipeline, then this stage's data-parallel ring.

        On GPUs every worker of the run also joins one NCCL world through ``world_address``
        (replica 0's pipeline store), in which each pipeline and each stage's ring get NCCL
        groups of their own.
        """
        w = self.worker
        if self.link is not None:  # linked again after a stall: what was in flight is gone
            self.link.close()
            self.stage.drop_in_flight()
        store = tcp_store(pipeline_address, is_master=self.index == 0, timeout_s=w.config.timeout_s)
        self._stores.append(store)
        links, self._ring_group = self._nccl_groups(world_address or pipeline_address, store)
        gpu = {"backend": "nccl"} if w.device.type == "cuda" else {}
        self.link = StageLink(
            store=store,
            stage=self.index,
            stages=self.partition.stages,
            timeout_s=w.config.collective_timeout_s,
            connect_timeout_s=w.config.timeout_s,
            groups=links,
            **gpu,
        )
        self.join(ring_address)

    def join(self, ring_address: str, *, rejoin: bool = False) -> None:
        """Join this stage's ring over the replicas (the worker's rank and world size); a
        replica that joins a running group is given none at first (``Pipeline.rewire``).
        ``rejoin``: rebuilt among replicas that are all up (``Worker.ring``). Sharded, a
        ring of one replica too: its shard is the whole stage."""
        w = self.worker
        if not ring_address or (w.world_size == 1 and not self.shards):
            return  # a replica linked again keeps its ring until reconfigure()
        self.collective = w.ring(ring_address, group=self._ring_group, rejoin=rejoin)
        if self.shards:
            self.buckets = GradientBuckets(
                w.params,
                self.collective,
                bucket_bytes=int(w.config.bucket_mb * 2**20),
                hooks=False,  # the schedule's backward passes accumulate; reduced once
                scatter=True,
            )
            self.sharded = ShardedOptimizer(w.optimization.optimizer, self.buckets, self.collective)
            w.optimizer = self.sharded

    def reconfigure(self, ring_address: str = "") -> None:
        """Join this stage's new ring among the replicas left (the pipeline stays); sharded,
        the optimizer state is laid out anew (``ShardedCommits.lay_out_again``)."""
        carried = self.sharded.carry() if self.sharded is not None else []
        self.leave_ring()
        self.join(ring_address, rejoin=True)
        if self.sharded is not None:
            self.lay_out_again(carried, None)

    def _nccl_groups(
        self, world_address: str, pipeline_store: dist.Store
    ) -> tuple[tuple[dist.ProcessGroup, dist.ProcessGroup] | None, dist.ProcessGroup | None]:
        """On GPUs: this pipeline's two link groups and this stage's ring group (else Nones).

        Every worker of the run is one rank of a default NCCL group, replica-major; groups are
        made by every rank in the same order, as ``dist.new_group`` requires.
        """
        w = self.worker
        if w.device.type != "cuda":
            return None, None
        from ringflow.engine.collective._p2p import _survivable_nccl_errors

        stages, replicas, replica = self.partition.stages, w.world_size, w.rank
        if replica == 0:
            store = pipeline_store  # replica 0's stage 0 hosts it
        else:
            store = tcp_store(world_address, is_master=False, timeout_s=w.config.timeout_s)
            self._stores.append(store)
        # NCCL's own watchdog stays behind our deadlines (see engine.collective._p2p).
        timeout = dt.timedelta(seconds=max(w.config.timeout_s, w.config.collective_timeout_s) + 60)
        with _survivable_nccl_errors():
            dist.init_process_group(
                "nccl",
                store=dist.PrefixStore("world", store),
                rank=replica * stages + self.index,
                world_size=replicas * stages,
                timeout=timeout,
            )
            links: tuple = ()
            for r in range(replicas):
                ranks = [r * stages + s for s in range(stages)]
                made = tuple(dist.new_group(ranks, timeout=timeout) for _ in range(2))
                links = made if r == replica else links
            ring = None
            for s in range(stages):
                made = dist.new_group([r * stages + s for r in range(replicas)], timeout=timeout)
                ring = made if s == self.index else ring
        return links, ring

    # ------------------------------------------------------------------ training

    def train(self, batch: Batch) -> int:
        """This replica's part of one global batch through the schedule; the optimizer steps
        at the last batch of an accumulation window, on the gradients summed over the
        replicas (each micro-batch's loss weighted by its share of the global batch, and by
        1/``accumulate_grad_batches``, as a data-parallel worker weights its part).

        Returns:
            On the last stage, the samples of the batch (it records the loss); else 0.
        """
        assert self.link is not None, "connect() must run before training"
        w = self.worker
        if w.has_buffers:
            w.after_copies()
        scale = 1.0 if batch.window == 1 else 1.0 / batch.window
        micro = self._micro_batches(w.train, batch.mine, batch.global_size, scale=scale)
        if batch.opens_window:
            w.optimization.optimizer.zero_grad(set_to_none=False)
            if self.buckets is not None:  # the shards' partial sums of the last scatter too
                self.buckets.zero_()
        actions = stage_actions(
            self.pipeline.schedule,
            stage=self.index,
            stages=self.partition.stages,
            micro_batches=len(micro.sizes),
        )
        losses = run_schedule(self.stage, actions, link=self.link, micro=micro)
        if batch.steps:
            self._reduce_gradients()
            w.after_copies()
            across, whole_norm = self._across()
            w.optimization.step(
                batch.step,
                last=batch.last,
                clip_val=w.config.gradient_clip_val,
                clip_algorithm=w.config.gradient_clip_algorithm,
                across=across,
                whole_norm=whole_norm,
            )
            if self.sharded is not None:
                self.sharded.gather()
            w.trainer.global_step += 1
        if not self.is_last:
            return 0
        total = sum(loss * size for loss, size in zip(losses, micro.sizes, strict=True))
        w.metric_log.record("train_loss", total / len(batch.mine), len(batch.mine))
        return len(batch.mine)

    def _micro_batches(
        self,
        samples: Samples | SplitShape,
        mine: torch.Tensor,
        global_size: int,
        *,
        scale: float = 1.0,
    ) -> MicroBatches:
        """The micro-batches of this replica's samples ``mine``. The stages that read rows ask
        ``samples`` for all of ``mine`` at once (a stream hands over the batch it read ahead)
        and cut it; the others need only the sizes."""
        # Fewer samples than micro-batches (a short last batch): one sample per micro-batch.
        parts = torch.tensor_split(mine, min(self.pipeline.micro_batches, len(mine)))
        sizes = tuple(len(part) for part in parts)
        pairs = []
        if self.reads_rows:
            module, precision = self.worker.module, self.worker.precision
            x, y = samples.batch(mine)
            pairs = [
                precision.convert_input(pipeline_batch(module, *part))
                for part in zip(torch.split(x, sizes), torch.split(y, sizes), strict=True)
            ]
        return MicroBatches(
            sizes=sizes,
            inputs=[first for first, _ in pairs] if self.index == 0 else None,
            targets=[target for _, target in pairs] if self.is_last else None,
            weights=tuple(size / global_size * scale for size in sizes),
        )

    def _across(self) -> tuple[Any, Any]:
        """What the optimizer step sums over the workers holding the model's other parts
        (``Optimization.step``'s ``across``), and the whole model's gradient norm
        (``whole_norm``): the other stages; sharded, this stage's other replicas first, and
        where clipping by norm may clip, the norm ``shard="none"`` takes, bit for bit
        (``ShardedOptimizer.norm_across``)."""
        stages = self.link.sum_over_stages if self.partition.stages > 1 else None
        sharded = self.sharded
        if sharded is None:
            return stages, None

        def across(tensor: torch.Tensor) -> torch.Tensor:
            summed = sharded.sum_across(tensor)
            return summed if stages is None else stages(summed)

        config = self.worker.config
        if config.gradient_clip_val is None or config.gradient_clip_algorithm != "norm":
            return across, None
        whole_norm = functools.partial(
            sharded.norm_across, clip_val=config.gradient_clip_val, then=stages
        )
        return across, whole_norm

    def _reduce_gradients(self) -> None:
        """Sum this stage's gradients over the replicas (each already weighted by its share);
        sharded, reduce-scatter them: each replica holds the sums of its shard, which its
        pieces' gradients view (``ShardedOptimizer.attach_grads``)."""
        if self.buckets is not None:
            self.buckets.start()
            self.buckets.finish()
            self.sharded.attach_grads()
            return
        params = self.worker.params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.collective is None:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.collective.allreduce_(flat, op="sum")
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    # ------------------------------------------------------------------ evaluation, state

    def evaluate(self, split: str, samples: Samples | SplitShape) -> Logged:
        """Forward this replica's part of ``split`` through the pipeline; the last stage
        returns ``val_loss`` (``{split}_loss`` for other splits) and ``pipeline_metrics``."""
        assert self.link is not None, "connect() must run before evaluating"
        w = self.worker
        mine = split_global_batch(torch.arange(len(samples)), rank=w.rank, world_size=w.world_size)
        prefix = "val" if split == "validation" else split
        sums: dict[str, float] = defaultdict(float)
        for start in range(0, len(mine), w.config.batch_size):
            micro = self._micro_batches(samples, mine[start : start + w.config.batch_size], 1)
            outputs = run_forward(self.stage, link=self.link, micro=micro)
            for out, target in zip(outputs, micro.targets or [], strict=True):
                for name, value in self._metrics(out, target.to(out.device)).items():
                    sums[f"{prefix}_{name}"] += value * len(out)
        return Logged.means(dict(sums), len(mine)) if self.is_last else Logged()

    @torch.no_grad()
    def _metrics(self, out: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        module = self.worker.module
        with self.worker.precision.forward_context():
            values = {"loss": float(module.pipeline_loss(out, target))}
            extra = getattr(module, "pipeline_metrics", None)
            if callable(extra):
                values.update({k: float(v) for k, v in extra(out, target).items()})
        return values

    def own(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What of a whole model's ``state`` this stage holds: its layers' tensors."""
        return {name: state[name] for name in self.worker.module.state_dict() if name in state}

    def load(self, store: CheckpointStore, checkpoint: CommittedCheckpoint) -> dict[str, Any]:
        """This stage's tensors of a pipeline checkpoint, whatever number of stages wrote it
        (``storage.reshard.load_pipeline_stage``)."""
        names = self.worker.module.state_dict().keys()
        return load_pipeline_stage(store, checkpoint, names=names)

    def transport(self) -> str | None:
        return None if self.collective is None else getattr(self.collective, "transport", None)

    @property
    def writes(self) -> bool:
        """Whether this worker writes its stage's shard of a checkpoint: replica 0's does
        (sharded, the other replicas gather the stage's state with it)."""
        return self.worker.rank == 0

    def close(self) -> None:
        self.leave_ring()
        if self.link is not None:
            self.link.close()
            self.link = None
        if dist.is_initialized() and self.worker.device.type == "cuda":
            dist.destroy_process_group()
        self._stores = []
