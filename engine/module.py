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

Under manual optimisation (``automatic_optimization = False``) the module steps its own
optimizers, one or several, as under Trainer: ``self.optimizers()`` are Lightning's
``LightningOptimizer`` wrappers, whose ``step()`` comes here (:meth:`Optimization.manual_step`:
the gradient scaler, ``on_before_optimizer_step``), ``self.manual_backward(loss)`` runs the
layout's backward (a data-parallel worker's gradients are reduced over the ring before it
returns), and ``self.lr_schedulers()`` are stepped by the module.

What ringflow does not honour is refused by name when the module is built: several
optimizers without manual optimisation (as Lightning 2 refuses them), and a
``ReduceLROnPlateau`` stepped every batch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ringflow.engine.config import PRECISIONS
from ringflow.engine.errors import ModelError, NotOfferedError
from ringflow.engine.hooks import overrides
from ringflow.engine.jsonstate import from_json, to_json

__all__ = [
    "CLIP_ALGORITHMS",
    "PRECISIONS",
    "LrScale",
    "Optimization",
    "Optimizers",
    "Precision",
    "check_manual_optimisation",
    "clip_gradients",
    "compile_in_place",
    "compiled_in_buckets",
    "lightning_checkpoint",
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

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward(*args, **kwargs)


@dataclass(kw_only=True)
class _Schedule:
    scheduler: Any
    interval: str
    frequency: int
    monitor: str | None
    strict: bool
    plateau: bool


def optimises_manually(module: torch.nn.Module) -> bool:
    """Whether ``module`` steps its optimizers itself (``automatic_optimization = False``)."""
    return getattr(module, "automatic_optimization", True) is False


def check_manual_optimisation(module: torch.nn.Module, config: Any, *, pipeline: bool) -> None:
    """Refuse what manual optimisation cannot be combined with: checked by the driver on the
    module it builds before any worker starts.

    Raises:
        ModelError: the module optimises manually in a pipeline, or with
            ``accumulate_grad_batches`` or ``gradient_clip_val``, which Lightning refuses
            under manual optimisation too.
    """
    if not optimises_manually(module):
        return
    name = type(module).__name__
    if pipeline:
        raise ModelError(
            f"{name} sets automatic_optimization = False: manual optimisation trains "
            "data-parallel only (a pipeline stage holds part of the module and cannot run its "
            "training_step); train it without pipeline stages"
        )
    if config.accumulate_grad_batches != 1:
        raise ModelError(
            f"{name} optimises manually, so accumulate_grad_batches="
            f"{config.accumulate_grad_batches} is refused, as Lightning refuses it: step its "
            "optimizers every few batches in training_step, or set accumulate_grad_batches=1"
        )
    if config.gradient_clip_val is not None:
        raise ModelError(
            f"{name} optimises manually, so gradient_clip_val is refused, as Lightning refuses "
            "it: call self.clip_gradients(optimizer, gradient_clip_val=..., "
            "gradient_clip_algorithm=...) in training_step instead"
        )


def step_arguments(step: Callable[..., Any], batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """What a ``training_step`` (or a validation or test step) takes, as Trainer passes it:
    the batch, and its index where the signature asks for one (``training_step(self, batch)``
    is fine)."""
    if _takes_batch_idx(getattr(step, "__func__", step)):
        return batch, batch_idx
    return (batch,)


@functools.cache
def _takes_batch_idx(function: Callable[..., Any]) -> bool:
    """Read from the signature once per function, not at every batch."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    return is_param_in_hook_signature(function, "batch_idx", min_args=2)


def _ran() -> None:
    """The closure Trainer hands ``optimizer_step``: here training_step and backward ran
    before the step, so it does nothing."""


def may_return_none(step: Callable[..., Any]) -> bool:
    """Whether ``step`` (a ``training_step``) can be seen to return ``None``, read from its
    source: a bare ``return``, ``return None``, or a body that can end without returning.
    Where the source cannot be read, it may."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(step)))
    except (OSError, TypeError, SyntaxError):
        return True
    function = tree.body[0] if tree.body else None
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        return True
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and (
            node.value is None
            or (isinstance(node.value, ast.Constant) and node.value.value is None)
        ):
            return True
    return not _always_returns(function.body)


def _always_returns(body: list[Any]) -> bool:
    import ast

    if not body:
        return False
    last = body[-1]
    if isinstance(last, ast.Return | ast.Raise):
        return True
    if isinstance(last, ast.If):
        return _always_returns(last.body) and _always_returns(last.orelse)
    if isinstance(last, ast.With | ast.AsyncWith):
        return _always_returns(last.body)
    if isinstance(last, ast.Try):
        return _always_returns(last.body + last.orelse) and all(
            _always_returns(handler.body) for handler in last.handlers
        )
    return False


class Optimizers:
    """Several optimizers seen as one where their state is kept (commits, checkpoints): their
    parameter groups in order, their states, one ``state_dict`` in torch's own layout with
    the parameters numbered across them. A module optimising manually configures several
    (a GAN's generator and discriminator); their parameters must not overlap."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        seen: set[int] = set()
        for optimizer in self.optimizers:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if ids & seen:
                raise ModelError(
                    "configure_optimizers() returned optimizers that share parameters: each "
                    "parameter may belong to one optimizer only"
                )
            seen |= ids

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Every parameter's state, read-only (each optimizer's own is a ``defaultdict``)."""
        return {p: entry for o in self.optimizers for p, entry in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for optimizer in self.optimizers:
            saved = optimizer.state_dict()
            state.update({offset + i: entry for i, entry in saved["state"].items()})
            for group in saved["param_groups"]:
                groups.append({**group, "params": [offset + i for i in group["params"]]})
            offset += sum(len(group["params"]) for group in saved["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = iter(state_dict["param_groups"])
        offset = 0
        for optimizer in self.optimizers:
            mine = [next(groups) for _ in optimizer.param_groups]
            count = sum(len(group["params"]) for group in mine)
            optimizer.load_state_dict(
                {
                    "state": {
                        i - offset: entry
                        for i, entry in state_dict["state"].items()
                        if offset <= i < offset + count
                    },
                    "param_groups": [
                        {**group, "params": [i - offset for i in group["params"]]} for group in mine
                    ],
                }
            )
            offset += count


@dataclass(frozen=True)
class LrScale:
    """``TrainConfig.lr_scaling`` at an optimizer step: ``factor`` once warmed up, ramping
    linearly from 1 at step 0 over ``warmup_steps`` steps (Goyal et al.).

    The optimizers' param groups keep the learning rate the module and its schedulers set;
    from ``on_before_optimizer_step`` to the end of ``optimizer.step()`` each holds it times
    the scale, and afterwards exactly what it held before. So a scheduler, a warm-up written
    in ``optimizer_step`` and a resumed run see their own values, and nothing about the
    scale needs keeping beyond the step count.
    """

    factor: float
    warmup_steps: int = 0

    def at(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.factor
        return 1.0 + (self.factor - 1.0) * step / self.warmup_steps


class Optimization:
    """A module's optimizers and learning-rate schedulers: one optimizer stepped where
    Trainer steps it, or, under manual optimisation, one or several the module steps itself
    (:meth:`manual_step`).

    Raises:
        ModelError: ``configure_optimizers`` returns something ringflow does not honour.
    """

    def __init__(self, module: torch.nn.Module, precision: Precision | None = None) -> None:
        from lightning.pytorch.core.optimizer import (
            _configure_optimizers,
            _configure_schedulers_automatic_opt,
            _configure_schedulers_manual_opt,
        )
        from lightning.pytorch.utilities.exceptions import MisconfigurationException

        name = type(module).__name__
        self.manual = optimises_manually(module)
        try:
            optimizers, schedulers, monitor = _configure_optimizers(module.configure_optimizers())
            configs = (
                _configure_schedulers_manual_opt(schedulers)
                if self.manual
                else _configure_schedulers_automatic_opt(schedulers, monitor)
            )
        except MisconfigurationException as err:
            raise ModelError(f"{name}.configure_optimizers(): {err}") from None
        if not optimizers or (len(optimizers) != 1 and not self.manual):
            kinds = ", ".join(type(o).__name__ for o in optimizers) or "none"
            raise ModelError(
                f"{name}.configure_optimizers() returned {len(optimizers)} optimizers ({kinds}): "
                "automatic optimisation steps one (several param groups are fine); several "
                "need manual optimisation (automatic_optimization = False), as under Lightning"
            )
        self.module, self.optimizers = module, list(optimizers)
        self.optimizer: Any = optimizers[0] if len(optimizers) == 1 else Optimizers(optimizers)
        """The optimizer whose state commits and checkpoints keep (several, as one)."""
        self._clipping: tuple[Any, ...] = (None, "norm", None, None)
        self.optimizer_steps = 0
        """Under manual optimisation, the optimizer steps taken so far (Trainer's
        ``global_step`` then counts them); kept in commits and checkpoints."""
        self.precision = precision or Precision("32-true", torch.device("cpu"))
        self.lr_scale: LrScale | None = None
        """Multiplies every param group's learning rate during each step (``LrScale``)."""
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
            if schedule.plateau and schedule.interval == "step" and not self.manual:
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
        whole_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """The optimizer step of batch ``batch_idx`` on the averaged gradients, as Trainer
        takes it: unscale (``16-mixed``), clip, step (skipped by the scaler on non-finite
        gradients), then the schedulers due.

        ``across`` sums a tensor over the workers that hold the other parts of the model (a
        pipeline's stages, sharded workers): a step is skipped on every part where any
        part's gradients overflowed, and clipping by norm takes the whole model's norm,
        ``whole_norm`` of this part's (by default the root of the squares summed
        ``across``)."""
        if whole_norm is None and across is not None:
            whole_norm = functools.partial(_summed_norm, across)
        self._clipping = (clip_val, clip_algorithm, across, whole_norm)
        if overrides(self.module, "optimizer_step"):  # a warm-up written there, say
            epoch = self.module.trainer.current_epoch
            self.module.optimizer_step(epoch, batch_idx, self.module.optimizers(), _ran)
        else:
            self.automatic_step(_ran)
        self.after_batch(batch_idx, last=last)

    def automatic_step(self, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """What Trainer's precision does with the step :meth:`step` takes (or the module's
        own ``optimizer_step`` asks for): the closure (training_step and backward ran
        already), unscaling, ``on_before_optimizer_step``, clipping, the step."""
        closure()
        clip_val, clip_algorithm, across, whole_norm = self._clipping
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            if across is not None:
                _agree_on_overflow(scaler, self.optimizer, across)
        with self.scaled_lr(self.optimizers):
            call_hook(self.module, "on_before_optimizer_step", self.optimizer)
            clip_gradients(self.optimizer, clip_val, clip_algorithm, whole_norm=whole_norm)
            if scaler is not None:
                out = scaler.step(self.optimizer, **kwargs)
                scaler.update()
                return out
            return self.optimizer.step(**kwargs)

    @contextlib.contextmanager
    def scaled_lr(self, optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
        """Every param group of ``optimizers`` at its learning rate times the scale due at
        this step (:class:`LrScale`) while the block runs; afterwards as it was, exactly."""
        if self.lr_scale is None:
            yield
            return
        scale = self.lr_scale.at(self.module.trainer.global_step)
        groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        kept = [group["lr"] for group in groups]
        for group, lr in zip(groups, kept, strict=True):
            group["lr"] = lr * scale
        try:
            yield
        finally:
            for group, lr in zip(groups, kept, strict=True):
                group["lr"] = lr

    def zero_grad(self, batch_idx: int) -> None:
        """Zero the gradients before a window, as Trainer: ``on_before_zero_grad``, then the
        module's ``optimizer_zero_grad`` where it has one. Else they are zeroed in place: a
        data-parallel worker's gradients are views of its buckets."""
        call_hook(self.module, "on_before_zero_grad", self.optimizer)
        if overrides(self.module, "optimizer_zero_grad"):
            epoch = self.module.trainer.current_epoch
            self.module.optimizer_zero_grad(epoch, batch_idx, self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=False)

    def skip_step(self, batch_idx: int, *, last: bool) -> None:
        """The step of a window whose every batch returned ``None`` from ``training_step``:
        as Trainer, whose optimizer then finds no gradient, ``on_before_optimizer_step`` runs
        and the parameters do not change; the schedulers due step."""
        call_hook(self.module, "on_before_optimizer_step", self.optimizer)
        self.after_batch(batch_idx, last=last)

    def step_in_two(
        self, batch_idx: int, *, last: bool, ready: list[torch.Tensor], wait: Callable[[], None]
    ) -> None:
        """The optimizer step of batch ``batch_idx`` in two parts: the parameters whose
        averaged gradients are ``ready`` first, while the others' still reduce; then
        ``wait()`` for those and step the rest. Only where nothing reads every gradient
        before the step (:meth:`steps_in_two`); the same result, bit for bit, as :meth:`step`:
        torch's optimizers update each parameter from its own gradient and state alone."""
        with self.scaled_lr(self.optimizers):
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
        overridden = [
            name
            for name in ("on_after_backward", "on_before_optimizer_step", "optimizer_step")
            if overrides(self.module, name)
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

    def manual_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """A step the module asked for (``optimizer.step()`` under manual optimisation), as
        Trainer's precision takes it: the closure, then (``16-mixed``) unscaling, the
        ``on_before_optimizer_step`` hook, and the step (skipped by the scaler on non-finite
        gradients). Counted: Trainer's ``global_step`` is the steps taken."""
        out = closure()
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        with self.scaled_lr([optimizer]):
            call_hook(self.module, "on_before_optimizer_step", optimizer)
            if scaler is not None:
                out = scaler.step(optimizer, **kwargs)
                scaler.update()
            else:
                out = optimizer.step(**kwargs)
        self.optimizer_steps += 1
        return out

    def after_batch(self, batch_idx: int, *, last: bool) -> None:
        """Step the schedulers due after the optimizer step of batch ``batch_idx`` of an epoch
        (``last``: the epoch's last batch, where epoch-interval schedulers step); under
        manual optimisation the module steps its own."""
        if self.manual:
            return
        for schedule in self.schedules:
            if schedule.plateau:
                continue
            if schedule.interval == "step" and (batch_idx + 1) % schedule.frequency == 0:
                self._step(schedule, None)
        if last:
            self._epoch_schedules(plateau=False, epoch=None, metrics={})

    def after_validation(self, epoch: int, metrics: dict[str, float]) -> None:
        """Step the ``ReduceLROnPlateau`` schedulers due after epoch ``epoch``'s validation."""
        if not self.manual:
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
            "optimizer_steps": self.optimizer_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("schedulers", [])
        self.optimizer_steps = state.get("optimizer_steps", 0)
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
        "optimizer_step",
        "optimizer_zero_grad",
        "prepare_data",
    }
)
_OTHER_HOOKS = ("configure_gradient_clipping", "optimizer_step", "optimizer_zero_grad", "backward")
"""Hooks of Trainer's loop outside Lightning's hook classes: the step ones are called."""


def uncalled_hooks(module_cls: type, *, called: frozenset[str] = CALLED_HOOKS) -> list[str]:
    """The hooks of Trainer's loop ``module_cls`` overrides that ringflow does not call."""
    from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks

    hooks = {
        name
        for base in (ModelHooks, DataHooks, CheckpointHooks)
        for name, value in vars(base).items()
        if callable(value) and not name.startswith("_")
    }
    hooks.update(_OTHER_HOOKS)
    hooks -= {"configure_sharded_model"}  # deprecated
    return sorted(name for name in hooks - called if overrides(module_cls, name))


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
    """The ``Trainer`` a module's own code reads (``self.trainer``, ``self.current_epoch``,
    ``self.global_step``, ``estimated_stepping_batches``...) in a worker, and the one
    Lightning's callbacks read in the driver (``engine.callbacks``: ``module`` is the
    driver's module, ``steps_per_epoch`` unknown there until training starts).

    ``global_step`` counts optimizer steps, as Trainer's does (under manual optimisation,
    the steps the module took); the driver's step counts batches.
    """

    def __init__(
        self,
        *,
        max_epochs: int,
        world_size: int,
        steps_per_epoch: int = 0,
        accumulate: int = 1,
        rank: int = 0,
        module: torch.nn.Module | None = None,
        datamodule: Any = None,
    ) -> None:
        self.max_epochs, self.lightning_module = max_epochs, module
        self.max_steps, self.min_epochs, self.min_steps = -1, None, None
        self.datamodule = datamodule
        self.accumulate_grad_batches = accumulate
        self.count_batches(steps_per_epoch)
        self.global_rank, self.world_size, self.local_rank, self.node_rank = rank, world_size, 0, 0
        self.is_global_zero = rank == 0
        self.current_epoch, self._batches_stepped, self.is_last_batch = 0, 0, False
        self._optimization: Optimization | None = None
        self.strategy: Any = _OneDecision()  # a worker's: its optimizers' (``adopt``)
        self.gradient_clip_val = self.gradient_clip_algorithm = None  # manual: the module's
        self.training, self.sanity_checking, self.fast_dev_run = True, False, False
        self.val_check_interval, self.check_val_every_n_epoch = 1.0, 1
        self.should_stop = False
        self.recorder = _Recorder()
        self.loggers: list = []  # the recorder, when the run has loggers (``use_loggers``)
        self.logger = None
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.log_every_n_steps = 50
        self.num_nodes, self.num_sanity_val_steps = 1, 0
        self.num_val_batches: list[int] = []  # read as "validation every epoch" by callbacks
        self.val_loop = _ValidationLoop()
        self.ckpt_path = None
        self.default_root_dir = os.getcwd()  # Trainer's default, resolved in the driver
        self.callbacks: list[Any] = []
        self.checkpoint_callback = self.early_stopping_callback = None
        self.progress_bar_callback = None
        self.logs_due = False
        self._logger_connector = self.fit_loop = self.epoch_loop = self

    @property
    def model(self) -> torch.nn.Module | None:
        """The module being trained (Trainer's ``strategy.model``; no DDP wrapper here)."""
        return self.lightning_module

    @property
    def num_devices(self) -> int:
        """Every worker is one device of one node."""
        return self.world_size

    def __getattr__(self, name: str) -> Any:
        """Reached only for what the view does not hold: named, with the hook that read it."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotOfferedError(
            f"self.trainer.{name} (read in {_reading_hook()}) is not offered by ringflow; "
            "docs/own-model.md lists what self.trainer offers"
        )

    def save_checkpoint(
        self, filepath: str, weights_only: bool = False, storage_options: Any = None
    ) -> None:
        """``Trainer.save_checkpoint`` in the driver: rank 0's worker writes the file
        (``engine.callbacks``), with the states of the driver's callbacks."""
        files = getattr(self.strategy, "files", None)
        if files is None or storage_options is not None:
            raise NotOfferedError(
                "self.trainer.save_checkpoint is offered to callbacks in the driver, without "
                "storage_options, and without pipeline stages (each holds part of the model)"
            )
        files.save(filepath, weights_only, {c.state_key: c.state_dict() for c in self.callbacks})

    @contextlib.contextmanager
    def as_rank(self, rank: int, world_size: int) -> Iterator[None]:
        """The module sees ``rank`` of ``world_size`` while the block runs: a worker training
        the part of the batch of a rank that left (``engine.worker.Worker.shares``)."""
        kept = self.global_rank, self.world_size, self.is_global_zero
        self.global_rank, self.world_size, self.is_global_zero = rank, world_size, rank == 0
        try:
            yield
        finally:
            self.global_rank, self.world_size, self.is_global_zero = kept

    def count_batches(self, steps_per_epoch: int) -> None:
        """An epoch has ``steps_per_epoch`` batches: what the step counts derive from."""
        self.num_training_batches = steps_per_epoch
        self.optimizer_steps_per_epoch = -(-steps_per_epoch // self.accumulate_grad_batches)
        self.estimated_stepping_batches = self.max_epochs * self.optimizer_steps_per_epoch
        self._optimizer_start: int | None = None

    def count_epoch(self, steps: int, optimizer_start: int) -> None:
        """The epoch about to run has ``steps`` batches and starts after ``optimizer_start``
        optimizer steps (epochs of different lengths: ``engine.epochs``); what the module
        was told to expect in all (``estimated_stepping_batches``) stays."""
        self.num_training_batches = steps
        self.optimizer_steps_per_epoch = -(-steps // self.accumulate_grad_batches)
        self._optimizer_start = optimizer_start

    @property
    def state(self) -> Any:
        """Trainer's state: fitting, running (callbacks read it)."""
        from lightning.pytorch.trainer.states import TrainerFn, TrainerState, TrainerStatus

        return TrainerState(fn=TrainerFn.FITTING, status=TrainerStatus.RUNNING)

    def use_loggers(self, every: int) -> None:
        """The run has loggers: what callbacks log in this worker is recorded for them."""
        self.loggers, self.logger, self.log_every_n_steps = [self.recorder], self.recorder, every

    @property
    def should_update_logs(self) -> bool:
        """Whether the loggers take this batch's values (Trainer's ``_logger_connector``)."""
        return self.logs_due

    @property
    def global_step(self) -> int:
        manual = self._optimization is not None and self._optimization.manual
        return self._optimization.optimizer_steps if manual else self._batches_stepped

    @global_step.setter
    def global_step(self, value: int) -> None:  # automatic optimisation: after its step
        self._batches_stepped = value

    @property
    def _batches_that_stepped(self) -> int:  # Trainer's ``fit_loop.epoch_loop``
        return self._batches_stepped

    def adopt(self, optimization: Optimization, module: torch.nn.Module) -> None:
        """The optimizers and schedulers ``self.optimizers()`` and ``self.lr_schedulers()``
        return (and ``LearningRateMonitor`` reads)."""
        self._optimization, self.lightning_module = optimization, module
        self.optimizers = list(optimization.optimizers)
        self.lr_scheduler_configs = optimization.configs
        self.strategy = _Strategy(optimization, module)
        self.precision_plugin = self.strategy

    def manual_backward(self, backward: Callable[..., None]) -> None:
        """Where ``self.manual_backward(loss)`` goes: the layout's backward pass."""
        self.strategy.run_backward = backward

    def at(self, epoch: int, batch_idx: int) -> None:
        """Where training is: before batch ``batch_idx`` of ``epoch``."""
        self.current_epoch = epoch
        window = self.accumulate_grad_batches
        done = (
            -(-batch_idx // window)
            if batch_idx >= self.num_training_batches
            else batch_idx // window
        )
        start = self._optimizer_start
        self._batches_stepped = (
            epoch * self.optimizer_steps_per_epoch if start is None else start
        ) + done
        self.is_last_batch = batch_idx == self.num_training_batches - 1


def _reading_hook() -> str:
    """The method of a module or callback that is reading ``self.trainer`` (the innermost
    frame whose ``self`` is one)."""
    from lightning.pytorch import Callback, LightningModule

    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, LightningModule | Callback):
            return f"{type(owner).__name__}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "the module's code"


class _ValidationLoop:
    """What callbacks read of Trainer's validation loop: it ran before they are called."""

    _has_run = True


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
    """What a module's own code reaches of Trainer's strategy and precision plugin: its
    optimizers wrapped as Lightning wraps them (``self.optimizers()``), and under manual
    optimisation the backward pass (``self.manual_backward``), the optimizer step those
    wrappers take and gradient clipping (``self.clip_gradients``)."""

    def __init__(self, optimization: Optimization, module: torch.nn.Module) -> None:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        self._optimization = optimization
        self.lightning_module = module
        self.root_device = torch.device("cpu")
        self.run_backward: Callable[..., None] | None = None
        self.dry = False
        """A dry run of ``training_step`` (``Worker._materialise_lazy``): no backward, no step."""
        # Each wrapper holds this strategy by a weak reference: the Trainer view holds it.
        self._lightning_optimizers = [
            LightningOptimizer._to_lightning_optimizer(o, self) for o in optimization.optimizers
        ]

    def backward(self, loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if self.dry:
            return
        if self.run_backward is None:
            raise ModelError("manual_backward() is for training_step under manual optimisation")
        self.run_backward(loss, *args, **kwargs)

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.dry:
            return closure()
        if self._optimization.manual:
            return self._optimization.manual_step(optimizer, closure, **kwargs)
        return self._optimization.automatic_step(closure, **kwargs)

    def clip_gradients(
        self, optimizer: torch.optim.Optimizer, clip_val: float, gradient_clip_algorithm: Any
    ) -> None:
        """``self.clip_gradients``: Lightning's checks done, a value of 0 clips nothing."""
        algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
        clip_gradients(optimizer, clip_val or None, str(algorithm))

    @staticmethod
    def reduce_boolean_decision(decision: bool, all: bool = True) -> bool:  # noqa: A002
        return decision


class _OneDecision:
    """The strategy of a view with no optimizers (the driver's): one decision for the whole
    run, since what it decides on (the epoch's metrics) is already global; the files of
    ``ModelCheckpoint`` are removed where they were written (``files``, set by the driver)."""

    reduce_boolean_decision = staticmethod(_Strategy.reduce_boolean_decision)

    def __init__(self) -> None:
        self.files: Any = None

    @staticmethod
    def broadcast(obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self, name: str | None = None) -> None:
        pass

    def remove_checkpoint(self, filepath: str) -> None:
        self.files.remove(filepath)


def lightning_checkpoint(
    module: torch.nn.Module,
    optimization: Optimization,
    trainer: TrainerView,
    *,
    weights_only: bool,
    callbacks: dict[str, Any],
    state_dict: dict[str, torch.Tensor] | None = None,
    optimizer_states: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """What ``Trainer.save_checkpoint`` puts in a ``.ckpt`` file (its checkpoint connector's
    ``dump_checkpoint``), so that ``load_from_checkpoint`` reads it: the epoch and step, the
    weights (``state_dict``, where given: the module's gathered), the hyperparameters the
    module saved, what ``on_save_checkpoint`` adds and, unless ``weights_only``, the
    optimizers' (``optimizer_states``, where given: a sharded one's gathered), schedulers',
    scaler's and ``callbacks``' states.
    """
    import lightning

    checkpoint: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": module.state_dict() if state_dict is None else state_dict,
        "loops": {},
    }
    if not weights_only:
        scaler = optimization.precision.scaler
        checkpoint["callbacks"] = callbacks
        checkpoint["optimizer_states"] = optimizer_states or [
            o.state_dict() for o in optimization.optimizers
        ]
        checkpoint["lr_schedulers"] = [c.scheduler.state_dict() for c in optimization.configs]
        if scaler is not None:  # under the name Lightning's MixedPrecision keeps it
            checkpoint["MixedPrecision"] = scaler.state_dict()
    hparams = getattr(module, "hparams", None)
    if hparams:
        if hasattr(module, "_hparams_name"):
            checkpoint[module.CHECKPOINT_HYPER_PARAMS_NAME] = module._hparams_name
        checkpoint[module.CHECKPOINT_HYPER_PARAMS_KEY] = dict(hparams)
    call_hook(module, "on_save_checkpoint", checkpoint)
    return checkpoint


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
    whole_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Clip the (already averaged) gradients of ``optimizer``'s parameters as Lightning does;
    by norm, by the norm of the whole model's gradient where other workers hold parts of it:
    ``whole_norm`` of the norm of this part's."""
    if value is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if algorithm != "norm":
        torch.nn.utils.clip_grad_value_(params, value)
    elif whole_norm is None:
        torch.nn.utils.clip_grad_norm_(params, value)
    else:
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        torch.nn.utils.clip_grads_with_norm_(params, value, whole_norm(local).to(local.device))


def _summed_norm(
    across: Callable[[torch.Tensor], torch.Tensor], local: torch.Tensor
) -> torch.Tensor:
    """The whole model's gradient norm from this part's, ``local``: the root of the parts'
    squares summed ``across`` the workers that hold them."""
    return across(local.float().square()).sqrt()


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
