"""Horovod's ``horovod.ray.ray_logger``: values a rank logs reach the executor's callbacks.

Inside a function an :class:`~ringflow.horovod.ray.ElasticRayExecutor` runs,
``ray_logger.log(info)`` sends ``info`` to the caller, where ``run(fn, callbacks=[...])``
calls every callback with it, in the order the values came (as Horovod's, usually from rank
0 only: ``if hvd.rank() == 0: ray_logger.log({...})``).
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["log"]

_mailbox: Any = None
_warned = False


def _configure(mailbox: Any) -> None:
    """Send what :func:`log` gets to ``mailbox`` (the executor's, set up in each rank)."""
    global _mailbox
    _mailbox = mailbox


def log(info_dict: Any) -> None:
    """Send ``info_dict`` (anything Ray can pickle) to the executor's callbacks.

    Outside an executor's rank it warns once and sends nothing, as Horovod's.
    """
    global _warned
    if _mailbox is not None:
        import ray

        ray.get(_mailbox.put.remote([("log", info_dict)]))
    elif not _warned:
        warnings.warn("`ray_logger.log` called but logging is not configured.", stacklevel=2)
        _warned = True
