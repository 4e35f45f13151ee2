"""The LightningModule contract as ``lightning.Trainer`` runs it: precision, optimizers and
schedulers, gradient clipping.

Precision is spelled as Lightning spells it (:data:`PRECISIONS`): ``bf16-mixed`` and
``16-mixed`` run every step under ``torch.autocast`` (``16-mixed`` with a gradient scaler,
GPU only), ``bf16-true`` converts the module and its floating inputs to bfloat16. Gradients
travel through the ring in the dtype they have.

``configure_optimizers`` is read by Lightning's own parser, so everything it may return means
what it means under Trainer: an optimizer, lists, ``([optimizers], [schedulers])``, a dict
with ``lr_scheduler`` (a scheduler or a dict with ``interval``, ``frequency``, ``monitor``,
``strict``) and ``ReduceLROnPlateau``. Schedulers step when Trainer steps them:

- ``interval="step"``: after the optimizer step of every ``frequency``-th batch of an epoch;
- ``interval="epoch"``: at the last batch of every ``frequency``-th epoch, before validation;
- ``ReduceLROnPlateau`` (``interval="epoch"``): after validation, with the monitored metric
  averaged over every worker's samples.

What ringflow does not honour is refused by name when the module is built: several
optimizers, manual optimisation, and a ``ReduceLROnPlateau`` stepped every batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ringflow.engine.config import PRECISIONS
from ringflow.engine.errors import ModelError
from ringflow.engine.jsonstate import from_json, to_json

__all__ = [
    "CLIP_ALGORITHMS",
    "PRECISIONS",
    "Optimization",
    "refuse_manual_optimisation",
    "Precision",
    "clip_gradients",
    "compile_in_place",
    "compiled_in_buckets",
]

CLIP_ALGORITHMS = ("norm", "value")
"""``TrainConfig.gradient_clip_algorithm``, as Lightning names them."""
"""``TrainConfig.precision``, as Lightning names them."""


class Precision:
    """How a step's forward runs and its loss goes backward, for one ``precision``."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name, self.device = name, device
        self.scaler = torch.amp.GradScaler(device.type) if name == "16-mixed" else None

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16) if self.name == "bf16-true" else module

    def convert_input(self, batch: Any) -> Any:
        """``bf16-true``: the batch's floating tensors to bfloat16."""
        if self.name != "bf16-true":
            return batch
        if isinstance(batch, torch.Tensor):
            return batch.to(torch.bfloat16) if batch.is_floating_point() else batch
        if isinstance(batch, list | tuple):
            return type(batch)(self.convert_input(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.convert_input(v) for k, v in batch.items()}
        return batch

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if self.name in ("bf16-mixed", "16-mixed"):
            dtype = torch.bfloat16 if self.name == "bf16-mixed" else torch.float16
            with torch.autocast(self.device.type, dtype=dtype, cache_enabled=False):
                yield
        elif self.name == "bf16-true":
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()


@dataclass(kw_only=True)
class _Schedule:
    scheduler: Any
    interval: str
    frequency: int
    monitor: str | None
    strict: bool
    plateau: bool


def refuse_manual_optimisation(module: torch.nn.Module) -> None:
    """Refuse a module that steps its optimizer itself: checked by the driver on the module
    it builds before any worker starts, and by each worker.

    Raises:
        ModelError: the module sets ``automatic_optimization = False``.
    """
    if getattr(module, "automatic_optimization", True) is False:
        raise ModelError(
            f"{type(module).__name__} sets automatic_optimization = False: manual optimisation "
            "is not supported by ringflow yet; let Lightning's automatic optimisation step"
        )


class Optimization:
    """The one optimizer of a module and its learning-rate schedulers.

    Raises:
        ModelError: ``configure_optimizers`` returns something ringflow does not honour.
    """

    def __init__(self, module: torch.nn.Module, precision: Precision | None = None) -> None:
        from lightning.pytorch.core.optimizer import (
            _configure_optimizers,
            _configure_schedulers_automatic_opt,
        )
        from lightning.pytorch.utilities.exceptions import MisconfigurationException

        name = type(module).__name__
        refuse_manual_optimisation(module)
        try:
            optimizers, schedulers, monitor = _configure_optimizers(module.configure_optimizers())
            configs = _configure_schedulers_automatic_opt(schedulers, monitor)
        except MisconfigurationException as err:
            raise ModelError(f"{name}.configure_optimizers(): {err}") from None
        if len(optimizers) != 1:
            kinds = ", ".join(type(o).__name__ for o in optimizers) or "none"
            raise ModelError(
                f"{name}.configure_optimizers() returned {len(optimizers)} optimizers ({kinds}): "
                "ringflow trains with one optimizer (several param groups are fine); several "
                "optimizers need manual optimisation, which it does not support yet"
            )
        self.module, self.optimizer = module, optimizers[0]
        self.precision = precision or Precision("32-true", torch.device("cpu"))
        self.configs = configs  # Lightning's LRSchedulerConfigs, as Trainer holds them
        self.schedules = [
            _Schedule(
                scheduler=c.scheduler,
                interval=c.interval,
                frequency=c.frequency,
                monitor=c.monitor,
                strict=c.strict,
                plateau=c.reduce_on_plateau,
            )
            for c in configs
        ]
        for schedule in self.schedules:
            if schedule.plateau and schedule.interval == "step":
                raise ModelError(
                    f"{name}: a ReduceLROnPlateau stepped every batch (interval 'step') is not "
                    "supported; step it every epoch on a validation metric"
                )

    def step(
        self,
        batch_idx: int,
        *,
        last: bool,
        clip_val: float | None,
        clip_algorithm: str,
        across: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """The optimizer step of batch ``batch_idx`` on the averaged gradients, as Trainer
        takes it: unscale (``16-mixed``), clip, step (skipped by the scaler on non-finite
        gradients), then the schedulers due.

        ``across`` sums a tensor over the workers that hold the other parts of the model (a
        pipeline's stages): the gradient's norm is then the whole model's, and a step is
        skipped on every stage where any stage's gradients overflowed."""
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            if across is not None:
                _agree_on_overflow(scaler, self.optimizer, across)
        call_hook(self.module, "on_before_optimizer_step", self.optimizer)
        clip_gradients(self.optimizer, clip_val, clip_algorithm, across=across)
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.after_batch(batch_idx, last=last)

    def step_in_two(
        self, batch_idx: int, *, last: bool, ready: list[torch.Tensor], wait: Callable[[], None]
    ) -> None:
        """The optimizer step of batch ``batch_idx`` in two parts: the parameters whose
        averaged gradients are ``ready`` first, while the others' still reduce; then
        ``wait()`` for those and step the rest. Only where nothing reads every gradient
        before the step (:meth:`steps_in_two`); the same result, bit for bit, as :meth:`step`:
        torch's optimizers update each parameter from its own gradient and state alone."""
        call_hook(self.module, "on_before_optimizer_step", self.optimizer)
        first = {id(p) for p in ready}
        _step_only(self.optimizer, lambda p: id(p) in first)
        wait()
        _step_only(self.optimizer, lambda p: id(p) not in first)
        self.after_batch(batch_idx, last=last)

    def steps_in_two(self, *, clip_val: float | None) -> bool:
        """Whether :meth:`step_in_two` may replace :meth:`step`: one of torch's optimizers
        that update each parameter alone, no step hooks, no clipping or gradient scaler,
        and no hook of the module's own between backward and the step."""
        from lightning.pytorch import LightningModule

        overridden = [
            name
            for name in ("on_after_backward", "on_before_optimizer_step")
            if getattr(type(self.module), name, None) is not getattr(LightningModule, name)
            and hasattr(self.module, name)
        ]
        hooks = getattr(self.optimizer, "_optimizer_step_pre_hooks", None) or getattr(
            self.optimizer, "_optimizer_step_post_hooks", None
        )
        return (
            type(self.optimizer) in _PER_PARAMETER
            and not hooks
            and not clip_val
            and self.precision.scaler is None
            and not overridden
        )

    def after_batch(self, batch_idx: int, *, last: bool) -> None:
        """Step the schedulers due after the optimizer step of batch ``batch_idx`` of an epoch
        (``last``: the epoch's last batch, where epoch-interval schedulers step)."""
        for schedule in self.schedules:
            if schedule.plateau:
                continue
            if schedule.interval == "step" and (batch_idx + 1) % schedule.frequency == 0:
                self._step(schedule, None)
        if last:
            self._epoch_schedules(plateau=False, epoch=None, metrics={})

    def after_validation(self, epoch: int, metrics: dict[str, float]) -> None:
        """Step the ``ReduceLROnPlateau`` schedulers due after epoch ``epoch``'s validation."""
        self._epoch_schedules(plateau=True, epoch=epoch, metrics=metrics)

    def _epoch_schedules(self, *, plateau: bool, epoch: int | None, metrics: dict) -> None:
        for schedule in self.schedules:
            if schedule.plateau != plateau or schedule.interval != "epoch":
                continue
            if epoch is not None and (epoch + 1) % schedule.frequency:
                continue
            value = None
            if plateau:
                if schedule.monitor not in metrics:
                    if schedule.strict:
                        raise ModelError(
                            f"ReduceLROnPlateau monitors {schedule.monitor!r}, which is not "
                            f"reported; the metrics are {sorted(metrics)}"
                        )
                    continue
                value = torch.tensor(metrics[schedule.monitor])
            self._step(schedule, value)

    def _step(self, schedule: _Schedule, value: Any) -> None:
        hook = getattr(self.module, "lr_scheduler_step", None)
        if callable(hook):  # a LightningModule's, which a module may override
            hook(schedule.scheduler, value)
        elif value is None:
            schedule.scheduler.step()
        else:
            schedule.scheduler.step(value)

    def state_dict(self) -> dict[str, Any]:
        """Every scheduler's state, and the gradient scaler's, as JSON (checkpoints keep it)."""
        scaler = self.precision.scaler
        return {
            "schedulers": [
                to_json(s.scheduler.state_dict(), what="a learning-rate scheduler's state")
                for s in self.schedules
            ],
            "scaler": None if scaler is None else to_json(scaler.state_dict(), what="scaler"),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("schedulers", [])
        if state.get("scaler") is not None and self.precision.scaler is not None:
            self.precision.scaler.load_state_dict(from_json(state["scaler"]))
        if len(states) != len(self.schedules):
            raise ValueError(
                f"the checkpoint holds {len(states)} scheduler states, the module configures "
                f"{len(self.schedules)}"
            )
        for schedule, state in zip(self.schedules, states, strict=True):
            schedule.scheduler.load_state_dict(from_json(state))


# The LightningModule methods ringflow calls where Trainer calls them (engine.worker); a module
# overriding another hook of Trainer's loop is named in a warning when a run starts.
CALLED_HOOKS = frozenset(
    {
        "setup",
        "configure_model",
        "teardown",
        "on_fit_start",
        "on_fit_end",
        "on_train_start",
        "on_train_end",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_test_epoch_start",
        "on_test_epoch_end",
        "on_save_checkpoint",
        "on_load_checkpoint",
    }
)
_OTHER_HOOKS = ("configure_gradient_clipping", "optimizer_step", "optimizer_zero_grad", "backward")


def uncalled_hooks(module_cls: type, *, called: frozenset[str] = CALLED_HOOKS) -> list[str]:
    """The hooks of Trainer's loop ``module_cls`` overrides that ringflow does not call."""
    import lightning as L
    from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks

    hooks = {
        name
        for base in (ModelHooks, DataHooks, CheckpointHooks)
        for name, value in vars(base).items()
        if callable(value) and not name.startswith("_")
    }
    hooks.update(_OTHER_HOOKS)
    hooks -= {"prepare_data", "configure_sharded_model"}  # a data module's; deprecated
    return sorted(
        name
        for name in hooks - called
        if getattr(module_cls, name, None) is not getattr(L.LightningModule, name, None)
    )


_PER_PARAMETER = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
}
"""torch's optimizers whose step updates each parameter from its own gradient and state."""


def _step_only(optimizer: torch.optim.Optimizer, chosen: Callable[[torch.Tensor], bool]) -> None:
    """``optimizer.step()`` over the parameters ``chosen`` picks, each group keeping its
    settings (its parameter list is narrowed for the call, then given back)."""
    groups = optimizer.param_groups
    everyone = [group["params"] for group in groups]
    try:
        for group, params in zip(groups, everyone, strict=True):
            group["params"] = [p for p in params if chosen(p)]
        optimizer.step()
    finally:
        for group, params in zip(groups, everyone, strict=True):
            group["params"] = params


def call_hook(module: torch.nn.Module, name: str, *args: Any) -> Any:
    """Call the module's hook ``name`` if it has one (a LightningModule has them all)."""
    hook = getattr(module, name, None)
    return hook(*args) if callable(hook) else None


class TrainerView:
    """The ``Trainer`` a module's own code reads in a worker (``self.trainer``,
    ``self.current_epoch``, ``self.global_step``, ``estimated_stepping_batches``...).

    ``global_step`` counts optimizer steps, as Trainer's does; the driver's step counts
    batches.
    """

    def __init__(
        self, *, max_epochs: int, steps_per_epoch: int, accumulate: int, rank: int, world_size: int
    ) -> None:
        self.max_epochs, self.num_training_batches = max_epochs, steps_per_epoch
        self.accumulate_grad_batches = accumulate
        self.optimizer_steps_per_epoch = -(-steps_per_epoch // accumulate)
        self.estimated_stepping_batches = max_epochs * self.optimizer_steps_per_epoch
        self.global_rank, self.world_size, self.local_rank, self.node_rank = rank, world_size, 0, 0
        self.is_global_zero = rank == 0
        self.current_epoch, self.global_step = 0, 0
        self.training, self.sanity_checking, self.fast_dev_run = True, False, False
        self.should_stop = False
        self.recorder = _Recorder()
        self.loggers: list = []  # the recorder, when the run has loggers (``use_loggers``)
        self.logger = None
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.log_every_n_steps = 50
        self.logs_due = False
        self._logger_connector = self.fit_loop = self.epoch_loop = self

    def use_loggers(self, every: int) -> None:
        """The run has loggers: what callbacks log in this worker is recorded for them."""
        self.loggers, self.logger, self.log_every_n_steps = [self.recorder], self.recorder, every

    @property
    def should_update_logs(self) -> bool:
        """Whether the loggers take this batch's values (Trainer's ``_logger_connector``)."""
        return self.logs_due

    @property
    def _batches_that_stepped(self) -> int:  # Trainer's ``fit_loop.epoch_loop``
        return self.global_step

    def adopt(self, optimization: Optimization) -> None:
        """The optimizer and schedulers ``self.optimizers()`` and ``self.lr_schedulers()``
        return (and ``LearningRateMonitor`` reads)."""
        self.optimizers = [optimization.optimizer]
        self.lr_scheduler_configs = optimization.configs
        self.strategy = _Strategy(self.optimizers)

    def at(self, epoch: int, batch_idx: int) -> None:
        """Where training is: before batch ``batch_idx`` of ``epoch``."""
        self.current_epoch = epoch
        window = self.accumulate_grad_batches
        done = (
            -(-batch_idx // window)
            if batch_idx >= self.num_training_batches
            else batch_idx // window
        )
        self.global_step = epoch * self.optimizer_steps_per_epoch + done


class _Recorder:
    """A logger in a worker: keeps the rows callbacks log there (``LearningRateMonitor``'s)
    for the driver, which writes them to the run's loggers."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.rows.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass  # the driver logs the run's hyperparameters

    def save(self) -> None:
        pass

    def take(self) -> list[tuple[int, dict[str, float]]]:
        rows, self.rows = self.rows, []
        return rows


class _Strategy:
    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._lightning_optimizers = optimizers
        self.root_device = torch.device("cpu")

    @staticmethod
    def reduce_boolean_decision(decision: bool, all: bool = True) -> bool:  # noqa: A002
        return decision


def module_checkpoint(module: torch.nn.Module) -> dict[str, Any]:
    """What the module's ``on_save_checkpoint`` adds to a checkpoint, checked to be JSON
    (ringflow never pickles); ``on_load_checkpoint`` gets it back on resume."""
    extra: dict[str, Any] = {}
    call_hook(module, "on_save_checkpoint", extra)
    return to_json(extra, what=f"what {type(module).__name__}.on_save_checkpoint adds")


def attach(module: torch.nn.Module, trainer: TrainerView, log: Any) -> None:
    """Give ``module`` the Trainer view its code reads and the ``self.log`` that records."""
    if "_trainer" in vars(module):  # a LightningModule: ``self.trainer`` and friends
        module._trainer = trainer
    module.log, module.log_dict = log.log, log.log_dict


def clip_gradients(
    optimizer: torch.optim.Optimizer,
    value: float | None,
    algorithm: str,
    *,
    across: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Clip the (already averaged) gradients of ``optimizer``'s parameters as Lightning does;
    by norm, by the norm of the whole model's gradient where ``across`` sums the squared
    norms of the parts other workers hold."""
    if value is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if algorithm != "norm":
        torch.nn.utils.clip_grad_value_(params, value)
    elif across is None:
        torch.nn.utils.clip_grad_norm_(params, value)
    else:
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        total = across(local.float().square()).sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, value, total.to(local.device))


def _agree_on_overflow(
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    across: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Make the scaler skip this step where any part's gradients overflowed: the parts of
    one model step together, and their scalers then keep one scale."""
    # GradScaler keeps what unscale_ found per device; step() and update() read it there.
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    mine = sum(v.float().sum() for v in found.values()) if found else torch.zeros(())
    overflowed = float(across(torch.as_tensor(mine, dtype=torch.float32).reshape(())))
    for v in found.values():
        v.fill_(1.0 if overflowed > 0 else 0.0)


def compile_in_place(module: torch.nn.Module) -> int:
    """Replace every ``torch.compile(submodule)`` wrapper in ``module`` by the submodule
    itself, compiled in place (``nn.Module.compile``) with the wrapper's own compiler
    settings; return how many were replaced.

    A wrapper (``OptimizedModule``) inserts ``_orig_mod.`` into the names of its parameters
    and state, so a checkpoint of a compiled run would not load into the same module
    uncompiled (the driver's, a served model's), nor the other way round. Compiled in place,
    a module keeps its eager names and the same compiled forward and backward, and its
    parameters' gradient hooks still fire after each compiled piece's backward.

    It reads the wrapper's ``_orig_mod`` and ``dynamo_ctx`` and sets what ``nn.Module.compile``
    sets (checked with torch 2.13); a wrapper without ``dynamo_ctx`` is compiled in place
    with ``compile()``'s defaults.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, OptimizedModule):
                inner = child._orig_mod
                compiler = getattr(child, "dynamo_ctx", None)
                if compiler is None:
                    inner.compile()
                else:  # nn.Module.compile, with the wrapper's compiler (backend, mode...)
                    inner._compiled_call_impl = compiler(_traced_call(inner))
                setattr(parent, name, inner)
                replaced += 1
    return replaced + compile_in_place(module) if replaced else 0


@contextlib.contextmanager
def compiled_in_buckets(bucket_bytes: int) -> Iterator[None]:
    """While active, each graph ``torch.compile`` captures is split where a gradient bucket
    of ``bucket_bytes`` would end, as dynamo splits graphs under DDP (its ``DDPOptimizer``).

    A module compiled whole has one backward: every gradient appears when it ends, so no
    bucket's all-reduce could start before and none would overlap backward. Split, each
    piece's backward is an autograd node of its own: the last layers' buckets start while the
    first layers' backward runs. Only graphs compiled while this is active are split (dynamo
    compiles a frame the first time it runs, and again when a guard fails); a module compiled
    block by block gets the same split inside blocks larger than a bucket, as under DDP.

    Dynamo splits while ``DistributedDataParallel._get_active_ddp_module()`` names a module;
    this names a stand-in that carries only the bucket size, as torch's own ``replicate``
    names its DDP. Where torch has no such hook, or ``torch._dynamo.config.optimize_ddp`` is
    off, graphs are compiled whole.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not hasattr(DistributedDataParallel, "_active_ddp_module"):
        yield
        return
    # Dynamo's first piece holds at most DDP's first bucket (1 MiB); no bucket may be smaller.
    first = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)
    before = DistributedDataParallel._active_ddp_module
    DistributedDataParallel._active_ddp_module = _Buckets(max(bucket_bytes, first))
    try:
        yield
    finally:
        DistributedDataParallel._active_ddp_module = before


@dataclass(frozen=True)
class _Buckets:
    """What dynamo reads of the active DDP module to split a graph: its bucket size."""

    bucket_bytes_cap: int


def _traced_call(module: torch.nn.Module) -> Any:
    """What a ``torch.compile`` wrapper hands its compiler, with ``_call_impl`` for
    ``__call__`` (which would come back to the compiled call): dynamo starts tracing at the
    module's own ``forward``, or, where that is torch's (``nn.Sequential``), which dynamo
    would not start at, at a frame that calls ``_call_impl``."""
    try:
        from torch._dynamo import external_utils, trace_rules
    except ImportError:
        return module._call_impl
    if trace_rules.check(module.forward):
        return external_utils.wrap_inline(module._call_impl)
    return module._call_impl
