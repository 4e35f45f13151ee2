"""Collectives the engine averages gradients with, chosen by name.

``native`` wraps ``torch.distributed``; our own ring registers itself here as ``ring``.
"""

from engine.collective.base import (
    Collective,
    available_collectives,
    create_collective,
    register_collective,
)
from engine.collective.native import NativeCollective

__all__ = [
    "Collective",
    "NativeCollective",
    "available_collectives",
    "create_collective",
    "register_collective",
]
