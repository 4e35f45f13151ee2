"""State that goes into a checkpoint as JSON (ringflow never pickles): schedulers' and the
gradient scaler's, callbacks', what a module adds in ``on_save_checkpoint``, torchmetrics
states. Tensors travel as ``{"__tensor__": nested list, "dtype": name}`` and come back as
tensors of that dtype, on the CPU."""

from __future__ import annotations

import json
from typing import Any

import torch

from ringflow.engine.errors import ModelError

__all__ = ["from_json", "to_json"]


def to_json(value: Any, *, what: str) -> Any:
    """``value`` with its tensors as tagged lists, checked to survive JSON.

    Raises:
        ModelError: something in it is not JSON; the message names ``what`` it is.
    """
    plain = _plain(value)
    try:
        json.dumps(plain, allow_nan=True)
    except TypeError as err:
        raise ModelError(
            f"{what} is not JSON, so ringflow cannot checkpoint it: {err}; keep numbers, "
            "strings, lists and dicts there (tensors are turned into lists)"
        ) from None
    return plain


def from_json(value: Any) -> Any:
    """What :func:`to_json` made, with its tensors back."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype = value.get("dtype")
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, dtype) if dtype else None)
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        return {"__tensor__": tensor.tolist(), "dtype": str(tensor.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
