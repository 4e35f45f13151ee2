"""Which of Lightning's hooks a user's module defines: read by the data (a module's own
loaders) and by the worker and driver (the hooks they call)."""

from __future__ import annotations

from typing import Any

__all__ = ["overrides"]


def overrides(module: Any, hook: str) -> bool:
    """Whether ``module`` (a LightningModule, or its class) has its own ``hook``."""
    from lightning.pytorch import LightningModule

    own = getattr(module if isinstance(module, type) else type(module), hook, None)
    return own is not None and own is not getattr(LightningModule, hook, None)
