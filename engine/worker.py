"""One worker of a run, whatever its layout: the user's LightningModule (or the stage of it
that a pipeline worker holds), its part of every batch, its optimizer, commits and checkpoints.

The same class runs inside a Ray actor (``engine.group``) or in the caller's own process, so
a tuning trial trains through exactly the code ``train`` uses. What differs between layouts is
a ``Step`` (``engine.data_parallel``, ``engine.pipeline.step``); the helpers below are shared
by both: the global batches of an epoch, the seeds, the device, the rendezvous address.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from ringflow.engine.cluster import log_files
from ringflow.engine.collective import Collective, create_collective, environment_overrides
from ringflow.engine.config import WIRE_FORMATS, DataSpec, TensorData, TrainConfig
from ringflow.engine.data import EpochOrder, Layout, Samples, has_split, layout_of
from ringflow.engine.epochs import Epochs
from ringflow.engine.errors import CollectiveTimeoutError, EngineError, ModelError, PeerLostError
from ringflow.engine.failures import one_line
from ringflow.engine.metrics import Logged, MetricLog
from ringflow.engine.module import (
    LrScale,
    Optimization,
    Precision,
    TrainerView,
    attach,
    call_hook,
    lightning_checkpoint,
    module_checkpoint,
    overrides,
    step_arguments,
)
from ringflow.engine.phases import mark
from ringflow.engine.seeding import seed_host_generators
from ringflow.engine.sharded_commit import handed
from ringflow.engine.spec import check_warm_start
from ringflow.engine.timeline import WorkerTimeline
from ringflow.storage.checkpoint import read_checkpoint
from ringflow.storage.checkpointer import AsyncCheckpointer, copy_to_host, host_buffer
from ringflow.storage.reshard import (
    REPLICATED,
    load_training_state,
    rank_shard,
    training_state,
)
from ringflow.storage.store import CheckpointStore, CommittedCheckpoint

__all__ = [
    "NOSET_VISIBLE_DEVICES",
    "Batch",
    "Plan",
    "Step",
    "Worker",
    "evaluate_module",
    "epoch_batches",
    "free_address",
    "split_global_batch",
    "Share",
    "seed_generators",
    "step_seed",
    "worker_device",
]

Commit = tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]
"""A worker's state at a step, in host memory: model, optimizer, schedulers and scaler."""


def split_global_batch(indices: torch.Tensor, *, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous part of a global batch (parts differ by at most one sample)."""
    return torch.tensor_split(indices, world_size)[rank]


def step_seed(seed: int, step: int, rank: int) -> int:
    """The torch seed of ``rank`` at global ``step``.

    Reseeding every step makes the random stream (dropout masks) a function of where the run
    is, not of how it got there, so a run resumed from a checkpoint draws the same numbers as
    the uninterrupted one without any RNG state in the checkpoint.
    """
    return (seed * 1_000_003 + step) * 1_009 + rank


def epoch_batches(
    samples: int | Samples,
    config: TrainConfig,
    *,
    epoch: int,
    first: int,
    count: int,
    rank: int,
    world_size: int,
    device: torch.device,
    batch_size: int | None = None,
    start: int | None = None,
) -> Iterator[tuple[int, torch.Tensor, int]]:
    """Steps ``first .. first + count - 1`` of ``epoch``: each step's index, this rank's part
    of its global batch (sample indices) and the global batch's size.

    ``batch_size`` is the epoch's global batch and ``start`` the run's step at the epoch's
    first (``engine.epochs``, where epochs differ in length); by default
    ``config.batch_size`` and ``epoch`` whole epochs of it.

    The order is a seeded function of the split's layout and the epoch
    (``engine.data.EpochOrder``; a number of samples is one block), and the generators are
    reseeded at every step (:func:`step_seed`), so any worker count, layout or resume point
    sees the same global batches and the same random numbers. Samples that can ``follow``
    are told the parts this rank will ask for, to the epoch's end, so they can read ahead.
    Samples with an ``epoch_order`` (a Ray Dataset read as one stream per rank,
    ``engine.ray_data``) give the epoch's order and each rank's part of a batch themselves.

    Raises:
        ValueError: the steps are outside the epoch.
    """
    layout = Layout((samples,)) if isinstance(samples, int) else layout_of(samples)
    own_order = getattr(samples, "epoch_order", None)  # a stream per rank: engine.ray_data
    batch_size = batch_size or config.batch_size
    order = (
        own_order(config, epoch=epoch, world_size=world_size, batch_size=batch_size)
        if own_order is not None
        else EpochOrder(layout, seed=config.seed, epoch=epoch, batch_size=batch_size)
    )
    part = getattr(order, "part", split_global_batch)
    steps_per_epoch = order.steps
    if not 0 <= first < first + count <= steps_per_epoch:
        raise ValueError(
            f"steps {first}..{first + count - 1} are outside epoch {epoch}, "
            f"which has {steps_per_epoch} steps"
        )
    follow = getattr(samples, "follow", None)
    if follow is not None:
        position = (config.seed, batch_size, epoch, first, rank, world_size)
        follow(position, _rank_parts(layout, config, batch_size, epoch, first, rank, world_size))
    origin = epoch * steps_per_epoch if start is None else start
    for step in range(first, first + count):
        seed_generators(step_seed(config.seed, origin + step, rank), device)
        batch = order.batch(step)
        yield step, part(batch, rank=rank, world_size=world_size), len(batch)


def _rank_parts(
    layout: Layout,
    config: TrainConfig,
    batch_size: int,
    epoch: int,
    first: int,
    rank: int,
    world_size: int,
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(step, this rank's part)`` from ``first`` to the epoch's end, on its own order object
    (a reader's thread computes them ahead of the training loop)."""
    order = EpochOrder(layout, seed=config.seed, epoch=epoch, batch_size=batch_size)
    for step in range(first, order.steps):
        yield step, split_global_batch(order.batch(step), rank=rank, world_size=world_size)


def free_address() -> str:
    """A free ``tcp://host:port`` on this process's node (its Ray node address, or loopback
    where no Ray runs), for a rendezvous store."""
    host = "127.0.0.1"
    try:
        import ray

        if ray.is_initialized():
            host = ray.util.get_node_ip_address()
    except ImportError:  # the GPU benchmark machine has no Ray
        pass
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
"""Set for a Ray actor, Ray leaves its ``CUDA_VISIBLE_DEVICES`` alone: the actor sees every GPU
of its node and trains on the first of those Ray assigned it."""


ASSIGNED_GPU = "RINGFLOW_ASSIGNED_GPU"
"""Set in a pooled worker's process for a run (``engine.pool``, reset with it): Ray's id of
the GPU its bundle of the run's placement group holds, which Ray did not assign to the process
itself (a pooled process reserves nothing)."""


def worker_device(config: TrainConfig) -> torch.device:
    """Where a worker of ``config`` trains: the CPU, or with ``gpus_per_worker`` the first
    GPU Ray assigned it. Ray either hides the other GPUs (``CUDA_VISIBLE_DEVICES``: the GPU is
    ``cuda:0``) or, with ``NOSET_VISIBLE_DEVICES``, leaves every GPU of the node visible, so
    that workers on one host get distinct device indices and the ring can move gradients
    through GPU shared memory (``engine.collective._symm``) rather than NCCL.

    Raises:
        EngineError: GPUs were asked for but this process cannot use CUDA.
    """
    if not config.gpus_per_worker:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise EngineError(
            f"gpus_per_worker={config.gpus_per_worker} but torch cannot use CUDA in this "
            f"worker's process (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda or 'not built in'}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); install a CUDA build of torch where "
            "the workers run and give them GPUs, or set gpus_per_worker=0 to train on CPU"
        )
    device = torch.device("cuda", _assigned_gpu())
    torch.cuda.set_device(device)  # the ring's NCCL transport runs on the current device
    return device


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed the generators this worker draws from: torch's CPU one, its GPU's if it has one,
    numpy's and Python's ``random`` (``seed_everything``'s, reseeded with torch's at every step).

    ``torch.manual_seed`` also seeds every CUDA, MTIA and XPU device; where those are not
    initialised (any CPU worker) it queues the call with a formatted stack each time, which
    slows a small model's loop and grows the queue by one entry a step.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    seed_host_generators(seed)


def _assigned_gpu() -> int:
    """This process's index of the first GPU Ray assigned it (0 where Ray hid the others), or
    its pool's (:data:`ASSIGNED_GPU`)."""
    if os.environ.get(ASSIGNED_GPU):
        ids = [os.environ[ASSIGNED_GPU]]
    elif os.environ.get(NOSET_VISIBLE_DEVICES) != "1":
        return 0
    else:
        import ray

        ids = [str(i) for i in ray.get_gpu_ids()]
    if not ids:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",").index(ids[0]) if visible else int(ids[0])


class Share(NamedTuple):
    """The part of a global batch of one rank of the run's full size."""

    rank: int
    seed: int
    """Its generators' seed at this step (:func:`step_seed`)."""
    samples: torch.Tensor


class Batch(NamedTuple):
    """One training batch as the worker hands it to its layout's step (``Step.train``)."""

    epoch: int
    step: int
    """The batch's index in the epoch."""
    mine: torch.Tensor
    """This worker's part of the global batch (sample indices; empty where it has none)."""
    global_size: int
    window: int
    """``accumulate_grad_batches``: the loss is scaled by its inverse where it is above 1."""
    opens_window: bool
    """The gradients are zeroed before this batch."""
    steps: bool
    """The optimizer steps after this batch (the last of its window or of the epoch)."""
    last: bool
    """The epoch's last batch (epoch-interval schedulers step after it)."""
    log_step: int | None
    """The loggers' step, where this batch's values go to them."""
    shares: tuple[Share, ...] = ()
    """Where this worker trains the parts of ranks that left (:meth:`Worker.shares`): each
    part, in rank order (``mine`` is them together)."""

    @property
    def weight(self) -> float:
        """This worker's share of the global batch."""
        return len(self.mine) / self.global_size


class Step(Protocol):
    """What a layout supplies a worker (``engine.data_parallel``, ``engine.pipeline.step``):
    how a batch becomes an update, how the worker meets its peers, what it evaluates and
    which tensors of a checkpoint it holds. The worker holds everything else."""

    calls_hooks: bool
    """Whether the module's own hooks run (a pipeline stage holds only part of the module)."""
    collective: Collective | None
    """The ring the worker's gradients are reduced over, checked once its steps ran."""
    shard: str
    """The checkpoint shard the worker's training state is written as (a stage's own)."""

    def split(self, split: str) -> Any: ...

    def prepare(self, module: torch.nn.Module) -> torch.nn.Module: ...

    def addresses(self) -> tuple[str, ...]: ...

    def connect(self, *addresses: str) -> None: ...

    def reconfigure(self, *addresses: str) -> None: ...

    def train(self, batch: Batch) -> int: ...

    def evaluate(self, split: str, samples: Any) -> Logged: ...

    def own(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def load(self, store: CheckpointStore, checkpoint: CommittedCheckpoint) -> dict[str, Any]: ...

    def transport(self) -> str | None: ...

    def close(self) -> None: ...


class Plan(Protocol):
    """A layout's description of one worker's step, sent to the worker, which builds it."""

    def build(self, worker: Worker) -> Step: ...


class Worker:
    """One worker of a run, whatever the layout: the device, the module and its optimizer,
    membership, in-memory commits, checkpoints, hooks, evaluation and logging. ``plan`` (from
    ``engine.layout``) supplies what differs: how a batch becomes an update and how the
    worker meets its peers (``Step``). Every worker is called with the same methods in the
    same order, in a Ray actor (``engine.group``) or in the caller's own process.

    Args:
        module_cls: the user's ``LightningModule`` class.
        hparams: keyword arguments for ``module_cls``.
        data: the preprocessed dataset.
        config: the run's engine configuration; with ``gpus_per_worker`` the worker trains
            on a GPU (see :func:`worker_device`) and its collective runs over NCCL.
        rank: this worker's data-parallel rank (a pipeline stage: its replica's), 0 to
            ``config.workers - 1``.
        plan: the layout's step: ``engine.data_parallel.WholeModel()`` for a data-parallel
            worker, ``engine.pipeline.step.StagePlan`` for a pipeline stage.

    Raises:
        EngineError: ``config.gpus_per_worker`` is set but this process cannot use CUDA.
    """

    def __init__(
        self,
        module_cls: type[torch.nn.Module],
        *,
        hparams: dict[str, Any],
        data: DataSpec | TensorData,
        config: TrainConfig,
        rank: int,
        plan: Plan,
    ) -> None:
        torch.set_num_threads(max(1, int(config.cpus_per_worker)))
        self.rank, self.world_size, self.config = rank, config.workers, config
        self.data = data
        self.device = worker_device(config)
        mark("device ready", role="worker")
        torch.manual_seed(config.seed)  # every worker builds the same initial weights
        seed_host_generators(config.seed)
        self.precision = Precision(config.precision, self.device)
        self.step: Step = plan.build(self)
        module = module_cls(**hparams)
        self._evaluated: dict[str, Any] = {}
        bind = getattr(data, "bind", None)  # the module's own loaders (engine.data.ModuleData)
        if bind is None:  # a DataModule's setup before the module's, as Trainer calls them
            self._open_train()
        # What the module's own code reads of its Trainer, and its ``self.log``: set before
        # ``configure_optimizers`` runs, which may ask for ``estimated_stepping_batches``.
        self.trainer = TrainerView(
            max_epochs=config.epochs,
            steps_per_epoch=self.steps_per_epoch if bind is None else 0,
            accumulate=config.accumulate_grad_batches,
            rank=rank,
            world_size=self.world_size,
            datamodule=getattr(data, "datamodule", None),
        )
        self.metric_log = MetricLog()
        attach(module, self.trainer, self.metric_log)
        self.module = self.step.prepare(module)
        self.trainer.lightning_module = self.module  # configure_optimizers may read trainer.model
        if bind is not None:  # on the module that trains, after its setup and configure_model
            self.data = bind(self.module, config.batch_size)
            self._open_train()
            self.trainer.count_batches(self.steps_per_epoch)
        self.timeline = (  # None when off: a batch then costs one test, no allocation
            WorkerTimeline(
                device=self.device,
                warmup=config.timeline_warmup,
                steps=config.timeline_steps,
                steps_per_epoch=self.steps_per_epoch,
            )
            if config.timeline
            else None
        )
        mark("module built", role="worker")
        self.optimization = Optimization(self.module, self.precision)
        if config.lr_scaling != "none":
            self.optimization.lr_scale = LrScale(config.lr_factor(), config.lr_warmup_steps)
        self.optimizer = self.optimization.optimizer
        self.trainer.adopt(self.optimization, self.module)
        self._check_every_worker_has_a_part(module_cls.__name__)
        self._materialise_lazy()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.checkpointer: AsyncCheckpointer | None = None
        self._shard_writes = _ShardWrites()
        self._commits: dict[int, Commit] = {}
        self._commit_tensors: dict[int, list[torch.Tensor]] = {}
        """Each commit's host tensors, reused by a later commit once it is dropped."""
        on_gpu = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if on_gpu else None
        """Where a GPU's commits copy to host memory while the next steps run."""
        self._landed: dict[int, torch.cuda.Event] = {}
        """Each commit's copies on the copy stream: the host waits for them to read it."""
        self._copying: torch.cuda.Event | None = None
        """The newest commit's copies, until the compute stream waits for them (before the
        state changes: the optimizer step, or the forward pass of a module with buffers)."""
        self._deferred: _Copies | None = None
        """A commit at the end of a call of steps whose copies wait for the next step's input
        to be on its way (:meth:`commit`)."""
        self.has_buffers = any(True for _ in self.module.buffers())
        self._ran_ahead: _RanAhead | None = None
        """The next call's first step, run where the last call ended (``train_steps``)."""
        self._failed: BaseException | None = None
        """Why the last call of steps failed, until a rollback: the steps the driver sent
        ahead of it are not run (``train_steps``)."""
        self._reached: Reached | None = None
        """Where the last call of steps failed, if nothing of the failed step is kept
        (:meth:`reached`)."""
        self._samples = 0
        """The samples of the current call's steps done so far."""
        self._driver_states: dict[int, dict[str, Any]] = {}
        """The driver's state at commits, by step (:meth:`remember`)."""
        self._ended_at: int | None = None
        """The run's step this worker's state is at: where its last call of steps ended, or
        the commit it made or went back to since (``None`` once anything else changed it;
        the step run ahead of the next call aside). A driver adopting it goes on from there
        as it is."""
        self._chunks: list[tuple[int, int, Logged]] = []
        """The last calls of steps: where each started and ended and what it logged, for a
        driver that adopts this worker after its driver was lost before it collected them
        (:meth:`chunks_since`)."""

    def _check_every_worker_has_a_part(self, name: str) -> None:
        """Refuse what needs every worker to run each batch's ``training_step`` (manual
        optimisation, ``sync_batchnorm``'s collectives in forward) where the epoch's last
        batch leaves a worker nothing.

        Raises:
            ModelError: naming the batch sizes that would do.
        """
        config = self.config
        last = len(self.train) % config.batch_size
        if not 0 < last < config.workers:
            return
        if self.optimization.manual:
            why = f"{name} optimises manually"
        elif config.sync_batchnorm:
            why = f"{name}'s BatchNorm layers are synchronised (sync_batchnorm)"
        elif config.shard == "parameters":
            why = f"{name}'s weights are sharded (shard='parameters': every forward gathers them)"
        else:
            return
        raise ModelError(
            f"{why}, and the epoch's last batch ({last} samples) leaves some of the "
            f"{config.workers} workers nothing to run its training_step on: choose a "
            f"batch_size that divides the {len(self.train)} training samples, or leaves at "
            f"least {config.workers}"
        )

    def _open_train(self) -> None:
        """Open the training split (a loader's ``train_dataloader()`` called) and count its
        epoch's steps.

        Raises:
            ModelError: the split was opened before and now has another number of samples.
        """
        before = getattr(self, "train", None)
        self.train = self.step.split("train")
        if before is not None and len(self.train) != len(before):
            raise ModelError(
                f"train_dataloader() reloaded at epoch {self.trainer.current_epoch} holds "
                f"{len(self.train)} samples, the first held {len(before)}: ringflow fixes an "
                "epoch's length when training starts; keep the dataset's length, or set "
                "reload_dataloaders_every_n_epochs=0"
            )
        if before is not None:
            if hasattr(before, "close") and before is not self.train:
                before.close()
            return
        self.steps_per_epoch = -(-len(self.train) // self.config.batch_size)
        self.epochs = Epochs(
            len(self.train), (self.config.batch_size,), self.config.accumulate_grad_batches
        )
        """Each epoch's global batch; the driver's, when the batch follows the workers."""

    def _reload_train(self, epoch: int) -> None:
        """Call the training loader again at the epochs Trainer does
        (``reload_dataloaders_every_n_epochs``), where the data comes from a loader."""
        every = self.config.reload_dataloaders_every_n_epochs
        if every and epoch and epoch % every == 0 and hasattr(self.data, "datamodule"):
            self._open_train()

    def _materialise_lazy(self) -> None:
        """Give lazy layers (``nn.LazyLinear``...) their shapes from a first forward, as under
        Trainer, before anything counts the parameters (buckets, commits, checkpoints): a dry
        run of ``training_step`` on the first global batch, with rank 0's seed of step 0 and
        without gradients, alike on every worker. What else it changed is undone: BatchNorm's
        statistics, what it logged; under manual optimisation its backward passes and
        optimizer steps do nothing.

        Raises:
            ModelError: a lazy parameter is still uninitialised after the dry run.
        """
        from torch.nn.modules.lazy import LazyModuleMixin
        from torch.nn.parameter import is_lazy

        module = self.module
        lazy = [m for m in module.modules() if isinstance(m, LazyModuleMixin)]
        if not any(m.has_uninitialized_params() for m in lazy):
            return
        kept = {k: v.clone() for k, v in module.state_dict().items() if not is_lazy(v)}
        _, whole, _ = next(
            epoch_batches(
                self.train,
                self.config,
                epoch=0,
                first=0,
                count=1,
                rank=0,
                world_size=1,
                device=self.device,
            )
        )
        data = to_device(self.train.batch(whole), self.device)
        attach(module, self.trainer, MetricLog())
        self.trainer.strategy.dry = True
        module.train()
        try:
            with torch.no_grad(), self.precision.forward_context():
                data = self.precision.convert_input(data)
                module.training_step(*step_arguments(module.training_step, data, 0))
        finally:
            attach(module, self.trainer, self.metric_log)
            self.trainer.strategy.dry = False
        module.load_state_dict(kept, strict=False)
        for layer in lazy:
            if hasattr(layer, "reset_running_stats"):
                layer.reset_running_stats()  # a lazy BatchNorm's, as it was made
        left = [name for name, p in module.named_parameters() if is_lazy(p)]
        if left:
            raise ModelError(
                f"{type(module).__name__}'s lazy parameters {left} were not materialised by "
                "a first training_step: call the layers they belong to in training_step, or "
                "give them their sizes"
            )

    def epoch_steps(self) -> int:
        """Steps (global batches) in one epoch of the training split."""
        return self.steps_per_epoch

    def train_samples(self) -> int:
        """Samples in the training split."""
        return len(self.train)

    def device_info(self) -> dict[str, str]:
        """Where this worker trains: its torch ``device`` and, on GPU, the ``gpu``'s name and
        PCI address as ``bus`` (which physical GPU), and the ring's ``transport``."""
        info = {"device": str(self.device)}
        if self.device.type == "cuda":
            properties = torch.cuda.get_device_properties(self.device)
            info["gpu"] = properties.name
            info["bus"] = (
                f"{properties.pci_domain_id}:{properties.pci_bus_id}:{properties.pci_device_id}"
            )
        if self.step.collective is not None:
            info["transport"] = self.step.transport() or self.config.collective
        return info

    def log_files(self) -> dict[str, Any]:
        """This worker's ``rank`` and where its output is written (``engine.cluster.log_files``)."""
        return {"rank": self.rank, **log_files()}

    def environment(self) -> dict[str, str]:
        """The environment variables of this worker's process that override the
        collective's settings (``engine.collective.ENVIRONMENT_KNOBS``)."""
        return environment_overrides()

    # ------------------------------------------------------------------ membership

    def addresses(self) -> tuple[str, ...]:
        """``tcp://host:port`` addresses on this worker's node where it can host the
        rendezvous of the peers it meets (``engine.layout`` says which are used)."""
        return self.step.addresses()

    def connect(self, *addresses: str) -> None:
        """Meet the peers at ``addresses`` (the layout's) and start from the same state."""
        self.step.connect(*addresses)

    def ring(self, init_method: str, *, group: Any = None, rejoin: bool = False) -> Collective:
        """Join the ring of this worker's rank and world size, rendezvous at ``init_method``:
        ``config.collective`` with its transport, over NCCL on a GPU (in ``group``, a
        pipeline stage's NCCL group over the replicas, where given). ``rejoin``: a ring
        rebuilt among members that are all up, which wait for each other only
        ``config.rejoin_timeout_s``.

        Raises:
            CollectiveTimeoutError: the peers did not all come (a peer lost as they met).
        """
        # CUDA tensors travel over NCCL: the ring then picks its NCCL transport, and native
        # joins an NCCL process group. Only then is the argument passed, so a collective that
        # knows no backend keeps working on CPU.
        backend: dict[str, Any] = {"backend": "nccl"} if self.device.type == "cuda" else {}
        if backend and group is not None:
            backend["group"] = group
        if self.config.collective == "ring":
            backend.update(transport=self.config.ring_transport, symm=self.config.symm)
        waits = self.config.rejoin_timeout_s if rejoin else self.config.timeout_s
        try:
            return create_collective(
                self.config.collective,
                rank=self.rank,
                world_size=self.world_size,
                init_method=init_method,
                timeout_s=self.config.collective_timeout_s,
                connect_timeout_s=waits,
                compression=self.config.compression
                if self.config.compression in WIRE_FORMATS
                else "none",
                **backend,
            )
        except (dist.DistError, OSError) as err:  # a peer that never came, or went
            raise CollectiveTimeoutError(
                f"rank {self.rank} did not meet its {self.world_size - 1} peers at "
                f"{init_method} within {waits:g} s: {one_line(str(err))}",
                peer=None,
                op="connect",
                rank=self.rank,
            ) from err

    def reconfigure(self, rank: int, world_size: int, *addresses: str) -> None:
        """Leave the old ring and join a new one as ``rank`` of ``world_size``, keeping state.

        The elastic group calls it on survivors after a membership change; every member then
        rolls back to (or adopts) the same commit, so no weights need to be broadcast.
        """
        restart = getattr(self.train, "restart", None)
        if restart is not None:  # a stream per rank is split again among the new members
            restart()
        self.rank, self.world_size = rank, world_size
        self.trainer.global_rank, self.trainer.world_size = rank, world_size
        self.trainer.is_global_zero = rank == 0
        self.step.reconfigure(*addresses)

    # ------------------------------------------------------------------ commits

    def commit(self, step: int, *, defer: bool = False) -> None:
        """Keep a copy of the model and optimizer state at ``step`` in host memory.

        The previous commit is kept too: if the group loses a worker while committing, some
        members may have committed ``step`` and others not, and all roll back to the older.
        Older ones are dropped first, and their host tensors take this one, since allocating
        and pinning host memory costs more than copying into it. A CPU's tensors are copied in
        one call. A GPU's go as asynchronous copies into pinned memory on a stream of their
        own and the commit returns at once: the next steps run while they land, and the next
        optimizer step waits for them on the GPU, not the host (the forward pass, where the
        module has buffers).
        Whatever reads a commit (rollback, a joining worker) waits for its copies first.
        The copies are CPU tensors whatever the device (the same values, bit for bit), so a
        commit takes no GPU memory and can be sent to a joining worker through Ray.

        With ``defer`` (a commit where a call of steps ends, the next call sent ahead) the
        copies are queued only once the next step's input is on its way to the device, or
        before anything changes or reads the state, whichever comes first: queued at once, they
        would hold up that input's copy to the device until they land.
        """
        ahead = self._ran_ahead
        if ahead is not None and ahead.commit == step and step in self._commits:
            return  # held already; the step run ahead of it is the next call's (adoption)
        with self._kept_if_done(self._stage_commit(step, defer=defer)):
            collectives_succeeded(self.step.collective, self.device)
        self._ended_at = step

    def _stage_commit(self, step: int, *, defer: bool) -> _Staged:
        """:meth:`commit` up to the check of the collectives: the state's host copy, its
        copies queued (or, with ``defer``, waiting for the next step's input)."""
        self._undo_ahead()
        self.queue_deferred()  # an earlier commit's copies, before its tensors may be reused
        # The newest commit before ``step`` stays; older ones, and any at or after ``step``
        # (made by steps a rollback undid), go.
        keep = max((s for s in self._commits if s < step), default=None)
        reuse = None
        for old in [s for s in self._commits if s != keep]:
            del self._commits[old]
            self._landed.pop(old, None)  # the copy stream writes in order: no wait to reuse
            reuse = self._commit_tensors.pop(old, None) or reuse
        (model, optimizer), copies = _host_targets(self._commit_parts(step), step, reuse=reuse)
        schedulers = self.optimization.state_dict()
        comm = self._comm_state()
        if defer:
            self._deferred = copies._replace(at=_stream_mark(self.device))
        else:  # on a GPU, queued behind the steps before the host waits for them
            landed = self._queue(copies)
            if landed is not None:
                self._landed[step] = landed
        return _Staged(step, (model, optimizer, schedulers, comm), copies.targets)

    def _commit_parts(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a commit of ``step`` copies: the module's and the optimizer's state, whole;
        where the layout shards the state, what it keeps of it (``DataParallel.commit_parts``:
        two shards of the sharded state, never the whole)."""
        if getattr(self.step, "sharded", None) is not None:
            return self.step.commit_parts(step)
        return self._model_state(), self.optimizer.state_dict()

    def _comm_state(self) -> dict[str, torch.Tensor]:
        """The communication hook's state (PowerSGD's), where the layout has one."""
        comm_state = getattr(self.step, "comm_state", None)
        return {} if comm_state is None else comm_state()

    def comm_state(self) -> dict[str, torch.Tensor]:
        """The communication hook's state at the step the last call of steps ended (a
        checkpoint's: one step run ahead is undone first)."""
        self._undo_ahead()
        return self._comm_state()

    @contextlib.contextmanager
    def _kept_if_done(self, staged: _Staged | None) -> Iterator[None]:
        """Keep the ``staged`` commit once the block (which checks its steps' collectives)
        is done; if it raises, forget it: never a commit of what an aborted collective left."""
        try:
            yield
        except BaseException:
            if staged is not None:
                if self._deferred is not None and self._deferred.step == staged.step:
                    self._deferred = None
                self._landed.pop(staged.step, None)
            raise
        if staged is not None:
            self._commits[staged.step] = staged.state
            self._commit_tensors[staged.step] = staged.targets

    def _queue(self, copies: _Copies) -> torch.cuda.Event | None:
        """Queue (on a GPU) or make (on a CPU) a commit's copies; the event of their landing."""
        landed = copy_to_host(
            copies.targets, copies.sources, stream=self._copy_stream, after=copies.at
        )
        if landed is not None:
            self._copying = landed
        return landed

    def queue_deferred(self) -> None:
        """Queue the copies of a deferred commit (:meth:`commit`), if one waits."""
        copies, self._deferred = self._deferred, None
        if copies is not None:
            landed = self._queue(copies)
            if landed is not None:
                self._landed[copies.step] = landed

    def after_copies(self) -> None:
        """Before the state may change: what the compute stream queues next waits for the
        newest commit's copies, and the host for a background checkpoint's copy."""
        self.queue_deferred()
        if self._copying is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copying)
            self._copying = None
        if self.checkpointer is not None:
            self.checkpointer.fence()

    def _copies_landed(self) -> None:
        """Wait (on the host) until every commit's copies have landed."""
        self.queue_deferred()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def rollback(self, step: int, *, own: bool = True) -> None:
        """Return to the commit of ``step`` (model, optimizer and schedulers, bit for bit).

        The host copies are copied onto the worker's device (``load_state_dict`` moves the
        optimizer state next to its parameters).
        """
        model, optimizer, schedulers, comm = self.committed_state(step)
        self._failed = self._ran_ahead = self._ended_at = None
        self._copies_landed()  # a newer commit's may still read the weights about to change
        self.metric_log.reset()  # what the lost steps logged is not kept
        if self.checkpointer is not None:
            self.checkpointer.fence()  # a background copy may still read the weights
        if _is_sharded(optimizer):  # own shards, or pieces assembled from the members'
            self.step.restore_commit(model, optimizer, in_ring=own)
        else:
            self.write_model(model)
            self.optimizer.load_state_dict(copy.deepcopy(optimizer))
        self.optimization.load_state_dict(copy.deepcopy(schedulers))
        if comm:
            self.step.load_comm_state(comm, own=own)
        self._ended_at = step

    def write_model(self, model: dict[str, torch.Tensor]) -> None:
        """Copy a whole model's state (a commit's) into the module (sharded parameters: this
        worker's shard of it, ``Step.writing``)."""
        with self._writing(), torch.no_grad():
            for name, tensor in self.module.state_dict().items():
                tensor.copy_(model[name])

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict``, whole: where the layout shards the parameters,
        gathered into tensors of their own (collective: every worker calls it alike)."""
        whole = getattr(self.step, "whole_state", None)
        return self.module.state_dict() if whole is None else whole()

    def _writing(self) -> contextlib.AbstractContextManager[None]:
        """Around writing whole weights into the module: where the layout shards the
        parameters, each worker keeps its shard of them."""
        writing = getattr(self.step, "writing", None)
        return contextlib.nullcontext() if writing is None else writing()

    @property
    def shards_parameters(self) -> bool:
        """Whether each worker holds only its shard of the weights between steps (ZeRO-3):
        reading them whole is collective."""
        return bool(getattr(self.step, "shards_parameters", False))

    def committed_state(self, step: int) -> Commit:
        """The commit of ``step`` (CPU tensors, and the schedulers' states), for rolling back or
        for a worker joining."""
        if step not in self._commits:
            raise RuntimeError(f"no commit of step {step}; this worker has {sorted(self._commits)}")
        self.queue_deferred()
        landed = self._landed.pop(step, None)
        if landed is not None:
            landed.synchronize()
        return self._commits[step]

    def handed_commit(self, step: int) -> Commit:
        """The commit of ``step`` as a replacement worker takes it: of a sharded state the
        layout only (it takes its shards from the members' commits once it is in their
        ring)."""
        model, optimizer, schedulers, comm = self.committed_state(step)
        if _is_sharded(optimizer):
            optimizer = handed(optimizer)
        return model, optimizer, schedulers, comm

    def commit_at_state(self) -> Commit | None:
        """The commit this worker's state is at (it rolled back to it or adopted it, and
        nothing ran since), or ``None``."""
        step = self._ended_at
        if step is None or step not in self._commits or self._ran_ahead is not None:
            return None
        return self.committed_state(step)

    def remember(self, step: int, state: dict[str, Any]) -> None:
        """Keep the driver's state at the commit of ``step`` (its history and what the epoch
        logged so far, as a checkpoint records them): a driver restarted after this one's
        was lost goes on from the commit with it (``engine.pool``, adoption), or from a later
        commit, adding what the calls of steps since logged (:meth:`chunks_since`)."""
        self._driver_states[step] = state
        for old in [s for s in self._driver_states if s != step and s not in self._commits]:
            del self._driver_states[old]

    def standing(self) -> tuple[int, list[int], int | None, tuple[int | None, bool]]:
        """For a driver adopting this worker: its rank, the steps of its commits, the step of
        the driver's newest state it keeps (rank 0) and where it is: the step its state is
        at (``None`` where its last call failed or something else changed it) and whether it
        ran the next step ahead of its call."""
        ahead = self._ran_ahead
        at = self._ended_at if self._failed is None else None
        if ahead is not None and ahead.commit != at:
            at = None
        remembered = max(self._driver_states, default=None)
        return self.rank, sorted(self._commits), remembered, (at, ahead is not None)

    def driver_state(self, step: int) -> dict[str, Any]:
        """The driver's state :meth:`remember` kept at ``step``."""
        return self._driver_states[step]

    def chunks_since(self, step: int, until: int) -> list[tuple[int, Logged]] | None:
        """What each call of steps from step ``step`` to step ``until`` logged, with where it
        started, in order; ``None`` where they do not join up (an epoch's end between them,
        where the driver validated and committed)."""
        found, at = [], step
        by_start = {start: (end, logged) for start, end, logged in self._chunks}
        while at < until:
            if at not in by_start:
                return None
            end, logged = by_start[at]
            found.append((at, logged))
            at = end
        return found if at == until else None

    def go_on_from(self, step: int, *, as_it_is: bool) -> None:
        """Go on from step ``step`` after a driver adopted this worker: as it is (its state
        is at that step, and the step it ran ahead, if any, is the next call's), or rolled
        back to its commit of that step."""
        if not as_it_is:
            self.rollback(step)

    def adopt(self, step: int, state: Commit) -> None:
        """Take the survivors' commit of ``step`` as this worker's state."""
        self._copies_landed()
        self._commits = {step: ({k: v.clone() for k, v in state[0].items()}, *state[1:])}
        self._commit_tensors, self._landed = {}, {}
        self.rollback(step, own=False)

    # ------------------------------------------------------------------ hooks

    def add_callbacks(self, callbacks: list[Any], *, loggers: bool) -> None:
        """Callbacks that read the optimizer (``LearningRateMonitor``) run here, on rank 0;
        with ``loggers``, what they log goes with the steps' records to the driver's loggers."""
        self.callbacks = list(callbacks)
        if loggers:
            self.trainer.use_loggers(self.config.log_every_n_steps)

    def callbacks_run(self, hook: str, *args: Any) -> None:
        for callback in getattr(self, "callbacks", ()):
            getattr(callback, hook)(self.trainer, self.module, *args)

    def _hook(self, name: str, *args: Any) -> None:
        """The module's hook ``name``, where the layout runs the module's hooks."""
        if self.step.calls_hooks:
            call_hook(self.module, name, *args)

    def fit_start(self) -> None:
        """Trainer's ``on_fit_start`` and ``on_train_start`` hooks (again when a run resumes,
        as after a Trainer restart)."""
        self._hook("on_fit_start")
        self.callbacks_run("on_train_start")
        self._hook("on_train_start")

    def fit_end(self, epochs: int) -> None:
        """Trainer's ``on_train_end`` and ``on_fit_end``, after ``epochs`` whole epochs."""
        self._undo_ahead()
        self.trainer.current_epoch = epochs
        self._hook("on_train_end")
        self._hook("on_fit_end")
        self._hook("teardown", "fit")

    # ------------------------------------------------------------------ training

    def train_steps(
        self,
        epoch: int,
        first: int,
        count: int,
        commit_at: int | None = None,
        run_next: bool = False,
        epochs: Epochs | None = None,
    ) -> Logged:
        """Run steps ``first .. first + count - 1`` of ``epoch``; then, given ``commit_at``
        (the run's step reached), :meth:`commit` it. ``epochs``: each epoch's global batch,
        where it follows the workers (``TrainConfig.batch_follows_workers``).

        With ``run_next`` (the driver's word that its next call continues with the next step
        of this epoch), that step is queued too before the host waits for these to end, and
        the next call starts after it. On a GPU the host waits for the device where a call
        ends (a commit is kept only once its steps' collectives succeeded); queued on, the
        device runs that step meanwhile instead of idling until the next call has launched
        one, and the host keeps its lead. What that step logs goes with the next call.

        Returns:
            What the module logged (``engine.metrics``), and how many samples this rank saw.
        """
        if self._failed is not None:
            # Sent ahead, behind steps that failed: a peer is gone. Run, they could wait on it
            # outside any collective's deadline (a Ray Dataset's split is handed out to all).
            raise PeerLostError(
                f"steps {first}..{first + count - 1} of epoch {epoch} not run: the steps "
                f"before them failed ({self._failed})",
                peer=getattr(self._failed, "peer", None),
                op="train_steps",
                rank=self.rank,
            )
        self._reached = self._ended_at = None
        try:
            if epochs is not None:
                self._enter(epochs, epoch)
            start = self.epochs.start(epoch) + first
            logged = self._train_steps(epoch, first, count, commit_at, run_next)
        except BaseException as err:
            self._failed = err
            raise
        # A driver lost before it collected these may be adopted (:meth:`chunks_since`).
        self._ended_at = start + count
        self._chunks = [*self._chunks[-(_CHUNKS_KEPT - 1) :], (start, start + count, logged)]
        return logged

    def _enter(self, epochs: Epochs, epoch: int) -> None:
        """Epoch ``epoch`` of ``epochs``: its length for the module's Trainer, and the
        learning-rate factor of its global batch."""
        self.epochs = epochs
        self.trainer.count_epoch(epochs.steps(epoch), epochs.optimizer_start(epoch))
        if self.optimization.lr_scale is not None:
            self.optimization.lr_scale = LrScale(
                self.config.lr_factor(epochs.batch(epoch)), self.config.lr_warmup_steps
            )

    def _train_steps(
        self, epoch: int, first: int, count: int, commit_at: int | None, run_next: bool
    ) -> Logged:
        self._samples = 0
        ahead, self._ran_ahead = self._ran_ahead, None
        if ahead is not None:
            if (ahead.epoch, ahead.step) != (epoch, first):
                raise RuntimeError(
                    f"steps {first}..{first + count - 1} of epoch {epoch} asked for, where "
                    f"step {ahead.step} of epoch {ahead.epoch} already ran"
                )
            first, count, self._samples = first + 1, count - 1, ahead.samples
        self.trainer.at(epoch, first)
        if first == 0:
            self._reload_train(epoch)
            self.metric_log.enter("on_train_epoch_start")
            self.callbacks_run("on_train_epoch_start")
            self._hook("on_train_epoch_start")
        self._run(epoch, first, count)
        samples = self._samples
        ended = _stream_mark(self.device)
        # On a GPU the host is still steps ahead: what was logged is queued to the host now,
        # and read once the host has waited for the steps; a commit's copies go behind the
        # next step's input.
        self.metric_log.fetch()
        rows = self.trainer.recorder.take()
        staged = None if commit_at is None else self._stage_commit(commit_at, defer=True)
        with self._kept_if_done(staged):
            if run_next:
                after = first + count
                self._ran_ahead = _RanAhead(epoch, after, self._run(epoch, after, 1), commit_at)
            collectives_succeeded(self.step.collective, self.device, until=ended)
        logged = self.metric_log.take()
        logged.samples = samples
        logged.rows = rows
        return logged

    def _run(self, epoch: int, first: int, count: int) -> int:
        """Run steps ``first .. first + count - 1`` of ``epoch``; the samples this worker
        counted (a pipeline's last stage counts its replica's), also added to the call's.

        Where the workers may go on from a failed step (:meth:`reached`), each step starts
        with a mark of what was logged, and a step that fails with nothing of it kept (its
        optimizer had not begun to step) leaves the worker where the step began."""
        if count == 0:
            return 0
        samples = 0
        marks = self._goes_on()
        ranks, full = self.shares(), self.config.workers
        window = self.config.accumulate_grad_batches
        every = self.config.log_every_n_steps
        origin = self.epochs.start(epoch)
        for step, mine, global_size in epoch_batches(
            self.train,
            self.config,
            epoch=epoch,
            first=first,
            count=count,
            rank=0 if ranks else self.rank,
            world_size=1 if ranks else self.world_size,
            device=self.device,
            batch_size=self.epochs.batch(epoch),
            start=origin,
        ):
            parts: tuple[Share, ...] = ()
            if ranks and global_size % full == 0:
                parts = tuple(
                    Share(
                        rank,
                        step_seed(self.config.seed, origin + step, rank),
                        split_global_batch(mine, rank=rank, world_size=full),
                    )
                    for rank in ranks
                )
                mine = torch.cat([part.samples for part in parts])
            elif ranks:  # unequal parts: this worker's part of the members' split, as before
                seed_generators(step_seed(self.config.seed, origin + step, self.rank), self.device)
                mine = split_global_batch(mine, rank=self.rank, world_size=self.world_size)
            self.module.train()
            last = step == self.epochs.steps(epoch) - 1
            steps = step % window == window - 1 or last
            self.trainer.at(epoch, step)
            # Trainer asks at every batch whether the next optimizer step is due for the
            # loggers (LearningRateMonitor reads it); the module's values are taken at the
            # stepping batch.
            stepped = self.trainer._batches_that_stepped
            self.trainer.logs_due = every > 0 and (stepped + 1) % every == 0
            batch = Batch(
                epoch=epoch,
                step=step,
                mine=mine,
                global_size=global_size,
                window=window,
                opens_window=step % window == 0,
                steps=steps,
                last=last,
                log_step=stepped if steps and self.trainer.logs_due else None,
                shares=parts,
            )
            mark = self.metric_log.mark() if marks else None
            try:
                done = self.step.train(batch)
            except BaseException:
                if mark is not None and not self.step.stepping:
                    self.metric_log.undo(mark)
                    self._reached = Reached(self.epochs.start(epoch) + step, self._samples)
                raise
            samples += done
            self._samples += done
        return samples

    def shares(self) -> tuple[int, ...]:
        """The ranks of the run's full size (``TrainConfig.workers``) whose parts of each
        global batch this worker trains while fewer workers train: each part apart, seeded as
        its rank is, their gradients summed and the sum over the members divided by that
        size, as the ring of the full size divides it. So the steps do the same math
        whoever is left: where one worker is left of two, bit for bit the sums the ring
        forms. Empty (one pass over its part of the members' split) where the run trains
        at its full size, or where parts are not the whole story: accumulation, manual
        optimisation, buffers, a communication hook, a global batch that follows the
        workers, an input read as one stream per rank, ``sync_batchnorm`` (whose
        statistics are those of the members' parts together: the whole global batch) or
        sharded state (every member's passes meet in collectives: a gather before each
        unit's forward under ZeRO-3, a reduce-scatter of each bucket under ZeRO-2)."""
        full, members = self.config.workers, self.world_size
        if (
            members >= full
            or not self._steps_each_batch()
            or self.config.batch_follows_workers
            or self.config.compression not in WIRE_FORMATS
            or self.config.sync_batchnorm
            or self.config.shard != "none"
            or hasattr(self.train, "epoch_order")
        ):
            return ()
        return tuple(int(r) for r in torch.tensor_split(torch.arange(full), members)[self.rank])

    def _steps_each_batch(self) -> bool:
        """A data-parallel worker whose step changes only the weights and the optimizer, at
        every batch: automatic optimisation, no accumulation, no buffers."""
        return (
            hasattr(self.step, "stepping")  # a data-parallel worker's step
            and not self.optimization.manual
            and self.config.accumulate_grad_batches == 1
            and not self.has_buffers
        )

    def _goes_on(self) -> bool:
        """Whether a failed step can leave this worker where the step began, so that the
        members may go on from it instead of rolling back to their last commit: a
        data-parallel worker on a CPU that steps its optimizer where ringflow does, every
        batch, with nothing else that a step's forward or collectives change (buffers,
        a communication hook's state, a Metric's), nothing callbacks record and no stream."""
        return (
            self.device.type == "cpu"
            and self._steps_each_batch()
            and not self.config.timeline
            and not getattr(self, "callbacks", ())
            and not self.metric_log.live
            and not hasattr(self.train, "restart")
            and not self.step.keeps_comm_state
        )

    def reached(self) -> tuple[int, Logged] | None:
        """Where the last call of steps failed, if the members may go on from there: the
        global step that failed (nothing of it kept: this worker is as at its start) and what
        the steps of the call before it logged; ``None`` where the worker must roll back
        (sharded state: a lost worker's shard of it lives on only in the commits)."""
        if self._failed is None or self._reached is None or self.config.shard != "none":
            return None
        logged = self.metric_log.take()
        logged.samples = self._reached.samples
        return self._reached.step, logged

    def go_on(self) -> None:
        """Go on from where the last call of steps failed (:meth:`reached`), without a
        rollback: the steps sent after it are forgotten."""
        self._failed = self._ran_ahead = self._reached = self._ended_at = None

    def _undo_ahead(self) -> None:
        """Return to where the last call of steps ended, if it ran the next step ahead and
        what follows is not that step's call (nothing the driver sends; a safeguard)."""
        ahead = self._ran_ahead
        if ahead is None:
            return
        if ahead.commit is None:
            raise RuntimeError(
                f"step {ahead.step} of epoch {ahead.epoch} ran ahead of its call, which did "
                "not come, and no commit holds the state before it"
            )
        self.rollback(ahead.commit)

    def train_epoch_end(self, epoch: int) -> Logged:
        """Trainer's ``on_train_epoch_end`` (after the epoch's validation); what it logged."""
        self._undo_ahead()
        self._ended_at = None  # the module's hook may change its state
        self.trainer.at(epoch, self.epochs.steps(epoch))  # after the epoch's last optimizer step
        self.metric_log.enter("on_train_epoch_end")
        self._hook("on_train_epoch_end")
        return self.metric_log.take()

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        """After epoch ``epoch``'s validation: step the schedulers that wait for its metrics."""
        self._undo_ahead()
        self._ended_at = None  # the schedulers step
        self.trainer.callback_metrics = {k: torch.tensor(v) for k, v in metrics.items()}
        self.optimization.after_validation(epoch, metrics)

    def evaluate(self, split: str) -> Logged:
        """Evaluate this worker's part of ``split`` (the module's validation or test step, or
        a pipeline's loss and metrics); nothing, as under Trainer, where the module has no
        step for it or the data no such split."""
        self._undo_ahead()
        if not self._evaluates(split):
            return Logged()
        if split not in self._evaluated:  # opened once: evaluation runs every epoch
            self._evaluated[split] = self.step.split(split)
        return self.step.evaluate(split, self._evaluated[split])

    def _evaluates(self, split: str) -> bool:
        step = "test_step" if split == "test" else "validation_step"
        if self.step.calls_hooks and not overrides(self.module, step):
            return False
        return has_split(self.data, split)

    # ------------------------------------------------------------------ checkpoints

    def warm_start(self, model_uri: str) -> None:
        """Start from the weights of the committed model at ``model_uri`` (fresh optimizer);
        a pipeline stage takes those of its layers."""
        state = self.step.own(read_checkpoint(model_uri).state_dict)
        check_warm_start(type(self.module).__name__, state, self.module.state_dict(), model_uri)
        with self._writing():
            self.module.load_state_dict(state, strict=True)

    def save_lightning_checkpoint(
        self, filepath: str, weights_only: bool, callbacks: dict[str, Any]
    ) -> None:
        """Write the ``.ckpt`` file ``Trainer.save_checkpoint`` writes (``ModelCheckpoint``'s)
        to ``filepath``, any fsspec URL, through Lightning's own checkpoint IO. Where the
        weights or the optimizer state are sharded every worker is called, gathers them, and
        rank 0 writes."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        state = self._model_state()
        sharded = getattr(self.step, "sharded", None)
        # a sharded optimizer's whole state, gathered (every worker is called alike)
        optimizers = None if weights_only or sharded is None else [sharded.state_dict()]
        if (self.shards_parameters or sharded is not None) and self.rank != 0:
            return
        checkpoint = lightning_checkpoint(
            self.module,
            self.optimization,
            self.trainer,
            weights_only=weights_only,
            callbacks=callbacks,
            state_dict=state,
            optimizer_states=optimizers,
        )
        TorchCheckpointIO().save_checkpoint(checkpoint, filepath)

    def remove_lightning_checkpoint(self, filepath: str) -> None:
        """Remove a ``.ckpt`` file :meth:`save_lightning_checkpoint` wrote (rank 0 does)."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        if self.rank != 0:
            return
        TorchCheckpointIO().remove_checkpoint(filepath)

    def restore(self, store_url: str, checkpoint: CommittedCheckpoint) -> int:
        """Load the model and optimizer state of ``checkpoint``, whatever layout wrote it;
        return its step."""
        store = CheckpointStore(store_url)
        restore_own = getattr(self.step, "restore_own", None)  # a sharded worker's pieces
        if restore_own is None or not restore_own(store, checkpoint):
            tensors = self.step.load(store, checkpoint)
            with self._writing():
                load_training_state(
                    self.module, self.optimizer, tensors, checkpoint.metadata["optimizer"]
                )
        self.optimization.load_state_dict(checkpoint.metadata.get("optimization", {}))
        self._hook("on_load_checkpoint", dict(checkpoint.metadata.get("module", {})))
        return checkpoint.step

    def checkpoint(
        self,
        store_url: str,
        run_key: str,
        *,
        step: int,
        metadata: dict[str, Any],
        metrics: dict[str, float],
        comm_states: list[dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """Queue the replicated training state for an asynchronous save (rank 0 only), and
        each rank's communication hook state (``comm_states``, by rank) as a shard of its own.

        Training is blocked only while the tensors are copied to host memory; the write to
        storage happens in the background and never moves "latest" unless it commits.
        """
        self._undo_ahead()
        if self.checkpointer is None:
            self.checkpointer = AsyncCheckpointer(CheckpointStore(store_url), check_writable=False)

        metadata = {
            **metadata,
            "optimization": self.optimization.state_dict(),
            "module": module_checkpoint(self.module),
        }

        def collect() -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
            tensors, optimizer_meta = training_state(self.module, self.optimizer)
            ranks = {rank_shard(r): state for r, state in enumerate(comm_states or []) if state}
            return {REPLICATED: tensors, **ranks}, {**metadata, "optimizer": optimizer_meta}

        # Gathering the state, like copying it, runs in the background while the next
        # forward and backward pass run; the optimizer step (and the forward pass of a
        # module with buffers) waits for it.
        self.checkpointer.save(run_key, step=step, collect=collect, metrics=metrics, overlap=True)

    def optimizer_state_bytes(self) -> int:
        """Bytes of the optimizer state tensors this worker holds (a sharded one's: its
        shard's)."""
        state = self.optimization.optimizer.state
        return sum(
            value.numel() * value.element_size()
            for entry in state.values()
            for value in entry.values()
            if isinstance(value, torch.Tensor)
        )

    def training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """This worker's model and optimizer state by full name, on the host, and its
        schedulers' states (a pipeline's stages each give theirs, and sharded data-parallel
        workers each their shard: ``engine.layout``)."""
        self._undo_ahead()
        own = getattr(self.step, "own_training_state", None)
        state = None if own is None else own()
        tensors, metadata = training_state(self.module, self.optimizer) if state is None else state
        tensors = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        return tensors, metadata, self.optimization.state_dict()

    def write_shard(
        self, store_url: str, run_key: str, step: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Write this worker's training state as its shard of checkpoint ``step``, in the
        background (a pipeline stage's, ``engine.layout.Pipeline``): training waits only for
        the copy to host memory. Returns what the manifest records besides the shard: the
        optimizer's metadata and the schedulers' states; :meth:`shard_written` gives the
        shard's record once it is written. One write at a time: a second waits for the first.
        A worker whose layout has another write its state (a sharded stage's replicas but
        the first, which gather it with that one: ``PipelineStep.writes``) writes nothing.
        """
        tensors, optimizer_meta, optimization = self.training_state()
        if not getattr(self.step, "writes", True):
            return optimizer_meta, optimization
        self._shard_writes.wait()
        store = CheckpointStore(store_url)
        write = functools.partial(
            store.write_shard, run_key, step=step, name=self.step.shard, tensors=tensors
        )
        self._shard_writes.start(step, write)
        return optimizer_meta, optimization

    def write_own_shard(self, store_url: str, run_key: str, step: int) -> dict[str, Any]:
        """:meth:`write_shard` for a sharded data-parallel worker, every one of which writes
        its shard: returns the optimizer's metadata (``optimizer``, this worker's part), the
        schedulers' states (``optimization``) and, from rank 0, what the module's
        ``on_save_checkpoint`` adds (``module``)."""
        optimizer_meta, optimization = self.write_shard(store_url, run_key, step)
        module = module_checkpoint(self.module) if self.rank == 0 else None
        return {"optimizer": optimizer_meta, "optimization": optimization, "module": module}

    def shard_written(self, step: int, wait: bool) -> dict[str, Any]:
        """Where the write of this worker's shard of checkpoint ``step`` is: ``state``
        ``written`` (with its ``record``), ``writing`` (``wait`` false), ``failed`` (with the
        ``error``) or ``none`` (this worker writes none of ``step``: it joined later)."""
        return self._shard_writes.result(step, wait=wait)

    def flush_checkpoints(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait for background saves; return the last committed step and any failures."""
        if self.checkpointer is None:
            return {"committed_step": None, "errors": [], "stalled_s": 0.0}
        saver = self.checkpointer
        saver.close(timeout_s)
        self.checkpointer = None
        committed = saver.last_committed
        return {
            "committed_step": None if committed is None else committed.step,
            "errors": [failure.error for failure in saver.errors],
            "stalled_s": saver.stalled_s,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights (a pipeline stage's: its layers') as CPU tensors: the driver
        may have no GPU. Where the weights are sharded, every worker gathers them (each is
        called) and rank 0 returns them; the others return nothing."""
        self._undo_ahead()
        state = self._model_state()
        if self.shards_parameters and self.rank != 0:
            return {}
        return _host_copy(state)[0]

    def timeline_spans(self) -> list[dict[str, Any]]:
        """The spans this worker recorded (``engine.timeline``); each is returned once."""
        return [] if self.timeline is None else self.timeline.spans(self.rank)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
        self._shard_writes.close()
        if self.timeline is not None:
            self.timeline.close()
        for samples in (self.train, *self._evaluated.values()):
            if hasattr(samples, "close"):  # a stream's reading thread
                samples.close()
        self.step.close()


@torch.no_grad()
def evaluate_module(
    module: torch.nn.Module,
    samples: Samples,
    *,
    split: str,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    first_step: int = 0,
    device: torch.device | str | None = None,
    precision: Precision | None = None,
    log: MetricLog | None = None,
) -> Logged:
    """Run ``test_step`` (for ``split == "test"``) or ``validation_step`` over this rank's
    part of the ``samples``, between the module's ``on_{validation,test}_epoch_start`` and
    ``_end`` hooks.

    The samples go in order in batches of ``batch_size``, as Trainer's evaluation loader
    gives them; each of ``world_size`` ranks takes its part of every batch, so a value a
    step logs ``on_step`` is, merged over the ranks, the value of Trainer's batch, recorded
    at ``first_step`` plus the batch's index (Trainer counts evaluation batches over the
    whole fit for its evaluation rows).
    Each batch is moved to ``device``; ``None`` means where the module's parameters are. The
    steps run in the training's ``precision`` (autocast, or bfloat16 inputs), as Trainer's do.

    Returns:
        What the module logged, weighted by batch size, and the number of samples.
    """
    if device is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if log is None:
        log = MetricLog()
        module.log, module.log_dict = log.log, log.log_dict
    stage = "test" if split == "test" else "validation"
    step = module.test_step if stage == "test" else module.validation_step
    module.eval()
    log.enter(f"on_{stage}_epoch_start")
    call_hook(module, f"on_{stage}_epoch_start")
    seen = 0
    for i, start in enumerate(range(0, len(samples), batch_size)):
        whole = torch.arange(start, min(start + batch_size, len(samples)))
        part = split_global_batch(whole, rank=rank, world_size=world_size)
        if not len(part):
            continue
        seen += len(part)
        batch = to_device(samples.batch(part), device)
        log.enter(f"{stage}_step", batch_size=len(part), log_step=first_step + i)
        if precision is None:
            step(*step_arguments(step, batch, i))
        else:
            with precision.forward_context():
                step(*step_arguments(step, precision.convert_input(batch), i))
    log.enter(f"on_{stage}_epoch_end")
    call_hook(module, f"on_{stage}_epoch_end")
    logged = log.take()
    logged.samples = seen
    return logged


def collectives_succeeded(
    collective: Collective | None,
    device: torch.device,
    *,
    until: torch.cuda.Event | None = None,
) -> None:
    """Raise ``PeerLostError`` if a collective of the steps so far (those queued before
    ``until``, on a GPU) failed on the device.

    On a GPU the host queues steps ahead and a gradient all-reduce may pass its deadline
    after its ``wait`` returned (a peer lost, or later than the deadline): its kernels are
    aborted and the weights stepped with meaningless sums. Waiting for the device first, the
    failure is known by then, and the steps fail as if the collective had raised.
    """
    if collective is None:
        return
    if device.type == "cuda":
        if until is not None:
            until.synchronize()
        else:
            torch.cuda.current_stream(device).synchronize()
    collective.check()


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` (tensors, or tuples, lists and dicts of them) on ``device``.

    Host tensors bound for a GPU go through pinned memory without blocking: a copy from
    pageable memory first waits for everything the GPU has queued, so the host would stop
    launching the next step until the last one finished, and the GPU would then wait for it.
    """
    if isinstance(batch, torch.Tensor):
        if batch.device.type == "cpu" and torch.device(device).type == "cuda":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, list | tuple) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class _ShardWrites:
    """A worker's shard write in the background (:meth:`Worker.write_shard`): one at a time,
    so host memory holds at most the shard being written and the next one's copy."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._step: int | None = None
        self._future: concurrent.futures.Future | None = None

    def start(self, step: int, write: Any) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "ringflow-shard-write")
        self._step, self._future = step, self._pool.submit(write)

    def wait(self) -> None:
        if self._future is not None:
            concurrent.futures.wait([self._future])

    def result(self, step: int, *, wait: bool) -> dict[str, Any]:
        # The outcome stays readable until the next write starts: the driver asks every
        # stage, and asks again while another stage is still writing.
        if self._future is None or self._step != step:
            return {"state": "none"}
        if not wait and not self._future.done():
            return {"state": "writing"}
        try:
            return {"state": "written", "record": self._future.result()}
        except Exception as err:  # storage's, retried there: the checkpoint is not committed
            return {"state": "failed", "error": f"{type(err).__name__}: {err}"}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class _Staged(NamedTuple):
    """A commit made up to the check of its steps' collectives (``Worker.commit``)."""

    step: int
    state: Commit
    targets: list[torch.Tensor]


class Reached(NamedTuple):
    """The global step a call of steps failed at, nothing of it kept, and the samples of the
    call's steps before it (``Worker.reached``)."""

    step: int
    samples: int


_CHUNKS_KEPT = 8
"""Calls of steps a worker keeps what they logged of (``Worker.chunks_since``): a driver is
never more than a commit and the calls it sent ahead behind its workers."""


class _RanAhead(NamedTuple):
    """Step ``step`` of ``epoch``, run ahead of its call where the call before it ended,
    committing ``commit`` (``Worker.train_steps``)."""

    epoch: int
    step: int
    samples: int
    commit: int | None


class _Copies(NamedTuple):
    """A commit's copies to make: each of ``sources`` into its host tensor in ``targets``,
    the sources' values as of the stream position ``at`` (``None``: when queued)."""

    step: int
    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    at: torch.cuda.Event | None = None


def _stream_mark(device: torch.device) -> torch.cuda.Event | None:
    """An event at the current stream's position (on a GPU): what it queued so far."""
    if device.type != "cuda":
        return None
    mark = torch.cuda.Event()
    mark.record(torch.cuda.current_stream(device))
    return mark


def _host_copy(
    value: Any,
    *,
    reuse: list[torch.Tensor] | None = None,
    stream: torch.cuda.Stream | None = None,
) -> tuple[Any, list[torch.Tensor], torch.cuda.Event | None]:
    """A deep copy of ``value`` (state dicts) with every tensor copied to host memory, the
    ``i``-th into ``reuse[i]`` where that has its shape and dtype; returns the copy, its
    tensors (``reuse`` for the next copy) and, with ``stream``, the event of the GPU's copies
    queued on it (:func:`copy_to_host`)."""
    copied, copies = _host_targets(value, 0, reuse=reuse)
    return copied, copies.targets, copy_to_host(copies.targets, copies.sources, stream=stream)


def _is_sharded(optimizer: Mapping[str, Any]) -> bool:
    """Whether a commit's optimizer state is a sharded layout's (``engine.sharded_commit``)."""
    return "held" in optimizer


def _host_targets(
    value: Any, step: int, *, reuse: list[torch.Tensor] | None = None
) -> tuple[Any, _Copies]:
    """:func:`_host_copy`'s copy of ``value``, its host tensors not yet written, and the
    copies that write them."""
    spare = reuse or []
    sources: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []

    def walk(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            i = len(sources)
            sources.append(item.detach())
            old = spare[i] if i < len(spare) else None
            fits = old is not None and (old.shape, old.dtype) == (item.shape, item.dtype)
            targets.append(old if fits else host_buffer(item))
            return targets[-1]
        if isinstance(item, Mapping):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, list | tuple) and not hasattr(item, "_fields"):
            return type(item)(walk(v) for v in item)
        return copy.deepcopy(item)

    copied = walk(value)
    return copied, _Copies(step, targets, sources)
