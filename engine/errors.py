"""The engine's exceptions. They cross Ray actor boundaries, so they pickle."""

from __future__ import annotations

__all__ = ["EngineError", "WorkerFailedError"]


class EngineError(RuntimeError):
    """Root of every error the engine raises on purpose."""


class WorkerFailedError(EngineError):
    """A worker died or raised; ``rank`` says which."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (_rebuild_worker_failed, (str(self), self.rank))


def _rebuild_worker_failed(message: str, rank: int | None) -> WorkerFailedError:
    return WorkerFailedError(message, rank=rank)
