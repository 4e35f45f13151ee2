"""Benchmarks. Each prints its table and, as its last line, one JSON object whose first keys
are its headline figures: the names in the module's ``HEADLINE``, each of which has a row in
the summary table of docs/benchmarks.md (tests/test_reference.py checks it)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

__all__ = ["headline_json", "local_ray", "stdlib_windows"]


def headline_json(summary: dict, headline: tuple[str, ...]) -> str:
    """``summary`` as one JSON line with the ``headline`` keys first, ``null`` for a headline
    figure this run did not measure (a runner or mode left out)."""
    return json.dumps({**{key: summary.get(key) for key in headline}, **summary})


@contextlib.contextmanager
def local_ray(num_cpus: int, **init: Any) -> Iterator[bool]:
    """A private local Ray of ``num_cpus`` CPUs (on loopback, quiet) while the block runs, or
    the caller's where one runs already; whether this one started it."""
    from ringflow.engine.cluster import quiet_environment

    quiet_environment()  # before Ray starts: a local Ray stays on loopback, quiet
    import ray

    if ray.is_initialized():
        yield False
        return
    ray.init(
        address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **init
    )
    try:
        yield True
    finally:
        ray.shutdown()


def stdlib_windows(windows: int, seq_len: int, *, extra: int = 1) -> Any:
    """The tokens of ``windows`` windows of ``seq_len`` (and ``extra`` more) from Python's
    standard library, the corpus repeated where it is shorter."""
    from ringflow.models.gpt import stdlib_tokens

    needed = windows * seq_len + extra
    tokens = stdlib_tokens(max_tokens=needed)
    if len(tokens) < needed:
        tokens = tokens.repeat(-(-needed // len(tokens)))[:needed]
    return tokens[:needed]
