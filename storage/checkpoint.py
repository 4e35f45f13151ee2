"""Model checkpoints: safetensors for tensors, JSON for everything else, manifest last.

A checkpoint directory holds ``model.safetensors`` and ``manifest.json``. The manifest is
written after the tensors and records their size and SHA-256, so a directory without a
manifest, or whose tensors do not match it, is not a checkpoint. Nothing is unpickled.

The manifest names the module's class, but storage never chooses which code runs: whoever
loads a model says which classes it trusts (its own configuration: the flow's ``model``, a
serving deployment's allow-list), and :func:`load_model` refuses any other class named by
a manifest before importing anything.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ringflow.storage.commit import commit_record
from ringflow.storage.fs import atomic_write, join, read_bytes, resolve, sha256

__all__ = [
    "Allowed",
    "CheckpointError",
    "ModelCheckpoint",
    "ModelClassRefused",
    "class_path",
    "copy_checkpoint",
    "load_model",
    "read_checkpoint",
    "save_model",
]

_TENSORS = "model.safetensors"
_MANIFEST = "manifest.json"
_FORMAT = "ringflow.model/1"

Allowed = str | type | Collection[str | type]
"""Model classes a loader trusts: classes or their import paths."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match its manifest."""


class ModelClassRefused(CheckpointError):
    """A checkpoint names a model class that the loading process does not allow."""


@dataclass(frozen=True, kw_only=True)
class ModelCheckpoint:
    """A committed model checkpoint as read back from storage."""

    uri: str
    """URL of the checkpoint directory."""
    module: str
    """Import path of the module class, ``package.module:Class``."""
    hparams: dict[str, Any]
    """Keyword arguments that rebuild the module."""
    state_dict: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON metadata: step, epoch, data fingerprint, training config."""


def save_model(
    uri: str,
    module: torch.nn.Module,
    *,
    hparams: dict[str, Any],
    metrics: dict[str, float] | None = None,
    meta: dict[str, Any] | None = None,
) -> str:
    """Write ``module``'s weights and a manifest under ``uri``; the manifest goes last.

    Returns:
        ``uri``, which :func:`load_model` accepts.
    """
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    blob = save_safetensors(state)
    atomic_write(join(uri, _TENSORS), blob)
    manifest = {
        "format": _FORMAT,
        "module": class_path(type(module)),
        "hparams": hparams,
        "metrics": metrics or {},
        "meta": meta or {},
        "files": {_TENSORS: {"size": len(blob), "sha256": sha256(blob)}},
    }
    commit_record(join(uri, _MANIFEST), manifest, sort_keys=True)
    return uri


def read_checkpoint(uri: str) -> ModelCheckpoint:
    """Read and verify the checkpoint at ``uri``.

    Raises:
        CheckpointError: no manifest, a missing tensor file, or a size or checksum mismatch.
    """
    fs, path = resolve(uri)
    if not fs.exists(join(path, _MANIFEST)):
        raise CheckpointError(f"{uri} is not a committed checkpoint: {_MANIFEST} is missing")
    try:
        manifest = json.loads(read_bytes(join(uri, _MANIFEST)))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{join(uri, _MANIFEST)} is not valid JSON: {err}") from err
    if manifest.get("format") != _FORMAT:
        raise CheckpointError(f"{uri}: unknown checkpoint format {manifest.get('format')!r}")
    expected = manifest["files"][_TENSORS]
    try:
        blob = read_bytes(join(uri, _TENSORS))
    except FileNotFoundError as err:
        raise CheckpointError(f"{join(uri, _TENSORS)} is missing") from err
    if len(blob) != expected["size"] or sha256(blob) != expected["sha256"]:
        raise CheckpointError(f"{join(uri, _TENSORS)} does not match its manifest checksum")
    return ModelCheckpoint(
        uri=uri,
        module=manifest["module"],
        hparams=manifest["hparams"],
        state_dict=load_safetensors(blob),
        metrics=manifest["metrics"],
        meta=manifest["meta"],
    )


def load_model(uri: str, *, allowed: Allowed) -> tuple[torch.nn.Module, ModelCheckpoint]:
    """Rebuild the module recorded in the checkpoint at ``uri`` and load its weights.

    Args:
        uri: a checkpoint written by :func:`save_model`.
        allowed: the model classes this process trusts, from its own configuration and
            never from storage: classes, or import paths ``package.module:Class`` (a class
            re-exported elsewhere may be named by either path).

    Raises:
        ModelClassRefused: the manifest names a class not in ``allowed``; nothing it names
            was imported.
        CheckpointError: the checkpoint is missing, incomplete or corrupt, or an allowed
            class is not a ``torch.nn.Module``.
    """
    ckpt = read_checkpoint(uri)
    trusted = _trusted_classes(allowed)
    cls = trusted.get(ckpt.module)
    if cls is None:
        named = ", ".join(sorted({class_path(c) for c in trusted.values()}))
        raise ModelClassRefused(
            f"{uri} names the model class {ckpt.module!r}; this process allows only "
            f"{named}: refused without importing it"
        )
    model = cls(**ckpt.hparams)
    model.load_state_dict(ckpt.state_dict)
    model.eval()
    return model, ckpt


def class_path(cls: type) -> str:
    """``package.module:Class`` of ``cls``, as a manifest records it."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _trusted_classes(allowed: Allowed) -> dict[str, type]:
    """Each allowed class under the path it was given and under its defining module's path
    (what :func:`save_model` records), imported from the caller's own configuration."""
    entries = [allowed] if isinstance(allowed, str | type) else list(allowed)
    if not entries:
        raise CheckpointError("load_model needs at least one allowed model class")
    trusted: dict[str, type] = {}
    for entry in entries:
        cls = entry if isinstance(entry, type) else _import_class(entry)
        if not issubclass(cls, torch.nn.Module):
            raise CheckpointError(f"allowed model class {entry!r} is not a torch.nn.Module")
        trusted[class_path(cls)] = cls
        if isinstance(entry, str):
            trusted[entry] = cls
    return trusted


def _import_class(path: str) -> type:
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise CheckpointError(f"allowed model class {path!r} is not 'package.module:Class'")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise CheckpointError(f"allowed model class {path!r} is not a class")
    return obj


def copy_checkpoint(src: str, dst: str) -> str:
    """Verify the checkpoint at ``src`` and commit a copy at ``dst`` (manifest last)."""
    read_checkpoint(src)
    for name in (_TENSORS, _MANIFEST):
        atomic_write(join(dst, name), read_bytes(join(src, name)))
    return dst
