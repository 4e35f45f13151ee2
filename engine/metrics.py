"""``self.log`` as Lightning defines it, for modules trained by ringflow's workers.

A worker's module logs through :class:`MetricLog`; what it records (:class:`Logged`) travels to
the driver, which merges the workers' records and writes the loggers (from one process, as
Lightning's rank 0 does). Values are reduced across the batches of an epoch and across the
workers of a global batch the way one process would reduce them over the whole batch:

* ``mean`` (Lightning's default): weighted by each batch's size (``batch_size``, else the
  number of samples the worker holds), so N workers' parts give the mean 1 worker computes;
* ``sum``, ``max`` and ``min``: over every batch and every worker.

Every value is reduced across the workers, ``sync_dist`` or not: a worker holds only its part
of a global batch, and the figure a user reads is the one of the whole batch. Names follow
Lightning: logged ``on_step`` and ``on_epoch``, ``loss`` is written as ``loss_step`` and
``loss_epoch``. A torchmetrics ``Metric`` logged as an object gives its batch value
(``forward``'s) to the step rows, and its epoch value is ``compute()`` over the states of every
batch of every worker, merged in the driver (``Metric.merge_state``), as one process would
compute it; a worker's metric is reset whenever it hands its state over.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ringflow.engine.errors import ModelError
from ringflow.engine.jsonstate import from_json, to_json

__all__ = ["Logged", "MetricLog", "Value", "logged_number", "logger_rows"]

_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_TORCH_REDUCTIONS = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}

# Hooks in which ``self.log`` defaults to ``on_step=True, on_epoch=False`` (Lightning's
# ``_FxValidator``); everywhere else it defaults to ``on_step=False, on_epoch=True``.
_STEP_HOOKS = {
    "training_step",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
}


_EVALUATION_STEPS = {"validation_step", "test_step"}
"""Hooks where ``self.log`` defaults to ``on_epoch`` but takes ``on_step=True`` too: the
value is then also given to the loggers at the batch's index, as Trainer gives it."""


def _reduction(reduce_fx: Any, name: str) -> str:
    found = (
        _REDUCTIONS.get(reduce_fx.lower())
        if isinstance(reduce_fx, str)
        else _TORCH_REDUCTIONS.get(reduce_fx)
    )
    if found is None:
        raise ModelError(
            f"self.log({name!r}, reduce_fx={reduce_fx!r}): ringflow reduces logged values with "
            "'mean', 'sum', 'max' or 'min' (or torch.mean/sum/max/min)"
        )
    return found


@dataclass
class Value:
    """One logged metric accumulated over batches (and workers)."""

    reduce: str
    total: float
    weight: float = 0.0

    def add(self, value: float, weight: float) -> None:
        if self.reduce == "mean":
            self.total += value * weight
        elif self.reduce == "sum":
            self.total += value
        elif self.reduce == "max":
            self.total = max(self.total, value)
        else:
            self.total = min(self.total, value)
        self.weight += weight

    def merge(self, other: Value) -> Value:
        merged = Value(self.reduce, self.total, self.weight)
        if self.reduce in ("mean", "sum"):
            merged.total += other.total
        elif self.reduce == "max":
            merged.total = max(self.total, other.total)
        else:
            merged.total = min(self.total, other.total)
        merged.weight += other.weight
        return merged

    def fetch(self) -> bool:
        """Start copying a total kept on the GPU to (pinned) host memory, without waiting;
        whether one was. :meth:`settle` may read it once the copy's stream is synchronised."""
        if isinstance(self.total, torch.Tensor) and self.total.is_cuda:
            self.total = self.total.to("cpu", non_blocking=True)
            return True
        return False

    def settle(self) -> None:
        """Bring a total kept on the GPU (see :func:`logged_number`) to the host: one wait, when the
        logged values leave the worker, instead of one every step."""
        if isinstance(self.total, torch.Tensor):
            self.total = float(self.total)

    def result(self) -> float:
        if self.reduce == "mean":
            return self.total / self.weight if self.weight else float("nan")
        return self.total

    @classmethod
    def first(cls, reduce: str, value: float, weight: float) -> Value:
        start = {"max": float("-inf"), "min": float("inf")}.get(reduce, 0.0)
        made = cls(reduce, start)
        made.add(value, weight)
        return made


@dataclass
class Logged:
    """What workers logged over some steps or an evaluation, mergeable across workers and
    chunks: each metric's epoch accumulation, its values at the steps due for the loggers, and
    how it was logged (``on_step``, ``on_epoch``, ``prog_bar``, ``logger``)."""

    epoch: dict[str, Value] = field(default_factory=dict)
    steps: dict[int, dict[str, Value]] = field(default_factory=dict)
    options: dict[str, dict[str, bool]] = field(default_factory=dict)
    samples: int = 0
    rows: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """Rows callbacks in a worker logged (``LearningRateMonitor``), by step, in order."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """torchmetrics ``Metric``s logged on_epoch: a copy holding the state of these steps (or,
    read back from a checkpoint, that state as a dict of tensors)."""

    def merge(self, other: Logged) -> Logged:
        epoch = dict(self.epoch)
        for name, value in other.epoch.items():
            epoch[name] = epoch[name].merge(value) if name in epoch else value
        metrics = dict(self.metrics)
        for name, metric in other.metrics.items():
            metrics[name] = _merged_metric(metrics[name], metric) if name in metrics else metric
        steps = {step: dict(values) for step, values in self.steps.items()}
        for step, values in other.steps.items():
            mine = steps.setdefault(step, {})
            for name, value in values.items():
                mine[name] = mine[name].merge(value) if name in mine else value
        return Logged(
            epoch=epoch,
            steps=steps,
            options={**self.options, **other.options},
            samples=self.samples + other.samples,
            rows=self.rows + other.rows,
            metrics=metrics,
        )

    @classmethod
    def means(cls, sums: dict[str, float], samples: int) -> Logged:
        """Sample-weighted sums (as the pipeline's stages report them), logged per epoch."""
        return cls(
            epoch={name: Value("mean", total, float(samples)) for name, total in sums.items()},
            options={name: {"on_step": False, "on_epoch": True} for name in sums},
            samples=samples,
        )

    def results(self) -> dict[str, float]:
        """Every metric's epoch value under its plain name (ringflow's history and reports)."""
        values = {name: value.result() for name, value in self.epoch.items()}
        values.update(self.computed())
        return dict(sorted(values.items()))

    def computed(self) -> dict[str, float]:
        """The ``Metric`` objects' ``compute()`` over the merged states."""
        return {
            name: float(metric.compute())
            for name, metric in self.metrics.items()
            if not isinstance(metric, dict)
        }

    def to_json(self) -> dict[str, Any]:
        def values(found: dict[str, Value]) -> dict[str, list]:
            return {name: [v.reduce, v.total, v.weight] for name, v in found.items()}

        return {
            "epoch": values(self.epoch),
            "steps": {str(step): values(found) for step, found in self.steps.items()},
            "options": self.options,
            "samples": self.samples,
            "metrics": {
                name: to_json(_state(metric), what=f"metric {name}'s state")
                for name, metric in self.metrics.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Logged:
        def values(found: dict[str, list]) -> dict[str, Value]:
            return {name: Value(*entry) for name, entry in found.items()}

        return cls(
            epoch=values(data.get("epoch", {})),
            steps={int(step): values(found) for step, found in data.get("steps", {}).items()},
            options=data.get("options", {}),
            samples=int(data.get("samples", 0)),
            metrics={name: from_json(state) for name, state in data.get("metrics", {}).items()},
        )


def logger_rows(logged: Logged, *, epoch_end: bool) -> tuple[dict[int, dict], dict[str, float]]:
    """What Lightning would send its loggers: the rows of the steps due (``name`` or
    ``name_step``), and at an epoch's end the epoch row (``name`` or ``name_epoch``) of the
    metrics logged ``on_epoch`` with ``logger=True``."""
    steps: dict[int, dict] = {}
    for step, values in sorted(logged.steps.items()):
        row = {
            _logged_name(name, logged.options[name], "step"): value.result()
            for name, value in values.items()
            if logged.options[name].get("logger", True)
        }
        if row:
            steps[step] = row
    epoch = {}
    if epoch_end:
        values = {name: value.result() for name, value in logged.epoch.items()}
        values.update(logged.computed())
        epoch = {
            _logged_name(name, logged.options[name], "epoch"): value
            for name, value in values.items()
            if logged.options[name].get("on_epoch") and logged.options[name].get("logger", True)
        }
    return steps, epoch


def _is_metric(value: Any) -> bool:
    return callable(getattr(value, "merge_state", None)) and callable(
        getattr(value, "compute", None)
    )


def _merged_metric(mine: Any, other: Any) -> Any:
    """Two states of one ``Metric`` as one (either may be a state read back as a dict)."""
    if isinstance(mine, dict) and isinstance(other, dict):
        raise ValueError("two metric states without a Metric to merge them into")
    base, incoming = (other, mine) if isinstance(mine, dict) else (mine, other)
    merged = copy.deepcopy(base)
    merged.merge_state(incoming)
    return merged


def _state(metric: Any) -> dict[str, Any]:
    """A ``Metric``'s state (or a state read back, as it is)."""
    if isinstance(metric, dict):
        return metric
    return {attr: getattr(metric, attr) for attr in metric._defaults}


def _logged_name(name: str, options: dict[str, bool], when: str) -> str:
    both = options.get("on_step") and options.get("on_epoch")
    return f"{name}_{when}" if both else name


class _Mark(NamedTuple):
    epoch: dict[str, Value]
    steps: set[int]
    options: dict[str, dict[str, bool]]


class MetricLog:
    """Stands in for ``LightningModule.log`` and ``log_dict`` in a worker.

    The worker tells it where the module is (:meth:`enter`: the hook, the batch's size, and
    whether the loggers want this step's values); it records every value as Lightning's
    ``ResultCollection`` would and hands the record over with :meth:`take`.
    """

    def __init__(self) -> None:
        self.logged = Logged()
        self._hook, self._batch_size, self._step = "training_step", 0, None
        self._live: dict[str, Any] = {}  # the module's Metric objects logged on_epoch
        self._options: dict[str, dict[str, bool]] = {}
        self._fetched: tuple[Logged, torch.cuda.Event | None] | None = None

    def enter(self, hook: str, *, batch_size: int = 0, log_step: int | None = None) -> None:
        """Values logged from now on come from ``hook``, on a batch of ``batch_size`` samples;
        ``log_step``: the global step the loggers record this batch's values at, if due."""
        self._hook, self._batch_size, self._step = hook, batch_size, log_step

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        in_step = self._hook in _STEP_HOOKS
        on_step = in_step if on_step is None else on_step
        on_epoch = (not in_step) if on_epoch is None else on_epoch
        if on_step and not in_step and self._hook not in _EVALUATION_STEPS:
            on_step = False  # Lightning logs epoch-end values once an epoch
            on_epoch = True
        reduce = _reduction(reduce_fx, name)
        if _is_metric(value):
            self._log_metric(name, value, on_step=on_step, on_epoch=on_epoch)
            if on_epoch:
                self.logged.options[name] = {
                    "on_step": bool(on_step),
                    "on_epoch": True,
                    "prog_bar": bool(prog_bar),
                    "logger": True if logger is None else bool(logger),
                }
                self._options[name] = self.logged.options[name]
                if not on_step:
                    return
            value = value._forward_cache if value._forward_cache is not None else value.compute()
        number = _number(name, value)
        if reduce in ("max", "min"):
            number = float(number)  # compared with the running value at once
        weight = float(batch_size if batch_size is not None else self._batch_size or 1)
        options = {
            "on_step": bool(on_step),
            "on_epoch": bool(on_epoch),
            "prog_bar": bool(prog_bar),
            "logger": True if logger is None else bool(logger),
        }
        if name in self._live:  # a Metric: its epoch value is compute()d from its state
            options["on_epoch"] = True
        else:
            epoch = self.logged.epoch
            if name in epoch and epoch[name].reduce == reduce:
                epoch[name].add(number, weight)
            else:
                epoch[name] = Value.first(reduce, number, weight)
        self.logged.options[name] = options
        if on_step and self._step is not None:
            self.logged.steps.setdefault(self._step, {})[name] = Value.first(reduce, number, weight)

    def _log_metric(self, name: str, metric: Any, *, on_step: bool, on_epoch: bool) -> None:
        if metric.full_state_update is not False or metric.dist_sync_on_step:
            raise ModelError(
                f"self.log({name!r}, {type(metric).__name__}): ringflow merges a Metric's "
                "state across workers with Metric.merge_state, which this metric does not "
                "support (full_state_update or dist_sync_on_step); log its compute() value "
                "instead, or set full_state_update = False if its update allows it"
            )
        if on_epoch:
            self._live[name] = metric

    @property
    def live(self) -> bool:
        """Whether a Metric object is logged on_epoch (its state moves with every update)."""
        return bool(self._live)

    def mark(self) -> _Mark:
        """Where the record stands, for :meth:`undo` (values kept on the host only)."""
        epoch = {name: Value(v.reduce, v.total, v.weight) for name, v in self.logged.epoch.items()}
        return _Mark(epoch, set(self.logged.steps), dict(self.logged.options))

    def undo(self, mark: _Mark) -> None:
        """Forget what was logged since ``mark`` (a step that failed and is not kept)."""
        self.logged.epoch, self.logged.options = mark.epoch, mark.options
        for step in [s for s in self.logged.steps if s not in mark.steps]:
            del self.logged.steps[step]

    def reset(self) -> None:
        """Forget what was logged since the last :meth:`take` (a rollback to a commit)."""
        for metric in self._live.values():
            metric.reset()
        self.logged, self._fetched = Logged(), None

    def log_dict(self, dictionary: Any, *args: Any, **kwargs: Any) -> None:
        items = dictionary.items() if hasattr(dictionary, "items") else dictionary
        for name, value in items:
            self.log(name, value, *args, **kwargs)

    def record(self, name: str, value: float, weight: float) -> None:
        """A value ringflow records for its own reports (the training loss) unless the module
        logs one under the same name; it does not reach the loggers."""
        if name not in self.logged.options:
            self.logged.epoch[name] = Value.first("mean", value, weight)
            self.logged.options[name] = {"on_step": False, "on_epoch": False, "logger": False}
        elif name in self.logged.epoch and self.logged.options[name].get("logger") is False:
            self.logged.epoch[name].add(value, weight)

    def take(self) -> Logged:
        """What was logged since the last call (or :meth:`fetch`); each Metric's state goes
        with it (a copy on the CPU) and the module's metric starts afresh."""
        logged, landed = self._fetched or (self._hand_over(), None)
        self._fetched = None
        if landed is not None:
            landed.synchronize()
        for value in _values(logged):
            value.settle()
        return logged

    def fetch(self) -> None:
        """Start handing over what was logged, for :meth:`take`: totals kept on the GPU are
        queued to the host now, behind the steps that logged them, where the host does not
        wait for them. Copies queued on the GPU later (a commit's 1.5 GB) cannot delay them."""
        logged = self._hand_over()
        fetched = [value.fetch() for value in _values(logged)]
        landed = None
        if any(fetched):
            landed = torch.cuda.Event()
            landed.record()
        self._fetched = (logged, landed)

    def _hand_over(self) -> Logged:
        logged, self.logged = self.logged, Logged()
        for name, metric in self._live.items():
            if metric._update_count:
                logged.metrics[name] = _detached_copy(metric)
                logged.options[name] = self._options[name]
            metric.reset()
        return logged


def _detached_copy(metric: Any) -> Any:
    """A copy of ``metric`` on the CPU whose tensors hold no autograd graph.

    A metric called in ``training_step`` (``self.train_loss(loss)``) keeps states computed
    from the loss, which are not graph leaves, and ``copy.deepcopy`` refuses those; the copy
    takes detached clones of them instead (``deepcopy``'s memo), the module's metric keeps
    its own."""
    memo: dict[int, Any] = {}
    for part in metric.modules():
        for value in vars(part).values():
            for item in value if isinstance(value, list) else (value,):
                if isinstance(item, torch.Tensor) and item.grad_fn is not None:
                    memo[id(item)] = item.detach().clone()
    return copy.deepcopy(metric, memo).cpu()


def _values(logged: Logged) -> Iterator[Value]:
    yield from logged.epoch.values()
    for values in logged.steps.values():
        yield from values.values()


def logged_number(value: torch.Tensor) -> float | torch.Tensor:
    """A one-element tensor as a number: a float on the CPU; on a GPU a float64 tensor that
    stays there until the values are taken (``Value.settle``), so that logging a loss every
    step does not make the host wait for the GPU every step (the next steps' kernels could
    not be queued meanwhile)."""
    value = value.detach()
    if value.is_cuda:
        return value.reshape(()).double()
    return float(value.float())


def _number(name: str, value: Any) -> float:
    compute = getattr(value, "compute", None)
    if callable(compute) and hasattr(value, "update"):  # a torchmetrics Metric
        value = compute()
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ModelError(
                f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; "
                "log one number (a tensor with a single element)"
            )
        return logged_number(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelError(
            f"self.log({name!r}, ...) got {type(value).__name__}; log a number, a one-element "
            "tensor or a torchmetrics Metric"
        ) from None
