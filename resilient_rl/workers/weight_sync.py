"""Weight sync from the actor to a rollout in the same process, without leaving the device.

Colocated roles share a process (and, on a GPU machine, the device), so the actor's weights need
not travel through host memory or Ray. The rollout registers its own parameter tensors as the
*sink* of this process; after an update the actor writes its weights straight into them:

- unsharded (one rank): one device copy per tensor (``copy_`` also casts fp32 master weights to
  the rollout's bf16 on a GPU);
- FSDP2-sharded: the ``Shard(0)`` local shards are packed, bucket by bucket, into one flat buffer
  in the rollout's dtype; one ``all_gather_into_tensor`` per bucket on the actor's process group
  (NCCL on GPU, gloo on CPU) fills every rank's receive buffer, which is unpacked into the sink.
  Buckets bound the extra memory to about ``world_size + 1`` bucket sizes.

The sink records the version it holds; the rollout accepts exactly the version the controller
names, so a stale or missing sync is an error, never a silent stale generation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from resilient_rl.errors import WorkerError

#: Default bucket size of a sharded sync (bytes in the rollout's dtype).
DEFAULT_BUCKET_BYTES = 256 * 1024**2

_LOCK = threading.Lock()


@dataclass
class _Sink:
    params: dict[str, torch.Tensor]
    version: int | None = None


_STATE: dict[str, _Sink | None] = {"sink": None}


def register_sink(model: nn.Module) -> None:
    """Make ``model``'s parameters the destination of this process's weight syncs (version unset)."""
    with _LOCK:
        _STATE["sink"] = _Sink({name: p.data for name, p in model.named_parameters()})


def clear_sink() -> None:
    with _LOCK:
        _STATE["sink"] = None


def _sink() -> _Sink:
    sink = _STATE["sink"]
    if sink is None:
        raise WorkerError("weight sync: no rollout in this process registered its weights", role="actor",
                          cause="stale_weights")
    return sink


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows of each rank under ``Shard(0)`` (``torch.chunk`` semantics; trailing ranks may get none)."""
    chunk = -(-rows // world) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def _is_sharded(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return False
    if tuple(p.placements) != (Shard(0),):
        raise WorkerError(f"weight sync supports FSDP2 Shard(0) parameters, got {p.placements}", role="actor")
    return True


def _buckets(params: list[tuple[str, torch.Tensor]], sink: dict[str, torch.Tensor],
             bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, p in params:
        nbytes = sink[name].numel() * sink[name].element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += nbytes
    return buckets


@torch.no_grad()
def _gather_bucket(bucket: list[tuple[str, torch.Tensor]], sink: dict[str, torch.Tensor], group) -> None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dst0 = sink[bucket[0][0]]
    # rows[i][r]: rows of parameter i held by rank r; a row is the numel of one dim-0 slice.
    rows = [shard_rows(sink[name].shape[0], world) for name, _ in bucket]
    row_numel = [sink[name][0].numel() if sink[name].dim() else 1 for name, _ in bucket]
    seg = [sum(rows[i][r] * row_numel[i] for i in range(len(bucket))) for r in range(world)]
    width = max(seg)
    recv = torch.empty(world * width, dtype=dst0.dtype, device=dst0.device)
    send = recv[rank * width:(rank + 1) * width]  # packing in place saves one buffer and one copy
    offset = 0
    for i, (_, p) in enumerate(bucket):
        n = rows[i][rank] * row_numel[i]
        if n:
            send[offset:offset + n].copy_(p.to_local().reshape(-1))
        offset += n
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(recv, send.clone() if recv.device.type == "cpu" else send, group=group)
    for r in range(world):
        base, offset = r * width, 0
        for i, (name, _) in enumerate(bucket):
            n = rows[i][r] * row_numel[i]
            if n:
                start = sum(rows[i][:r]) * row_numel[i]
                sink[name].view(-1)[start:start + n].copy_(recv[base + offset:base + offset + n])
            offset += n


@torch.no_grad()
def write_into(model: nn.Module, dst: dict[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Write ``model``'s (possibly sharded) weights into the full tensors ``dst``; returns bytes written.

    A collective over the model's process group when the model is sharded: every rank calls it.
    """
    params = list(model.named_parameters())
    names = {name for name, _ in params}
    if names != set(dst):
        raise WorkerError(f"weight sync: actor and rollout parameters differ: actor only "
                          f"{sorted(names - set(dst))[:5]}, rollout only {sorted(set(dst) - names)[:5]}",
                          role="rollout")
    sharded = [(n, p) for n, p in params if _is_sharded(p)]
    local = [(n, p) for n, p in params if not _is_sharded(p)]
    if local:
        torch._foreach_copy_([dst[n] for n, _ in local], [p.detach() for _, p in local])
    if sharded:
        group = sharded[0][1].device_mesh.get_group()
        for bucket in _buckets(sharded, dst, bucket_bytes):
            _gather_bucket(bucket, dst, group)
    return sum(t.numel() * t.element_size() for t in dst.values())


def push(model: nn.Module, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Write ``model``'s weights into this process's sink and mark it ``version``; returns bytes written."""
    sink = _sink()
    nbytes = write_into(model, sink.params, bucket_bytes)
    with _LOCK:
        sink.version = int(version)
    return nbytes


def take(version: int) -> None:
    """Check that the sink holds ``version`` (the rollout then serves it)."""
    with _LOCK:
        held = _sink().version
    if held != int(version):
        raise WorkerError(f"weight sync: this process holds version {held}, asked for {version}",
                          role="rollout", cause="stale_weights")
