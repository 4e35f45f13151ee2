"""Retry storage calls with exponential backoff until a deadline.

Object stores fail transiently (HTTP 500 and 503, timeouts, dropped connections, credentials
being refreshed); the fsspec client retries a few times itself, and these retries ride out
the longer outages. Answers that retrying cannot change, such as a missing file or a corrupt
checkpoint, are raised at once.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ringflow.storage.checkpoint import CheckpointError

__all__ = ["CheckpointStorageError", "RetryPolicy", "call_with_retries", "is_transient"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Errors that say something about the request or the data, not about the storage's health.
_PERMANENT = (
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    CheckpointError,
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    AssertionError,
    NotImplementedError,
)


class CheckpointStorageError(CheckpointError):
    """Storage kept failing until the retry deadline; nothing was concluded from it."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long and how often to retry a storage call that failed transiently."""

    deadline_s: float = 60.0
    """Give up once this many seconds have passed since the first attempt."""
    initial_backoff_s: float = 0.1
    """Wait before the first retry; each further wait doubles it."""
    max_backoff_s: float = 5.0
    """Longest single wait between two attempts."""

    def __post_init__(self) -> None:
        for name in ("deadline_s", "initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"RetryPolicy.{name} must be a non-negative number, got {value!r}")

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based), with jitter."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * 2**retry)
        # Half fixed, half random: spreads out clients that failed together.
        return ceiling / 2 + random.uniform(0, ceiling / 2)


def is_transient(error: BaseException) -> bool:
    """Whether retrying the call that raised ``error`` may succeed."""
    return isinstance(error, Exception) and not isinstance(error, _PERMANENT)


def call_with_retries(
    policy: RetryPolicy,
    what: str,
    call: Callable[[], _T],
    *,
    transient: Callable[[BaseException], bool] = is_transient,
) -> _T:
    """Return ``call()``, retrying transient errors with backoff until ``policy.deadline_s``.

    Args:
        policy: backoff and deadline.
        what: what ``call`` does, for log lines and the final error.
        call: the storage call.
        transient: which errors to retry; others are raised at once.

    Raises:
        CheckpointStorageError: transient errors went on until the deadline.
        Exception: a permanent error, at once.
    """
    start = time.monotonic()
    for retry in itertools.count():
        try:
            return call()
        except Exception as err:
            if not transient(err):
                raise
            elapsed = time.monotonic() - start
            wait = policy.backoff(retry)
            if elapsed + wait > policy.deadline_s:
                raise CheckpointStorageError(
                    f"{what} kept failing for {elapsed:.1f}s ({retry + 1} attempts; last error: "
                    f"{type(err).__name__}: {err}). Raise RetryPolicy.deadline_s "
                    f"(now {policy.deadline_s}) to wait longer for the storage."
                ) from err
            _log.info("%s failed (%s: %s); retry in %.2fs", what, type(err).__name__, err, wait)
            time.sleep(wait)
    raise AssertionError("itertools.count() never ends")
