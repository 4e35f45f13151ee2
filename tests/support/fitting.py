"""What training tests compare: weights, and how far apart two sets of them are."""

from __future__ import annotations


def relative_difference(a: dict, b: dict) -> float:
    """The largest relative difference, by norm, between two state dicts' tensors."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)
