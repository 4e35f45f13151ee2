"""What a failure in a worker is, decided once: the user's code, or a lost worker.

A worker reports two kinds of failure, and a retry fixes only one of them:

- **the user's code raised** (the module's constructor, ``configure_optimizers``, a step, a
  hook, a callback, a metric) or ringflow refused what the module asks for
  (:class:`ModelError`): the same code raises again on every attempt, so the run fails at
  once, with no group restart and no flow retry, as a :class:`ModelError` of one line
  naming the hook, the rank and the original exception (:func:`user_error`);
- **a process or a node died, or a peer missed its deadline** (``MembershipLost`` in
  ``engine.group``): elastic recovery, or a new start, within ``max_failures``.

Storage and infrastructure errors are retried by their own policies
(``storage.retry``) before they reach a worker's caller; one that still does is the
run's end, like the user's code.

:func:`decide` is where the driver (``engine.controller``) asks what a failure it met means
for the run: start the workers again, recover, or end the run with one line.
"""

from __future__ import annotations

import enum
import functools
import inspect
import re
import traceback
from dataclasses import dataclass
from types import TracebackType

from ringflow.engine.errors import EngineError, MembershipLost, ModelError

__all__ = [
    "Decided",
    "Decision",
    "decide",
    "one_line",
    "start_failure",
    "user_error",
    "user_error_from_text",
]


class Decision(enum.Enum):
    RESTART = "restart"
    """Start the workers again: a worker was lost before anything was committed."""
    RECOVER = "recover"
    """The membership goes on without the lost worker (``engine.elastic.membership``)."""
    FAIL = "fail"
    """The run ends, with :attr:`Decided.error`."""


@dataclass(frozen=True)
class Decided:
    action: Decision
    error: BaseException
    """What the run fails with, where it fails."""


def decide(err: BaseException, *, while_: str, attempt: int = 0, max_failures: int = 0) -> Decided:
    """What ``err``, met by the driver ``while_`` it was ``starting``, ``running``,
    ``recovering`` or ``finishing``, means for the run.

    A lost worker (``MembershipLost``) starts the workers again while they start (the
    ``attempt``-th start, within ``max_failures``) and is recovered from while they run (the
    membership keeps its own budget); the module's code (``ModelError``) and ringflow's own
    errors end the run as they are; an exception of Ray's that reached the driver ends it
    as one line naming it, never as Ray's own.
    """
    if isinstance(err, MembershipLost) and while_ == "starting":
        if attempt < max_failures:
            return Decided(Decision.RESTART, err)
        return Decided(
            Decision.FAIL,
            EngineError(
                f"the workers did not start: {err} (after {attempt + 1} attempts; "
                f"max_failures={max_failures})"
            ),
        )
    if isinstance(err, MembershipLost) and while_ == "running":
        return Decided(Decision.RECOVER, err)
    if type(err).__module__.startswith("ray."):
        message = one_line(str(err)) or "no reason given"
        return Decided(
            Decision.FAIL,
            EngineError(f"the run failed while {while_}: {type(err).__name__}: {message}"),
        )
    return Decided(Decision.FAIL, err)


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+, in (?P<func>\S+)')
_RAISED = re.compile(r"^(?P<name>[A-Za-z_][\w.]*): ?(?P<message>.*)$")


@functools.cache
def _not_users() -> tuple[str, ...]:
    """Folders whose frames are not the user's: ringflow's packages, the installed
    libraries and Python's own."""
    import os
    import sysconfig

    import ringflow.storage

    engine = os.path.dirname(os.path.abspath(__file__))  # this module's own package
    ours = [engine, os.path.dirname(ringflow.storage.__file__)]
    ours += [sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")]
    return (*dict.fromkeys(os.path.join(p, "") for p in ours), "<frozen ")


def user_error(
    err: BaseException,
    *,
    where: str,
    module_cls: type | None = None,
    traceback_text: str | None = None,
) -> ModelError:
    """``err``, raised in a worker, as the one-line :class:`ModelError` the run fails with.

    Args:
        err: the exception the worker raised.
        where: the worker, as the layout names it (``rank 1``, ``stage 0 of replica 1``).
        module_cls: the trained module's class, whose source file tells its frames apart.
        traceback_text: the worker's traceback as text, when ``err`` crossed a process
            boundary without its own (Ray's ``RayTaskError.traceback_str``).
    """
    if isinstance(err, ModelError):  # ringflow's own refusal, which already says what to do
        return ModelError(f"{one_line(str(err))} ({where})")
    hook = _hook(_frames(err, traceback_text), module_cls)
    name = type(err).__name__
    message = one_line(str(err))
    return ModelError(f"{hook} raised {name}{': ' + message if message else ''} ({where})")


def user_error_from_text(text: str, *, where: str, module_cls: type | None = None) -> ModelError:
    """:func:`user_error` for an exception known only by its traceback's text (a worker that
    raised while it started: Ray keeps the text, not the exception)."""
    raised = next(
        (m for line in reversed(text.strip().splitlines()) if (m := _RAISED.match(line.strip()))),
        None,
    )
    err = _Raised(raised["message"] if raised else one_line(text))
    err.name = raised["name"].rpartition(".")[2] if raised else "an error"
    hook = _hook(_frames(err, text), module_cls)
    return ModelError(f"{hook} raised {err.name}: {one_line(str(err))} ({where})")


def start_failure(text: str, *, where: str, module_cls: type | None = None) -> Exception:
    """What a worker that raised while it started (known by its traceback's text) fails the
    run with: the user's code (a frame of theirs, or ringflow's :class:`ModelError`) as
    :func:`user_error_from_text`; otherwise ringflow refused its settings or its machine (no
    GPU, a dataset it cannot read), as an :class:`EngineError` naming the cause. Neither is
    what a new start fixes."""
    frames = _frames(_Raised(), text)
    if "ModelError:" in text or any(not file.startswith(_not_users()) for file, _ in frames):
        return user_error_from_text(text, where=where, module_cls=module_cls)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return EngineError(f"{where}: it failed to start: {lines[-1] if lines else 'no reason given'}")


class _Raised(Exception):
    name = "Exception"


def _frames(err: BaseException, text: str | None) -> list[tuple[str, str]]:
    """``(file, function)`` of each frame, outermost first."""
    tb: TracebackType | None = err.__traceback__
    if tb is not None:
        return [(f.filename, f.name) for f in traceback.extract_tb(tb)]
    found = []
    for line in (text or "").splitlines():
        match = _FRAME.match(line)
        if match:
            found.append((match["file"], match["func"]))
    return found


def _hook(frames: list[tuple[str, str]], module_cls: type | None) -> str:
    """The user's function that ringflow called: the outermost frame in the module's own
    source (its class, a callback or a metric of the user's project), else the innermost
    frame outside ringflow and its libraries, else the innermost frame."""
    own = _source_file(module_cls)
    cls_name = getattr(module_cls, "__name__", None)
    for file, func in frames:
        if own is not None and file == own:
            return f"{cls_name}.{func}" if cls_name else func
    not_users = _not_users()
    for file, func in reversed(frames):
        if not file.startswith(not_users):
            return func
    return frames[-1][1] if frames else "the module's code"


def _source_file(module_cls: type | None) -> str | None:
    if module_cls is None:
        return None
    try:
        return inspect.getsourcefile(module_cls)
    except (TypeError, OSError):
        return None


def one_line(text: str) -> str:
    """``text``'s first line, with ``...`` where more followed (an error's message)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:1] + (["..."] if len(lines) > 1 else []))
