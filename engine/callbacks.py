"""Lightning ``Callback``s a module configures (``configure_callbacks``), run by the driver.

The driver holds every epoch's metrics averaged over all workers, so callbacks run there,
once, on the metrics Trainer would give them (``callback_metrics``), through the view of
Trainer a module reads in a worker (``engine.module.TrainerView``), in Trainer's order
(``ModelCheckpoint`` last). ``EarlyStopping`` stops the run after the epoch it decides on,
as under Trainer; ``ModelCheckpoint`` decides in the driver which files to keep, and rank 0's
worker, which holds the weights and optimizer, writes and removes them (Lightning's ``.ckpt``
files, on any fsspec URL). A callback's ``state_dict`` is kept in every checkpoint and
restored when the run resumes. What a callback raises fails the run as ``ModelError``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ringflow.engine.errors import ModelError
from ringflow.engine.failures import one_line
from ringflow.engine.jsonstate import from_json, to_json
from ringflow.engine.module import TrainerView
from ringflow.engine.worker import Worker

__all__ = ["Callbacks", "in_worker"]

log = logging.getLogger("ringflow.engine")


# The hooks the driver calls (once an epoch, on the global metrics); a callback overriding
# another hook is warned about by name, never dropped in silence.
_DRIVER_HOOKS = {
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "state_dict",
    "load_state_dict",
    "state_key",
}


def _checkpoint_hooks(callback: Any) -> set[str]:
    """``ModelCheckpoint``'s hooks ringflow does not call, which act only with the options it
    refuses: saving every few batches or minutes, or on an exception.

    Raises:
        ModelError: ``callback`` is a ``ModelCheckpoint`` with one of those options.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    if not isinstance(callback, ModelCheckpoint):
        return set()
    refused = {
        "every_n_train_steps": callback._every_n_train_steps or None,
        "train_time_interval": callback._train_time_interval,
        "save_on_exception": callback.save_on_exception or None,
    }
    for option, value in refused.items():
        if value is not None:
            raise ModelError(
                f"ModelCheckpoint({option}={value!r}) is not supported by ringflow: callbacks "
                "run at epoch ends; save every_n_epochs instead"
            )
    return {"on_train_batch_end", "on_exception"}


def in_worker(callback: Any) -> bool:
    """Callbacks that read the optimizer run on rank 0's worker instead of the driver."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    return isinstance(callback, LearningRateMonitor)


class Callbacks:
    """The run's callbacks (``fit(callbacks=...)`` and the module's ``configure_callbacks``),
    called at the points of an epoch where Trainer calls them."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        max_epochs: int,
        world_size: int,
        accumulate: int = 1,
        extra: list[Any] | None = None,
        loggers: list[Any] | None = None,
    ) -> None:
        import lightning as L
        from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector

        configured = getattr(module, "configure_callbacks", None)
        try:
            found = configured() if callable(configured) else []
        except Exception as err:
            raise ModelError(
                f"{type(module).__name__}.configure_callbacks raised {type(err).__name__}: "
                f"{one_line(str(err))}"
            ) from err
        found = list(found) if isinstance(found, list | tuple) else [found]
        every = list(extra or []) + found
        for callback in every:
            if not isinstance(callback, L.Callback):
                raise ValueError(f"callbacks: {callback!r} is not a lightning Callback")
        self.in_workers = [c for c in every if in_worker(c)]
        # as Trainer orders them: checkpoints last, after EarlyStopping has decided
        self.callbacks = _CallbackConnector._reorder_callbacks(
            [c for c in every if not in_worker(c)]
        )
        for callback in self.callbacks:
            ignored = sorted(
                name
                for name, value in vars(type(callback)).items()
                if name.startswith("on_")
                and name not in _DRIVER_HOOKS | _checkpoint_hooks(callback)
                and callable(value)
                and hasattr(L.Callback, name)
            )
            if ignored:
                log.warning(
                    "callback %s overrides %s, which ringflow does not call: callbacks run in "
                    "the driver at epoch boundaries (%s)",
                    type(callback).__name__,
                    ", ".join(ignored),
                    ", ".join(sorted(h for h in _DRIVER_HOOKS if h.startswith("on_"))),
                )
        self.trainer = TrainerView(
            max_epochs=max_epochs, world_size=world_size, accumulate=accumulate, module=module
        )
        self.trainer.callbacks = self.callbacks
        self.trainer.loggers = list(loggers or [])
        self.trainer.logger = self.trainer.loggers[0] if self.trainer.loggers else None
        self.module = module
        if self.callbacks:
            self._call("setup", stage="fit")

    @property
    def should_stop(self) -> bool:
        return self.trainer.should_stop

    def write_files_with(self, group: Any) -> None:
        """Checkpoint files (``ModelCheckpoint``'s) are written by rank 0 of ``group``."""
        self.trainer.strategy.files = _RankZeroFiles(group)

    def _call(self, hook: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(self.trainer, self.module, **kwargs)
            except ModelError:
                raise
            except Exception as err:
                raise ModelError(
                    f"callback {type(callback).__name__}.{hook} raised {type(err).__name__}: "
                    f"{one_line(str(err))}"
                ) from err

    def fit_start(self) -> None:
        self._call("on_fit_start")
        self._call("on_train_start")

    def epoch_start(self, epoch: int) -> None:
        self.trainer.current_epoch = epoch
        self._call("on_train_epoch_start")

    def epoch_end(self, epoch: int, step: int, metrics: dict[str, float]) -> None:
        """After epoch ``epoch``'s validation, with its metrics (``step`` steps done)."""
        self.trainer.current_epoch, self.trainer.global_step = epoch, step
        self.trainer.callback_metrics = {k: torch.tensor(v) for k, v in metrics.items()}
        self.trainer.logged_metrics = dict(self.trainer.callback_metrics)
        self._call("on_validation_epoch_end")
        self._call("on_validation_end")
        self._call("on_train_epoch_end")

    def fit_end(self) -> None:
        self._call("on_train_end")
        self._call("on_fit_end")
        self._call("teardown", stage="fit")

    def state_dict(self) -> dict[str, Any]:
        """Every callback's state by its ``state_key``, and whether one stopped the run."""
        states = {}
        for callback in self.callbacks:
            state = to_json(callback.state_dict(), what=f"callback {callback.state_key}'s state")
            states[callback.state_key] = state
        return {"states": states, "stopped": self.trainer.should_stop}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("states", {})
        for callback in self.callbacks:
            if callback.state_key in states:
                callback.load_state_dict(from_json(states[callback.state_key]))
        self.trainer.should_stop = bool(state.get("stopped", False))


class _RankZeroFiles:
    """Checkpoint files written and removed by rank 0's worker, which holds the weights."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def save(self, filepath: str, weights_only: bool, callbacks: dict[str, Any]) -> None:
        self.group.call_rank0(Worker.save_lightning_checkpoint, filepath, weights_only, callbacks)

    def remove(self, filepath: str) -> None:
        self.group.call_rank0(Worker.remove_lightning_checkpoint, filepath)
