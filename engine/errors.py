"""The engine's exceptions. They cross Ray actor boundaries, so they pickle."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "EngineError",
    "MembershipLost",
    "ModelError",
    "NotOfferedError",
    "PeerLostError",
    "Stalled",
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


class MembershipLost(EngineError):
    """Workers were lost during a call; ``workers`` maps each to why."""

    verb = "lost"

    def __init__(self, workers: dict[str, str], *, during: str) -> None:
        self.workers = dict(workers)
        self.during = during
        self.cause = "; ".join(
            f"{w} {self.verb} during {during}: {why}" for w, why in workers.items()
        )
        super().__init__(self.cause)

    def adding(self, earlier: MembershipLost, *, still: Iterable[str]) -> MembershipLost:
        """This loss and the workers of ``earlier`` that are ``still`` in the group (not
        recovered from yet), as one."""
        kept = {w: why for w, why in earlier.workers.items() if w in set(still)}
        if not kept.keys() - self.workers.keys():
            return self
        both = type(self)({**kept, **self.workers}, during=self.during)
        both.cause = f"{earlier.cause}; {self.cause}"
        return both


class Stalled(MembershipLost):
    """Every member answered, each blaming another for a missed deadline: none is lost, all
    roll back (``workers`` are the blamed ones)."""

    verb = "was late"
