"""The process-wide generators a module may draw from: torch's, numpy's and Python's
``random``, seeded together as Lightning's ``seed_everything`` seeds them, and their states
saved and restored together (a stream draws from states of its own, ``engine.data``)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["generator_states", "seed_host_generators", "set_generator_states"]


def seed_host_generators(seed: int) -> None:
    """Seed numpy's and Python's global generators (numpy takes 32 bits of ``seed``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)


def generator_states() -> tuple[Any, ...]:
    """The states of torch's CPU generator, numpy's and Python's."""
    return torch.default_generator.get_state(), np.random.get_state(), random.getstate()


def set_generator_states(states: tuple[Any, ...]) -> None:
    """Restore states :func:`generator_states` returned."""
    torch.default_generator.set_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])
