"""Sharded checkpoints over fsspec: storage, commit protocol, async save, retention.

The exports load on first use (:mod:`resilient_rl.lazy`): ``checkpoints list`` and ``status``
read manifests through :mod:`~resilient_rl.checkpoint.manager` and must not pay for torch, which
the shard writer and reader import.
"""

from resilient_rl.lazy import lazy_exports

_EXPORTS = {
    "resilient_rl.checkpoint.async_writer": ("AsyncShardWriter",),
    "resilient_rl.checkpoint.manager": ("CheckpointManager",),
    "resilient_rl.checkpoint.manifest": (
        "FORMAT_VERSION", "LATEST_NAME", "MANIFEST_NAME", "TRAINER_STATE_NAME", "FileRecord", "Manifest",
        "parse_step_dirname", "step_dirname"),
    "resilient_rl.checkpoint.sharded": (
        "StagedShard", "StagedTensor", "gather_full_state", "load_shard_into", "stage", "write_shard"),
    "resilient_rl.checkpoint.state_tree": ("flatten_state", "unflatten_state"),
    "resilient_rl.checkpoint.storage": ("RetryPolicy", "Storage", "is_transient"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
