"""Checkpoint and dataset storage on any fsspec URL. Never imports Prefect."""

from storage.checkpoint import (
    CheckpointError,
    ModelCheckpoint,
    copy_checkpoint,
    load_model,
    read_checkpoint,
    save_model,
)
from storage.fs import join, resolve

__all__ = [
    "CheckpointError",
    "ModelCheckpoint",
    "copy_checkpoint",
    "join",
    "load_model",
    "read_checkpoint",
    "resolve",
    "save_model",
]
