"""What a data-parallel worker does that a pipeline stage does not: it holds the whole model,
reduces every gradient over the ring in buckets while backward runs, and steps the optimizer
on the averaged gradients (``engine.worker.Worker`` runs it; ``engine.layout.DataParallel``
chooses it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ringflow.engine.collective import Collective, GradientBuckets
from ringflow.engine.collective.powersgd import powersgd_hook, state_for
from ringflow.engine.collective.registry import comm_hook
from ringflow.engine.config import WIRE_FORMATS
from ringflow.engine.data import Samples, samples_of
from ringflow.engine.errors import ModelError
from ringflow.engine.metrics import Logged, logged_number
from ringflow.engine.module import (
    call_hook,
    compile_in_place,
    compiled_in_buckets,
    may_return_none,
    step_arguments,
)
from ringflow.engine.sharded_commit import ShardedCommits
from ringflow.engine.sharded_parameters import ShardedParameters
from ringflow.engine.sharding import ShardedOptimizer
from ringflow.engine.sync_batchnorm import attach_collective, convert_sync_batchnorm
from ringflow.engine.timeline import UNTIMED
from ringflow.engine.worker import (
    Batch,
    evaluate_module,
    free_address,
    seed_generators,
    to_device,
)
from ringflow.storage.reshard import (
    REPLICATED,
    is_sharded,
    load_data_parallel,
    piece_key,
    pieced_keys,
    read_pieces,
    zero_shard,
)
from ringflow.storage.store import CheckpointStore, CommittedCheckpoint

if TYPE_CHECKING:
    from ringflow.engine.worker import Worker

__all__ = ["DataParallelStep", "WholeModel"]


@dataclass(frozen=True)
class WholeModel:
    """The plan of a data-parallel worker: the whole model, a part of every batch."""

    def build(self, worker: Worker) -> DataParallelStep:
        return DataParallelStep(worker)


class DataParallelStep(ShardedCommits):
    """A data-parallel worker's part of the training: ``Worker`` holds the rest."""

    calls_hooks = True
    """The module's own hooks run on every worker, as on every rank under Trainer."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.bucket_bytes = int(worker.config.bucket_mb * 2**20)
        self.collective: Collective | None = None
        self.buckets: GradientBuckets | None = None
        self._steps_in_two = False
        self._ready_first: list[torch.Tensor] = []
        self._window_learns = False
        """Whether a batch of the current window gave a gradient (none returned ``None``)."""
        self._hook: tuple[Any, Any, str] | None = None
        self._may_skip = True
        """Whether the module's ``training_step`` may return ``None`` (:meth:`_skipped`)."""
        self.syncs_batchnorm = worker.config.sync_batchnorm and worker.config.workers > 1
        """Whether the module's BatchNorm layers normalise over every worker's part
        (``TrainConfig.sync_batchnorm``)."""
        self.stepping = False
        """Whether the batch being trained has begun to step the optimizer: a failure from
        then on leaves a state that only a rollback undoes (``Worker.reached``)."""
        self.shards = worker.config.shard != "none"
        """Whether each worker steps and keeps the optimizer state of its shard of the
        parameters only (``TrainConfig.shard``; ``engine.sharding``)."""
        self.keeps_grad_shards = worker.config.shard in ("gradients", "parameters")
        """Whether each worker keeps only its shard of the gradients too (ZeRO-2): every
        batch's are reduce-scattered as backward makes them, accumulation included."""
        self.shards_parameters = worker.config.shard == "parameters"
        """Whether each worker keeps only its shard of the parameters too (ZeRO-3), each
        bucket's gathered where a forward or backward pass needs it
        (``engine.sharded_parameters``)."""
        self.sharded: ShardedOptimizer | None = None
        self.weights: ShardedParameters | None = None
        """Under ZeRO-3, the module's sharded parameters."""

    @property
    def shard(self) -> str:
        """The checkpoint shard this worker writes (``Worker.write_shard``): sharded, its own
        (``zero-{rank}``, :meth:`own_training_state`); else every worker holds the whole
        state, and rank 0's is the checkpoint's one shard."""
        return zero_shard(self.worker.rank) if self.shards else REPLICATED

    def split(self, split: str) -> Samples:
        return samples_of(self.worker.data, split)

    def prepare(self, module: torch.nn.Module) -> torch.nn.Module:
        """As Trainer: ``setup``, then ``configure_model``, then ``sync_batchnorm``'s
        conversion, then the device. Built on the CPU, so the initial weights are the same
        wherever the worker trains; moved before the optimizer exists, so its state is
        created on the device."""
        w = self.worker
        self._may_skip = may_return_none(type(module).training_step)
        call_hook(module, "setup", "fit")
        call_hook(module, "configure_model")
        if self.syncs_batchnorm:
            module = convert_sync_batchnorm(module)
        compile_in_place(module)  # eager state names, whatever configure_model compiled
        if self.shards_parameters and any(
            getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()
        ):
            raise ModelError(
                f"shard='parameters' does not compose with torch.compile yet: "
                f"{type(module).__name__} compiles a module whose forward hooks gather its "
                "sharded weights; use shard='gradients' or leave the module uncompiled"
            )
        return w.precision.convert_module(module.to(w.device))

    # ------------------------------------------------------------------ membership

    def addresses(self) -> tuple[str, ...]:
        """A ``tcp://host:port`` on this worker's node where rank 0 can host the rendezvous."""
        return (free_address(),)

    def connect(self, init_method: str = "") -> None:
        """Join the collective and start from rank 0's weights, as DDP does."""
        self.join(init_method)
        with torch.no_grad(), self._gathered(write=True):
            for tensor in self.worker.module.state_dict().values():
                self.collective.broadcast_(tensor, src=0)

    def join(self, init_method: str = "", *, rejoin: bool = False) -> None:
        """Join the ring of the worker's current rank and world size (``rejoin``: rebuilt
        among members that are all up, ``Worker.ring``)."""
        self.collective = self.worker.ring(init_method, rejoin=rejoin)
        if self.syncs_batchnorm:
            attach_collective(self.worker.module, self.collective)
        self.prepare_buckets()

    def prepare_buckets(self) -> None:
        w = self.worker
        self.buckets = GradientBuckets(
            w.params,
            self.collective,
            bucket_bytes=self.bucket_bytes,
            comm_hook=None if self.shards else self._comm_hook(),
            scatter=self.shards,
            keep_shards=self.keeps_grad_shards,
        )
        self.buckets.timeline = w.timeline
        if self.shards_parameters:  # each worker keeps its shard of the weights
            self.weights = ShardedParameters(w.module, self.buckets, self.collective)
        if self.shards:  # the optimizer steps this rank's shard; commits keep the whole state
            self.sharded = ShardedOptimizer(
                w.optimization.optimizer, self.buckets, self.collective, parameters=self.weights
            )
            w.optimizer = self.sharded
        # While the last bucket (the first layers') reduces, step the parameters whose sums
        # are in: the optimizer then hides the all-reduce that backward could not.
        last = {id(p) for p in self.buckets.last_params}
        self._ready_first = [p for p in w.params if id(p) not in last]
        self._steps_in_two = (
            not self.shards
            and w.world_size > 1
            and w.config.accumulate_grad_batches == 1
            and bool(last)
            and bool(self._ready_first)
            and not w.optimization.manual
            and w.optimization.steps_in_two(clip_val=w.config.gradient_clip_val)
        )

    def _comm_hook(self) -> tuple[Any, Any, str] | None:
        """``TrainConfig.compression``'s communication hook and its state (built once per
        worker), or ``None`` for the collective's own all-reduce."""
        w = self.worker
        name = w.config.compression
        if name in WIRE_FORMATS:
            return None
        if self._hook is None:
            if name == "powersgd":
                self._hook = (powersgd_hook, state_for(w.config, w.rank, w.world_size), name)
            else:
                hook, state = comm_hook(name)
                self._hook = (hook, None if state is None else state(w.rank, w.world_size), name)
        return self._hook

    @property
    def keeps_comm_state(self) -> bool:
        """Whether the communication hook keeps a state (:meth:`comm_state`), which every
        all-reduce may change."""
        return self._hook is not None and hasattr(self._hook[1], "state_dict")

    def comm_state(self) -> dict[str, torch.Tensor]:
        """The communication hook's state as CPU tensors (``state_dict()``), where it has one:
        commits and checkpoints keep it (PowerSGD's Q factors and this rank's error)."""
        state = None if self._hook is None else self._hook[1]
        return state.state_dict() if hasattr(state, "state_dict") else {}

    def load_comm_state(self, tensors: dict[str, torch.Tensor], *, own: bool = True) -> None:
        """Take :meth:`comm_state`'s ``tensors`` back; ``own=False``: another rank's (a
        worker joining), whose error is not this rank's to add."""
        state = None if self._hook is None else self._hook[1]
        if tensors and hasattr(state, "load_state_dict"):
            state.load_state_dict(tensors)
            if not own and hasattr(state, "reset_errors"):
                state.reset_errors()

    def leave(self) -> None:
        if self.syncs_batchnorm and hasattr(self.worker, "module"):
            attach_collective(self.worker.module, None)
        if self.weights is not None:  # its hooks removed, the weights in storage of their own
            self.weights.release()
            self.weights = None
        self.leave_ring()

    def reconfigure(self, init_method: str = "") -> None:
        """Join the new ring (the worker has its new rank); the state stays.

        Sharded, the optimizer state (under ZeRO-3 the weights too) is laid out anew
        (:meth:`~ringflow.engine.sharded_commit.ShardedCommits.lay_out_again`).
        """
        carried = self.sharded.carry() if self.sharded is not None else []
        weights = self.weights.carry() if self.weights is not None else None
        self.leave()
        self.join(init_method, rejoin=True)
        if self.sharded is not None:
            self.lay_out_again(carried, weights)

    # ------------------------------------------------------------------ training

    def train(self, batch: Batch) -> int:
        """One batch; the optimizer steps at the last batch of an accumulation window.

        Each rank's loss is a mean over its part; weighting it by the part's share of the
        global batch (and by 1/``accumulate_grad_batches``, as Lightning scales the loss)
        makes the sum over ranks and batches the gradient Trainer computes on one process.
        Without accumulation the weight is applied to each gradient on its way into a bucket
        (where every share is alike, the buckets' all-reduces average instead); with it, and
        under ``sync_batchnorm`` where shares differ, to the loss, and the buckets reduce the
        window's summed gradients once (under ``shard="gradients"``, each batch's as backward
        makes them, their shards added up: no whole gradient outlives its bucket).
        The module's hooks run where Trainer runs them (``on_after_backward`` sees the
        averaged gradients of a window's last batch). Where nothing reads every gradient
        before the step, the optimizer steps the parameters whose buckets are reduced while
        the last bucket still reduces, then the rest (``Optimization.step_in_two``).

        Returns:
            The samples of the batch this worker saw.
        """
        assert self.buckets is not None, "connect() must run before training"
        if self.worker.optimization.manual:
            return self._train_manual(batch)
        if batch.shares:
            return self._train_shares(batch)
        if self.weights is None:
            return self._train(batch)
        self.weights.begin()  # ZeRO-3: the weights are gathered unit by unit, freed after
        try:
            return self._train(batch)
        finally:
            self.weights.end()

    def _train(self, batch: Batch) -> int:
        w, mine, step, window = self.worker, batch.mine, batch.step, batch.window
        module, log_step = w.module, batch.log_step
        self.stepping = False
        timeline = UNTIMED if w.timeline is None else w.timeline.begin(batch.epoch, step)
        if w.has_buffers:
            w.after_copies()
        data = self._batch_start(mine, batch, timeline) if len(mine) else None
        if batch.opens_window:
            self._zero_grad(step)
            self._window_learns = False
        scale = self._loss_weight(batch, window)
        # Buckets start their all-reduces from inside backward (ZeRO-2: every batch's).
        if batch.steps or self.keeps_grad_shards:
            self._start_buckets(batch, summed=scale is not None)
        out = loss = None
        if data is not None:
            out, loss = self._forward(data, len(mine), batch, timeline)
        learns = not self._skipped(loss, has_data=data is not None, batch=batch)
        self._window_learns |= learns
        if learns and loss is not None:
            call_hook(module, "on_before_backward", loss)
            timeline.start("backward")
            with self._backward():
                w.precision.backward(loss if scale is None else loss * scale)
            timeline.stop("backward")
            w.metric_log.record("train_loss", logged_number(loss), len(mine))
        if batch.steps:
            self._update(batch, timeline, after_backward=learns and data is not None)
        else:
            self._within_window(learns=learns, after_backward=learns and data is not None)
        if data is not None:
            w.metric_log.enter("on_train_batch_end", batch_size=len(mine), log_step=log_step)
            call_hook(module, "on_train_batch_end", out, data, step)
        timeline.end()
        return len(mine)

    def _within_window(self, *, learns: bool, after_backward: bool) -> None:
        """After a batch that does not step (accumulation): under ZeRO-2 its gradients'
        shards are waited for and added up (a batch every worker skipped reduces nothing);
        then the module's ``on_after_backward``."""
        if self.keeps_grad_shards and learns:
            self.buckets.finish()
        elif self.keeps_grad_shards:
            self.buckets.cancel()
        self.worker.after_copies()  # the module's hooks may change the weights
        if after_backward:
            call_hook(self.worker.module, "on_after_backward")

    def _train_shares(self, batch: Batch) -> int:
        """One batch where this worker trains the parts of several ranks of the run's full
        size (``Worker.shares``), each as that rank would: its generators seeded as that
        rank's, the module seeing that rank (``trainer.global_rank``, ``world_size``) in
        its step and hooks. Their backward passes sum into the gradients, the buckets
        started for the last, and the sums over the members are divided by the full size,
        as its ring divides them."""
        w, step, module, log_step = self.worker, batch.step, self.worker.module, batch.log_step
        full, trainer = w.config.workers, w.trainer
        self.stepping = False
        timeline = UNTIMED if w.timeline is None else w.timeline.begin(batch.epoch, step)
        self._zero_grad(step)
        passes = []
        for share in batch.shares:
            seed_generators(share.seed, w.device)
            with trainer.as_rank(share.rank, full):
                data = self._batch_start(share.samples, batch, timeline)
                out, loss = self._forward(data, len(share.samples), batch, timeline)
            passes.append((share, data, out, loss))
        skipped = any(loss is None for *_, loss in passes)
        learns = not self._skipped(None if skipped else passes[-1][3], has_data=True, batch=batch)
        self._window_learns = learns
        if learns:
            for share, _, _, loss in passes:
                if share is passes[-1][0]:
                    self.buckets.start(over=full)
                with trainer.as_rank(share.rank, full):
                    call_hook(module, "on_before_backward", loss)
                timeline.start("backward")
                w.precision.backward(loss)
                timeline.stop("backward")
                w.metric_log.record("train_loss", logged_number(loss), len(share.samples))
        self._update(batch, timeline, after_backward=learns)
        for share, data, out, _ in passes:
            with trainer.as_rank(share.rank, full):
                size = len(share.samples)
                w.metric_log.enter("on_train_batch_end", batch_size=size, log_step=log_step)
                call_hook(module, "on_train_batch_end", out, data, step)
        timeline.end()
        return len(batch.mine)

    def _zero_grad(self, step: int) -> None:
        """Zero the gradients before a window; sharded, the whole buckets too: the
        optimizer's own ``zero_grad`` reaches only this rank's shard, and the rest holds
        the partial sums of the last reduce-scatter."""
        self.worker.optimization.zero_grad(step)
        if self.sharded is not None:
            self.buckets.zero_()

    def _batch_start(self, samples: torch.Tensor, batch: Batch, timeline: Any) -> Any:
        """``samples``' input on the worker's device, and the batch-start hooks run on it."""
        w = self.worker
        timeline.start("data")
        data = to_device(w.train.batch(samples), w.device)
        timeline.stop("data")
        w.queue_deferred()  # behind the input's copy, not ahead of it
        w.metric_log.enter("on_train_batch_start", batch_size=len(samples), log_step=batch.log_step)
        w.callbacks_run("on_train_batch_start", data, batch.step)
        call_hook(w.module, "on_train_batch_start", data, batch.step)
        return data

    def _forward(self, data: Any, size: int, batch: Batch, timeline: Any) -> tuple[Any, Any]:
        """The module's ``training_step`` on ``data`` (``size`` samples): its output and
        loss."""
        w, module = self.worker, self.worker.module
        w.metric_log.enter("training_step", batch_size=size, log_step=batch.log_step)
        timeline.start("forward")
        # What the step compiles is split at buckets: a module compiled whole overlaps too.
        saving = contextlib.nullcontext() if self.weights is None else self.weights.saving()
        with w.precision.forward_context(), compiled_in_buckets(self.bucket_bytes), saving:
            out = module.training_step(
                *step_arguments(module.training_step, w.precision.convert_input(data), batch.step)
            )
        timeline.stop("forward")
        return out, out["loss"] if isinstance(out, Mapping) else out

    def _update(self, batch: Batch, timeline: Any, *, after_backward: bool) -> None:
        """The end of a window: reduce its gradients and step, as :meth:`train` says; where
        every batch of the window returned ``None``, as Trainer, no gradient and no step
        (the hook and the schedulers due still run)."""
        w, step = self.worker, batch.step
        if not self._window_learns:
            self.buckets.cancel()
            w.optimization.skip_step(step, last=batch.last)
            w.trainer.global_step += 1
            return
        in_two = self._steps_in_two
        timeline.start("gradient_wait")
        self.buckets.finish(leave_last=in_two)
        timeline.stop("gradient_wait")
        w.after_copies()  # the module's hooks and the optimizer may change the weights
        if after_backward:
            call_hook(w.module, "on_after_backward")
        self.stepping = True
        timeline.start("optimizer")  # with the last bucket's wait, when in two
        if in_two:
            w.optimization.step_in_two(
                step, last=batch.last, ready=self._ready_first, wait=self.buckets.finish_last
            )
        elif self.sharded is not None:  # this rank's shard, clipped by the whole norm
            self.sharded.attach_grads()
            clip_val, whole_norm = w.config.gradient_clip_val, None
            if clip_val is not None and w.config.gradient_clip_algorithm == "norm":
                # shard="none"'s norm, bit for bit, where it clips (no scaler: no 16-mixed)
                whole_norm = functools.partial(self.sharded.norm_across, clip_val=clip_val)
            w.optimization.step(
                step,
                last=batch.last,
                clip_val=clip_val,
                clip_algorithm=w.config.gradient_clip_algorithm,
                across=self.sharded.sum_across,
                whole_norm=whole_norm,
            )
            self.sharded.gather()
        else:
            w.optimization.step(
                step,
                last=batch.last,
                clip_val=w.config.gradient_clip_val,
                clip_algorithm=w.config.gradient_clip_algorithm,
            )
        timeline.stop("optimizer")
        w.trainer.global_step += 1

    def _skipped(self, loss: Any, *, has_data: bool, batch: Batch) -> bool:
        """Whether the batch is skipped: its ``training_step`` returned ``None`` (Trainer
        then skips its backward), on any worker's share, so every worker skips it alike.

        The workers agree by a one-number all-reduce, only for a module whose
        ``training_step`` can be seen to return ``None`` (``may_return_none``): the others
        pay nothing.

        Raises:
            ModelError: a ``training_step`` that shows no way to return ``None`` did.
        """
        w = self.worker
        mine = has_data and loss is None
        if w.world_size == 1:
            return mine
        if not self._may_skip:
            if mine:
                raise ModelError(
                    f"{type(w.module).__name__}.training_step returned None at step "
                    f"{batch.step} of epoch {batch.epoch}, where its own code has no "
                    "'return None': return None from training_step itself to skip a batch "
                    "on every worker"
                )
            return False
        votes = torch.tensor([1.0 if mine else 0.0], device=w.device)
        return bool(self.collective.allreduce_(votes).item() > 0)

    def _train_manual(self, batch: Batch) -> int:
        """One batch under manual optimisation: the module's ``training_step`` steps its own
        optimizers, and each ``self.manual_backward(loss)`` in it returns with the gradients
        of the parameters that take one (``toggle_optimizer``) reduced over the ring, as
        DDP's are under Trainer. Every worker has a part of every batch
        (``check_manual_optimisation``), so all call it alike."""
        w, mine, step = self.worker, batch.mine, batch.step
        module, log_step = w.module, batch.log_step
        timeline = UNTIMED if w.timeline is None else w.timeline.begin(batch.epoch, step)
        timeline.start("data")
        data = to_device(w.train.batch(mine), w.device)
        timeline.stop("data")
        w.after_copies()  # the step changes the weights: a commit's copies go first
        w.metric_log.enter("on_train_batch_start", batch_size=len(mine), log_step=log_step)
        w.callbacks_run("on_train_batch_start", data, step)
        call_hook(module, "on_train_batch_start", data, step)
        w.metric_log.enter("training_step", batch_size=len(mine), log_step=log_step)

        scale = self._loss_weight(batch, 1)

        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            call_hook(module, "on_before_backward", loss)
            self._start_buckets(batch, summed=scale is not None)
            w.precision.backward(loss if scale is None else loss * scale, *args, **kwargs)
            self.buckets.finish()
            call_hook(module, "on_after_backward")

        w.trainer.manual_backward(backward)
        switched = [p.requires_grad for p in w.params]  # as toggle_optimizer finds them
        timeline.start("forward")
        try:
            with w.precision.forward_context():
                out = module.training_step(
                    *step_arguments(module.training_step, w.precision.convert_input(data), step)
                )
        except BaseException:  # a peer lost mid-step: the rollback finds them as they were
            for param, requires_grad in zip(w.params, switched, strict=True):
                param.requires_grad_(requires_grad)
            raise
        timeline.stop("forward")
        loss = out["loss"] if isinstance(out, Mapping) else out
        if isinstance(loss, torch.Tensor):
            w.metric_log.record("train_loss", logged_number(loss), len(mine))
        w.metric_log.enter("on_train_batch_end", batch_size=len(mine), log_step=log_step)
        call_hook(module, "on_train_batch_end", out, data, step)
        timeline.end()
        return len(mine)

    def _loss_weight(self, batch: Batch, window: int) -> float | None:
        """What the loss is multiplied by before backward where it carries this worker's
        share of the batch (the buckets then only sum): in an accumulation ``window`` of
        batches, and under ``sync_batchnorm`` where the parts differ in size, since the
        BatchNorm gradients cross the workers inside backward (``engine.sync_batchnorm``);
        ``None`` elsewhere: the buckets weight the gradients."""
        unequal = batch.global_size % self.worker.world_size
        if window > 1 or (self.syncs_batchnorm and unequal):
            return batch.weight / window
        return None

    def _start_buckets(self, batch: Batch, *, summed: bool) -> None:
        if summed:
            self.buckets.start()  # the loss carried the weight
        elif batch.global_size % self.worker.world_size == 0:
            self.buckets.start(average=True)  # every rank's share alike: the mean of the sums
        else:
            self.buckets.start(weight=batch.weight)

    # ------------------------------------------------------------------ evaluation, state

    def evaluate(self, split: str, samples: Samples) -> Logged:
        """This rank's part of ``split`` through the module's validation or test step.

        Under ZeRO-3 the forward hooks gather each unit's weights and free them, every
        worker running each batch; where a batch leaves some workers nothing (fewer samples
        than workers), the whole model is gathered for the evaluation instead."""
        w = self.worker
        batches = -(-len(samples) // w.config.batch_size)
        last = len(samples) - (batches - 1) * w.config.batch_size if batches else 0
        uneven = min(w.config.batch_size, last) < w.world_size
        whole = self._gathered() if uneven else contextlib.nullcontext()
        if self.weights is not None:
            self.weights.begin()
        try:
            with whole:
                return evaluate_module(
                    w.module,
                    samples,
                    split=split,
                    batch_size=w.config.batch_size,
                    rank=w.rank,
                    world_size=w.world_size,
                    first_step=w.trainer.current_epoch * batches,  # the earlier epochs' batches
                    device=w.device,
                    precision=w.precision,
                    log=w.metric_log,
                )
        finally:
            if self.weights is not None:
                self.weights.end()

    def _backward(self) -> contextlib.AbstractContextManager[None]:
        """Around the backward pass: under ZeRO-3 a forward that runs inside it (activation
        checkpointing's recomputation) frees nothing; the buckets free the units."""
        return contextlib.nullcontext() if self.weights is None else self.weights.backward()

    def _gathered(self, *, write: bool = False) -> contextlib.AbstractContextManager[None]:
        """Under ZeRO-3, every unit's weights gathered while the block runs (collective;
        :meth:`ShardedParameters.gathered`); elsewhere nothing to do."""
        if self.weights is None:
            return contextlib.nullcontext()
        return self.weights.gathered(write=write)

    def whole_state(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict``; under ZeRO-3 its parameters gathered into tensors of
        their own (collective: every worker calls it alike), which a commit or checkpoint
        may copy while the next steps run."""
        module = self.worker.module
        if self.weights is None:
            return module.state_dict()
        copies = self.weights.copies()
        return {
            name: copies[id(value)] if id(value) in copies else value.detach()
            for name, value in module.state_dict(keep_vars=True).items()
        }

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around writing whole weights into the module (a rollback, a checkpoint loaded):
        under ZeRO-3 each worker keeps its shard of them (not collective)."""
        if self.weights is None:
            yield
            return
        with self.weights.writing():
            yield

    def own_training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """Sharded, this worker's shard of the training state by full name and element range
        (``storage.reshard``'s sharded layout), nothing gathered: its pieces of the weights
        (:meth:`ShardedOptimizer.spans`) and of the optimizer state; rank 0 adds the module's
        tensors that are not sharded (buffers, frozen parameters). The metadata is the
        optimizer's (``merge_sharded_optimizer_metadata`` joins the workers'), with
        ``pieces``: each sharded parameter's shape and the other names it has in the
        module's ``state_dict``. ``None`` unsharded: the whole state is rank 0's. The tensors
        alias the state."""
        if self.sharded is None:
            return None
        module, sharded = self.worker.module, self.sharded
        named = list(module.named_parameters())
        names = {id(param): name for name, param in named}
        bucketed = sharded.bucketed
        tensors = {
            piece_key(f"model/{names[id(param)]}", start, stop): view
            for param, start, stop, view in sharded.spans()
        }
        aliases = {}
        for key, value in module.state_dict(keep_vars=True).items():
            if id(value) in bucketed:
                if names[id(value)] != key:
                    aliases[key] = names[id(value)]
            elif self.worker.rank == 0:
                tensors[f"model/{key}"] = value.detach()
        optim, metadata = sharded.state_pieces(named)
        tensors.update({f"optim/{key}": value for key, value in optim.items()})
        metadata["pieces"] = {
            "workers": self.worker.world_size,
            "shapes": {name: list(p.shape) for name, p in named if id(p) in bucketed},
            "aliases": aliases,
        }
        return tensors, metadata

    def restore_own(self, store: CheckpointStore, checkpoint: CommittedCheckpoint) -> bool:
        """Sharded, from a sharded checkpoint (of any number of workers, any shard mode):
        load this worker's pieces of the optimizer state, and of the weights under ZeRO-3
        (the whole weights otherwise), reading only the checkpoint's shards that hold some
        of them; whether it did (else the whole state is loaded: :meth:`load`)."""
        if self.sharded is None or not is_sharded(checkpoint):
            return False
        module, sharded = self.worker.module, self.sharded
        named = list(module.named_parameters())
        names = {id(param): name for name, param in named}
        bucketed = sharded.bucketed
        state = module.state_dict(keep_vars=True)
        wanted: dict[str, list[tuple[int, int]] | None] = {
            f"model/{key}": None for key, value in state.items() if id(value) not in bucketed
        }
        spans = sharded.spans()
        if self.weights is None:  # every worker holds the whole weights
            wanted.update({f"model/{names[i]}": None for i in bucketed})
        else:
            wanted.update({f"model/{names[id(p)]}": [(a, b)] for p, a, b, _ in spans})
        metadata = checkpoint.metadata["optimizer"]
        pieced = pieced_keys(checkpoint)
        for param, start, stop in sharded.pieces():
            name = names[id(param)]
            for key in metadata["state"].get(name, {}).get("tensors", []):
                full = f"optim/{name}/{key}"
                wanted[full] = [(start, stop)] if full in pieced else None
        found = read_pieces(store, checkpoint, wanted)
        with torch.no_grad():
            whole = {
                key: found[f"model/{key}"]
                for key, value in state.items()
                if f"model/{key}" in found and (self.weights is None or id(value) not in bucketed)
            }
            if self.weights is None:  # tied weights: the parameter under its other names
                for key, value in state.items():
                    if key not in whole:
                        whole[key] = found[f"model/{names[id(value)]}"]
            module.load_state_dict(whole, strict=self.weights is None)
            if self.weights is not None:
                for param, start, stop, view in spans:
                    view.copy_(found[piece_key(f"model/{names[id(param)]}", start, stop)])
        optim = {key[6:]: value for key, value in found.items() if key.startswith("optim/")}
        sharded.load_pieces(named, optim, metadata)
        return True

    def own(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What of a whole model's ``state`` this worker holds: all of it."""
        return state

    def load(self, store: CheckpointStore, checkpoint: CommittedCheckpoint) -> dict[str, Any]:
        """The tensors of ``checkpoint`` this worker trains: the replicated state."""
        w = self.worker
        state = load_data_parallel(store, checkpoint, rank=w.rank, world_size=w.world_size)
        if state.own is not None:  # the communication hook's, per rank
            self._comm_hook()
            self.load_comm_state(state.own, own=state.saved_world_size == w.world_size)
        return state.replicated

    def transport(self) -> str | None:
        return None if self.collective is None else getattr(self.collective, "transport", None)

    def close(self) -> None:
        self.leave()
