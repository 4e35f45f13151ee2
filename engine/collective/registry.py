"""The names collectives are chosen by (``TrainConfig.collective``): ``ring`` and ``native``
register themselves as they are imported, a user's with :func:`register_collective`; and the
names of communication hooks (``TrainConfig.compression`` beyond the built-in wire formats),
registered with :func:`register_comm_hook`.

It imports nothing of the engine, so the configuration checks a name without a circle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "available_collectives",
    "available_comm_hooks",
    "comm_hook",
    "create_collective",
    "register_collective",
    "register_comm_hook",
    "registrations",
    "restore_registrations",
]

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


_HOOKS: dict[str, tuple[Callable[..., Any], Callable[[int, int], Any] | None]] = {}


def register_comm_hook(
    name: str, *, state: Callable[[int, int], Any] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that makes a communication hook (``hook(state, bucket)``, see
    ``engine.collective.hooks``) selectable as ``TrainConfig.compression=name``; ``state``
    builds its state once per worker from ``(rank, world_size)``."""
    if name in ("none", "bf16", "fp16", "powersgd"):
        raise ValueError(f"{name!r} is a built-in compression; register the hook by another name")

    def decorate(hook: Callable[..., Any]) -> Callable[..., Any]:
        if name in _HOOKS and _HOOKS[name][0] is not hook:
            raise ValueError(f"communication hook {name!r} is already registered")
        _HOOKS[name] = (hook, state)
        return hook

    return decorate


def available_comm_hooks() -> list[str]:
    return sorted(_HOOKS)


def comm_hook(name: str) -> tuple[Callable[..., Any], Callable[[int, int], Any] | None]:
    """The hook registered as ``name`` and its state's factory.

    Raises:
        ValueError: no hook has that name; the message lists those that exist.
    """
    try:
        return _HOOKS[name]
    except KeyError:
        raise ValueError(
            f"unknown compression {name!r}: 'none', 'bf16', 'fp16', 'powersgd' or a registered "
            f"communication hook ({available_comm_hooks() or 'none registered'})"
        ) from None


def registrations() -> tuple[dict[str, Any], dict[str, Any]]:
    """What is registered now, collectives and communication hooks: a worker process that
    outlives runs (``engine.pool``) restores it after each, so a run's registrations (its
    module's, made as it is imported) are not there for the next."""
    return dict(_REGISTRY), dict(_HOOKS)


def restore_registrations(saved: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """Back to :func:`registrations`' ``saved``."""
    for registry, kept in zip((_REGISTRY, _HOOKS), saved, strict=True):
        registry.clear()
        registry.update(kept)
