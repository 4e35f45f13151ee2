"""The engine's exceptions. They cross Ray actor boundaries, so they pickle."""

from __future__ import annotations

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "EngineError",
    "ModelError",
    "NotOfferedError",
    "PeerLostError",
    "WorkerFailedError",
]


class EngineError(RuntimeError):
    """Root of every error the engine raises on purpose."""


class ModelError(EngineError, ValueError):
    """The model cannot be trained as asked: its import path, its hyperparameters, or their
    fit with the data. A retry cannot fix it; the message says what to change."""


class NotOfferedError(ModelError, AttributeError):
    """The module or a callback read an attribute of ``self.trainer`` that ringflow does not
    offer. An ``AttributeError`` too, so ``getattr(trainer, name, default)`` still works."""


class WorkerFailedError(EngineError):
    """A worker died or raised; ``rank`` says which."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (_rebuild_worker_failed, (str(self), self.rank))


class CollectiveError(EngineError):
    """A collective could not complete. The group is unusable afterwards: build a new one."""


class PeerLostError(CollectiveError):
    """A peer died (or stopped answering) during a collective.

    Every surviving rank raises it, naming the same lost peer where the ranks could agree.

    Attributes:
        peer: rank of the peer judged lost, or ``None`` when no rank could be blamed.
        op: the collective that failed: ``allreduce``, ``broadcast`` or ``all_gather``.
        rank: the rank that raised.
    """

    def __init__(self, message: str, *, peer: int | None, op: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.peer, self.op, self.rank = peer, op, rank

    def __reduce__(self):
        return (_rebuild_peer_lost, (type(self), str(self), self.peer, self.op, self.rank))


class CollectiveTimeoutError(PeerLostError):
    """A collective passed its deadline: ``peer`` stopped answering (stopped, hung or too slow).

    Raise ``collective_timeout_s`` (``TrainConfig``) or ``timeout_s`` (the collective) when
    the peers are merely slow.
    """


def _rebuild_worker_failed(message: str, rank: int | None) -> WorkerFailedError:
    return WorkerFailedError(message, rank=rank)


def _rebuild_peer_lost(
    cls: type[PeerLostError], message: str, peer: int | None, op: str, rank: int | None
) -> PeerLostError:
    return cls(message, peer=peer, op=op, rank=rank)
