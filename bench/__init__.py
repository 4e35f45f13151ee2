"""Benchmarks. Each prints its table and, as its last line, one JSON object whose first keys
are its headline figures: the names in the module's ``HEADLINE``, each of which has a row in
the summary table of docs/benchmarks.md (tests/test_reference.py checks it)."""

from __future__ import annotations

import json

__all__ = ["headline_json"]


def headline_json(summary: dict, headline: tuple[str, ...]) -> str:
    """``summary`` as one JSON line with the ``headline`` keys first, ``null`` for a headline
    figure this run did not measure (a runner or mode left out)."""
    return json.dumps({**{key: summary.get(key) for key in headline}, **summary})
