"""One error line per failed run: Prefect's own repeats of a failure are quieter.

A run that fails logs why once, at ERROR, in one line (the flow's ``fail_at_once``, or the
final state). Prefect logs the same failure again on its way out: the task's exception with
its traceback, the task's final state, and, in a deployed run, "Engine execution exited with
unexpected exception" with the traceback again. Those go to DEBUG (the tracebacks) or INFO
(the task's final state); ``--debug`` (``RINGFLOW_DEBUG=1``) shows the tracebacks.
"""

from __future__ import annotations

import logging
import os

__all__ = ["one_error_per_failure"]

_TRACEBACKS = (
    "Task run failed with",
    "Engine execution exited with unexpected exception",
    "Encountered exception during execution",
)
"""Prefect's messages that repeat a failure with its traceback."""


class _OneErrorPerFailure(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        message = str(record.msg)
        if message.startswith(_TRACEBACKS):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            debug = os.environ.get("RINGFLOW_DEBUG", "0") not in ("", "0")
            return debug or logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        if record.name == "prefect.task_runs" and message.startswith("Finished in state"):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_FILTER = _OneErrorPerFailure()


def one_error_per_failure() -> None:
    """Install the filter on Prefect's run loggers (once per process)."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
