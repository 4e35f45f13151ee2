"""Checkpoint and dataset storage on any fsspec URL. Never imports Prefect."""

from ringflow.storage.checkpoint import (
    CheckpointError,
    ModelCheckpoint,
    ModelClassRefused,
    copy_checkpoint,
    load_model,
    read_checkpoint,
    save_model,
)
from ringflow.storage.checkpointer import AsyncCheckpointer, SaveFailure
from ringflow.storage.fs import join, resolve
from ringflow.storage.reshard import (
    REPLICATED,
    RankState,
    data_parallel_shards,
    load_data_parallel,
    load_optimizer_state_by_name,
    load_pipeline_stage,
    load_training_state,
    merge_optimizer_metadata,
    optimizer_state_by_name,
    pipeline_shards,
    rank_shard,
    stage_shard,
    training_state,
)
from ringflow.storage.retry import CheckpointStorageError, RetryPolicy
from ringflow.storage.store import (
    CheckpointCorruptError,
    CheckpointStore,
    CommittedCheckpoint,
    LoadedCheckpoint,
    RetentionPolicy,
    ShardRecord,
)

__all__ = [
    "REPLICATED",
    "AsyncCheckpointer",
    "CheckpointCorruptError",
    "CheckpointError",
    "ModelClassRefused",
    "CheckpointStorageError",
    "CheckpointStore",
    "CommittedCheckpoint",
    "LoadedCheckpoint",
    "ModelCheckpoint",
    "RankState",
    "RetentionPolicy",
    "RetryPolicy",
    "SaveFailure",
    "ShardRecord",
    "copy_checkpoint",
    "data_parallel_shards",
    "join",
    "load_data_parallel",
    "load_model",
    "load_optimizer_state_by_name",
    "load_pipeline_stage",
    "load_training_state",
    "merge_optimizer_metadata",
    "optimizer_state_by_name",
    "pipeline_shards",
    "rank_shard",
    "read_checkpoint",
    "resolve",
    "save_model",
    "stage_shard",
    "training_state",
]
