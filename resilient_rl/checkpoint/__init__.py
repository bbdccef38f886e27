"""Sharded checkpoints over fsspec: storage, commit protocol, async save, retention."""

from resilient_rl.checkpoint.async_writer import AsyncShardWriter
from resilient_rl.checkpoint.manager import CheckpointManager
from resilient_rl.checkpoint.manifest import (
    FORMAT_VERSION, LATEST_NAME, MANIFEST_NAME, TRAINER_STATE_NAME, FileRecord, Manifest,
    parse_step_dirname, step_dirname,
)
from resilient_rl.checkpoint.sharded import (
    StagedShard, StagedTensor, gather_full_state, load_shard_into, stage, write_shard,
)
from resilient_rl.checkpoint.state_tree import flatten_state, unflatten_state
from resilient_rl.checkpoint.storage import RetryPolicy, Storage, is_transient

__all__ = [
    "AsyncShardWriter", "CheckpointManager", "FORMAT_VERSION", "FileRecord",
    "LATEST_NAME", "MANIFEST_NAME", "Manifest", "RetryPolicy", "StagedShard", "StagedTensor",
    "Storage", "TRAINER_STATE_NAME", "flatten_state", "gather_full_state", "is_transient",
    "load_shard_into", "parse_step_dirname", "stage", "step_dirname", "unflatten_state",
    "write_shard",
]
