"""The names collectives are chosen by (``TrainConfig.collective``): ``ring`` and ``native``
register themselves as they are imported, a user's with :func:`register_collective`.

It imports nothing of the engine, so the configuration checks a name without a circle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["available_collectives", "create_collective", "register_collective"]

_REGISTRY: dict[str, type] = {}


def register_collective(name: str) -> Callable[[type], type]:
    """Class decorator that makes a collective (a ``Collective`` subclass) selectable by
    ``name``."""

    def decorate(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"collective {name!r} is already registered by {_REGISTRY[name]}")
        _REGISTRY[name] = cls
        return cls

    return decorate


def available_collectives() -> list[str]:
    return sorted(_REGISTRY)


def create_collective(name: str, **kwargs: object) -> Any:
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
    return cls(**kwargs)
