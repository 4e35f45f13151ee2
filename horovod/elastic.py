"""Elastic Horovod on ringflow: ``hvd.elastic.TorchState``, ``@hvd.elastic.run`` and
``hvd.elastic.ElasticSampler``, as in ``horovod.torch.elastic``.

Started by ``ringflow-run --min-np M --max-np N`` (or ``ringflow.horovod.run(..., min_np=,
max_np=)``), a script's ranks roll back to their last :meth:`State.commit` in memory when a
rank is lost and go on with the ranks left; a worker started in its place joins at the next
commit. Nothing restarts: the survivors keep their process, their data and their device.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ringflow.horovod import basics, lifecycle
from ringflow.horovod.basics import HorovodInternalError
from ringflow.horovod.collectives import broadcast_object, broadcast_parameters

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 (Horovod's name)
    """Raised by :meth:`State.commit` on every rank at once when a worker waits to join:
    ``@hvd.elastic.run`` then forms the ranks again, without rolling back."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("a worker waits to join the ranks")
        self.skip_sync = skip_sync


class State:
    """What the ranks keep in memory and roll back to (Horovod's ``State``)."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset (a worker lost or joined), e.g. to
        scale the learning rate by the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the state as it is now, in this process's memory, as the point the ranks
        roll back to; then :meth:`check_host_updates`."""
        self.save()
        self._check_host_updates(committed=True)

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if a worker waits to join."""
        self._check_host_updates(committed=False)

    def _check_host_updates(self, *, committed: bool) -> None:
        waiting = basics.worker_waiting(committed=committed)  # rank 0 asks; all take its answer
        if basics.size() > 1:
            waiting = bool(broadcast_object(waiting, root_rank=0))
        if waiting:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """After a reset, before the state is synced (nothing by default)."""


class ObjectState(State):
    """Plain Python values, one attribute each, synced from rank 0 (``broadcast_object``)."""

    def __init__(self, **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__()

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = broadcast_object(self._saved_state, root_rank=0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


class TorchState(ObjectState):
    """A PyTorch training's state: ``model`` and ``optimizer``, and any keyword whose value
    has ``state_dict`` and ``load_state_dict`` (modules, optimizers, LR schedulers,
    :class:`ElasticSampler`, a ``GradScaler``), kept by their ``state_dict``: :meth:`restore`
    and :meth:`sync` load into the objects given, so a scheduler still drives the optimizer
    it was made with. Every other keyword is an attribute kept as a value. ``state.epoch =
    3`` sets what the next commit keeps."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handled = {k: v for k, v in kwargs.items() if _keeps_state_dict(v)}
        self._handled = {name: copy.deepcopy(value.state_dict()) for name, value in handled.items()}
        for name, value in handled.items():
            object.__setattr__(self, name, value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in handled})

    def save(self) -> None:
        for name in self._handled:
            self._handled[name] = copy.deepcopy(getattr(self, name).state_dict())
        super().save()

    def restore(self) -> None:
        for name, saved in self._handled.items():
            getattr(self, name).load_state_dict(copy.deepcopy(saved))
        super().restore()

    def sync(self) -> None:
        """Every rank's objects and values become rank 0's: a module's tensors in place, any
        other object's whole ``state_dict`` (an optimizer's learning rates too, where
        ``broadcast_optimizer_state`` leaves a stateless one's as they are)."""
        for name in self._handled:
            value = getattr(self, name)
            if isinstance(value, torch.nn.Module):
                broadcast_parameters(value.state_dict(), root_rank=0)
            else:
                value.load_state_dict(broadcast_object(value.state_dict(), root_rank=0))
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in self.__dict__.get("_handled", {}):
            self._handled[name] = copy.deepcopy(value.state_dict())


def _keeps_state_dict(value: Any) -> bool:
    if isinstance(value, type):  # a class, not one of its objects
        return False
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` on the ranks, through losses and joins (Horovod's
    ``@hvd.elastic.run``): the state is synced from rank 0 first; a lost rank
    (:data:`HorovodInternalError`) rolls every survivor back to its last commit, a worker
    waiting to join (:class:`HostsUpdatedInterrupt`) does not; then the ranks form again,
    the reset callbacks run, and ``func`` is called again from the synced state."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as err:
                lost_at = time.monotonic()
                state.restore()
                skip_sync, why = False, f"rolled back to the last commit ({err})"
            except HostsUpdatedInterrupt as err:
                lost_at, skip_sync, why = time.monotonic(), err.skip_sync, "a worker joins"
            before = basics.size()
            lifecycle.shutdown()
            lifecycle.init()
            print(
                f"ringflow.horovod: {before} -> {basics.size()} ranks, this one rank "
                f"{basics.rank()}, in {time.monotonic() - lost_at:.2f} s: {why}",
                file=sys.stderr,
                flush=True,
            )
            state.on_reset()

    return wrapper


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``ElasticSampler``: this rank's share of ``dataset`` (shuffled by ``seed``
    and the epoch), shared out again over the ranks after a reset, without the samples
    :meth:`record_batch` counted as done this epoch. Keep it in the :class:`TorchState`."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: call it at the end of the previous one (it forgets the samples
        recorded as done)."""
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` on every rank as done."""
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch, self.processed_num = state_dict["epoch"], state_dict["processed_num"]
        self.reset()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def reset(self) -> None:
        """Share the samples not yet done this epoch over the ranks there are now."""
        self.num_replicas, self.rank = basics.size(), basics.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        indices += indices[: self.total_size - len(indices)]  # evenly divisible, as Horovod
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
