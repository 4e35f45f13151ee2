"""Checkpoints of a Horovod script through ringflow's storage, so a retried flow resumes.

Run by the ``horovod-train`` flow, a script finds where its run's checkpoints go in its
environment (``RINGFLOW_HOROVOD_CHECKPOINTS``: a checkpoint store's URL, any fsspec URL;
``RINGFLOW_HOROVOD_RUN_KEY``: the run, the same across the flow run's restarts)::

    import ringflow.horovod as hvd

    resumed = hvd.checkpoint.load(model, optimizer)  # every rank; None on a first start
    start = 0 if resumed is None else resumed["step"]
    for step in range(start, steps):
        ...
        if (step + 1) % 10 == 0:
            hvd.checkpoint.save(step + 1, model, optimizer, epoch=epoch)  # rank 0 writes

Tensors go to safetensors files and everything else to the manifest as JSON; the manifest
is written last, so a save cut short is never read, and nothing read back is unpickled.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ringflow.horovod import basics

__all__ = ["RUN_KEY", "STORE", "load", "save"]

STORE = "RINGFLOW_HOROVOD_CHECKPOINTS"
"""The variable naming the run's checkpoint store (set by the ``horovod-train`` flow)."""
RUN_KEY = "RINGFLOW_HOROVOD_RUN_KEY"
"""The variable naming the run within it."""


def _store() -> tuple[Any, str]:
    from ringflow.storage import CheckpointStore

    url, run_key = os.environ.get(STORE), os.environ.get(RUN_KEY)
    if not url or not run_key:
        raise basics.HorovodError(
            f"hvd.checkpoint needs {STORE} and {RUN_KEY}: run the script through the "
            "horovod-train flow, or set both (a store URL and a run key)"
        )
    return CheckpointStore(url), run_key


def save(
    step: int,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    **values: Any,
) -> None:
    """Commit ``step``: ``model``'s and ``optimizer``'s state and ``values`` (numbers,
    strings, lists and dicts of them). Rank 0 writes; every rank may call it."""
    if basics.is_initialized() and basics.rank() != 0:
        return
    store, run_key = _store()
    shards: dict[str, dict[str, torch.Tensor]] = {"step": {"step": torch.tensor(step)}}
    metadata: dict[str, Any] = {"values": values}
    if model is not None:
        shards["model"] = {k: v.detach() for k, v in model.state_dict().items()}
    if optimizer is not None:
        shards["optimizer"], metadata["optimizer"] = _split(optimizer.state_dict())
    store.save(run_key, step=step, shards=shards, metadata=metadata)


def load(
    model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any] | None:
    """Load the run's newest checkpoint that verifies into ``model`` and ``optimizer``;
    ``{"step": ..., **values}``, or ``None`` when the run has none yet."""
    store, run_key = _store()
    loaded = store.load_latest(run_key)
    if loaded is None:
        return None
    metadata = loaded.checkpoint.metadata
    if model is not None:
        model.load_state_dict(loaded.shards["model"])
    if optimizer is not None:
        optimizer.load_state_dict(_joined(loaded.shards["optimizer"], metadata["optimizer"]))
    return {"step": loaded.checkpoint.step, **metadata["values"]}


def _split(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's ``state_dict`` as its tensors (by ``param.key``) and the rest as JSON."""
    tensors, entries = {}, {}
    for param, values in state["state"].items():
        entries[str(param)] = {}
        for key, value in values.items():
            if torch.is_tensor(value):
                tensors[f"{param}.{key}"] = value.detach()
                value = {"tensor": f"{param}.{key}"}
            entries[str(param)][key] = value
    return tensors, {"state": entries, "param_groups": state["param_groups"]}


def _joined(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    state = {
        int(param): {
            key: tensors[value["tensor"]] if isinstance(value, dict) else value
            for key, value in values.items()
        }
        for param, values in rest["state"].items()
    }
    return {"state": state, "param_groups": rest["param_groups"]}
