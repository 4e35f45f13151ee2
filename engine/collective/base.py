"""The interface every collective implements, and the registry that names them."""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch

__all__ = ["Collective", "available_collectives", "create_collective", "register_collective"]

_REGISTRY: dict[str, type[Collective]] = {}


class Collective(abc.ABC):
    """Collective operations over a fixed group of ``world_size`` ranks.

    Implementations are created on every rank with the same arguments and must be called in
    the same order on every rank.
    """

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @abc.abstractmethod
    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` on every rank by the sum over all ranks; return it."""

    @abc.abstractmethod
    def broadcast_(self, tensor: torch.Tensor, *, src: int = 0) -> torch.Tensor:
        """Replace ``tensor`` on every rank by rank ``src``'s; return it."""

    def close(self) -> None:
        """Release the group's resources. Safe to call twice."""
        return None


def register_collective(name: str) -> Callable[[type[Collective]], type[Collective]]:
    """Class decorator that makes a collective selectable by ``name``."""

    def decorate(cls: type[Collective]) -> type[Collective]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"collective {name!r} is already registered by {_REGISTRY[name]}")
        _REGISTRY[name] = cls
        return cls

    return decorate


def available_collectives() -> list[str]:
    return sorted(_REGISTRY)


def create_collective(name: str, **kwargs: object) -> Collective:
    """Instantiate the collective registered as ``name``.

    Raises:
        ValueError: no collective has that name; the message lists those that exist.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown collective {name!r}; choose one of {available_collectives()}"
        ) from None
    return cls(**kwargs)  # type: ignore[arg-type]
