"""Call a Horovod-style training function on each rank: the ``horovod-train`` flow's
function form, as ``horovod.run(fn)`` calls it.

    ringflow-run -np 2 python -m ringflow.horovod.call package.module:train '{"steps": 4}'

Each rank imports ``package.module`` (installed where the ranks run, as the script of the
file form must be there) and calls ``train(**kwargs)``; the function's own exception ends
the rank with its traceback and status 1, which fails the run.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["resolve"]


def resolve(path: str) -> Callable[..., Any]:
    """The function ``package.module:name`` names.

    Raises:
        ValueError: ``path`` is not of that form, or names nothing callable.
    """
    module_name, _, name = path.partition(":")
    if not module_name or not name or not all(p.isidentifier() for p in name.split(".")):
        raise ValueError(f"function {path!r} must be 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"function {path!r}: cannot import {module_name!r} ({err})") from None
    for part in name.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ValueError(f"function {path!r}: {module_name} has no function {name!r}")
    return target


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(
            "usage: python -m ringflow.horovod.call package.module:function [JSON]", file=sys.stderr
        )
        return 2
    kwargs = json.loads(argv[1]) if len(argv) == 2 else {}
    resolve(argv[0])(**kwargs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
