"""A checkpoint root every node can reach, checked before any worker starts.

Every rank writes its own shard of a checkpoint and a restarted rank may come back on another
node, so the checkpoint root must be one place for the whole cluster: object storage (``s3://``,
``gs://``, ...) or a file system mounted on every node (NFS, Lustre, a ReadWriteMany PVC). A plain
path is a different folder on each node: the shards of one checkpoint would be scattered over
the nodes' disks and a rank restarted elsewhere would find nothing. On a cluster of more than one
node such a root is refused unless ``checkpoint.shared_filesystem=true`` says it is mounted on
every node.
"""

from __future__ import annotations

from fsspec.core import split_protocol

from resilient_rl.errors import ConfigError

#: fsspec protocols that name the local file system of whichever node reads them.
LOCAL_PROTOCOLS = (None, "file", "local")


def is_local_root(root: str) -> bool:
    """Whether ``root`` (a path or fsspec URL) is on the local file system of the node using it."""
    protocol, _ = split_protocol(root)
    return protocol in LOCAL_PROTOCOLS


def require_shared_root(checkpoint_cfg, nodes: int) -> None:
    """Refuse a node-local ``checkpoint.root`` on a cluster of ``nodes`` > 1 nodes.

    Raises:
        ConfigError: the root is local, the cluster has several nodes and
            ``checkpoint.shared_filesystem`` is false (the message names both keys).
    """
    if nodes <= 1 or checkpoint_cfg.shared_filesystem or not is_local_root(checkpoint_cfg.root):
        return
    raise ConfigError(
        f"checkpoint.root={checkpoint_cfg.root!r} is a local path, but the Ray cluster has {nodes} nodes: "
        "each node would write its shards to its own disk and a rank restarted on another node would find "
        "none. Use object storage (checkpoint.root=s3://bucket/prefix) or, if the path is a file system "
        "mounted on every node (NFS, Lustre, a ReadWriteMany volume), set checkpoint.shared_filesystem=true")
