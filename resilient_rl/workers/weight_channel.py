"""A process group of its own between actor rank 0 and the rollout ranks (split placement).

In the split placement the rollout runs in processes of its own, outside the actor's process
group. Instead of sending the weights through host memory and Ray's object store, actor rank 0
and every rollout rank join a *weight channel*: a backend process group built directly on a
``TCPStore`` hosted by actor rank 0 (NCCL on GPU, so the bytes stay on the devices; gloo on CPU,
where it is used by the tests and on request). Channel rank 0 is the actor, rollout rank ``r`` is
channel rank ``r + 1``.

A sync (:func:`send` on every actor rank, :func:`receive` on every rollout rank, at the same time)
gathers the actor's shards bucket by bucket (:mod:`resilient_rl.workers.weight_sync`), and actor
rank 0 broadcasts each gathered buffer; each rollout rank unpacks it into its parameters with the
same bucket layout. Every channel belongs to one generation: a recovery builds a new one (the
controller calls :func:`join` again) and a survivor's old channel is aborted first.
"""

from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist
from torch import nn

from resilient_rl.runtime import leave_collective, progress, rendezvous
from resilient_rl.errors import CollectiveError
from resilient_rl.workers import weight_sync
from resilient_rl.workers.fsdp import is_fsdp

logger = logging.getLogger(__name__)

#: The channel's name among this process's collectives (:mod:`resilient_rl.runtime.leave_collective`).
CHANNEL = "weight channel"
_LOCK = threading.Lock()
_STATE: dict[str, object] = {"pg": None, "generation": None, "store": None}


def join(generation: int, addr: str, port: int, rank: int, size: int, backend: str, timeout_s: float) -> int:
    """Join the weight channel of ``generation`` as channel rank ``rank`` of ``size`` (0 hosts the store)."""
    with _LOCK:
        if _STATE["generation"] == generation and _STATE["pg"] is not None:
            return generation
        _close_locked()
        timeout = datetime.timedelta(seconds=timeout_s)
        # Every channel rank is in the store before the group is built: a peer that died on the
        # way gets the rendezvous called off (RayRoles.rendezvous) instead of a wait in torch.
        store = rendezvous.join_store(generation, addr, port, rank, size, timeout_s)
        prefixed = dist.PrefixStore(f"rrl-weights/{generation}", store)
        # The channel is one of this process's collectives: leaving them (told to, or after one
        # failed) ends its waits too, so the other side of a sync does not wait out its timeout.
        with leave_collective.recording(CHANNEL):  # gloo's connections, shut down on leaving
            if backend == "nccl":
                leave_collective.survive_nccl_errors()
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
                leave_collective.abort_on_leave(CHANNEL, pg.abort)
            else:
                pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        _STATE.update(pg=pg, generation=generation, store=store)
        logger.info("joined weight channel generation %d as rank %d of %d (%s)", generation, rank, size, backend)
        return generation


def close() -> None:
    """Leave the channel (abort it: a peer may be dead, and a clean shutdown would wait for it)."""
    with _LOCK:
        _close_locked()


def _close_locked() -> None:
    leave_collective.abort_on_leave(CHANNEL, None)
    leave_collective.forget(CHANNEL)  # a channel left before is gone: the next one is not left
    pg = _STATE["pg"]
    if pg is not None:
        for name in ("abort", "shutdown"):
            fn = getattr(pg, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception as exc:  # a broken channel must not stop a new one
                    logger.debug("weight channel %s raised %s", name, exc)
                break
    _STATE.update(pg=None, generation=None, store=None)


def _broadcast(tensor: torch.Tensor) -> None:
    pg = _STATE["pg"]
    if pg is None:
        raise CollectiveError("weight channel: this process has not joined one", cause="collective")
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        pg.broadcast([tensor], opts).wait()
    except Exception as exc:  # a dead or hung peer: classify at the boundary
        raise CollectiveError(f"weight channel broadcast failed: {exc}", cause="collective") from exc


def send(model: nn.Module, dtype: torch.dtype, is_root: bool,
         bucket_bytes: int = weight_sync.DEFAULT_BUCKET_BYTES) -> int:
    """Every actor rank: gather the weights; actor rank 0 (``is_root``) broadcasts them to the rollout.

    A replicated (not FSDP2) actor needs no other rank's part: rank 0 alone packs and sends."""
    if not is_root and not is_fsdp(model):
        return 0
    return weight_sync.gather_buckets(model, dtype, lambda bucket, recv: _broadcast(recv) if is_root else None,
                                      bucket_bytes)


@torch.no_grad()
def receive(model: nn.Module, actor_world: int, bucket_bytes: int = weight_sync.DEFAULT_BUCKET_BYTES) -> int:
    """Every rollout rank: receive the actor's weights (sharded over ``actor_world`` ranks) into ``model``."""
    dst = {name: p.data for name, p in model.named_parameters()}
    dtype = next(iter(dst.values())).dtype
    device = next(iter(dst.values())).device
    shapes = [(name, tuple(t.shape)) for name, t in dst.items()]
    buckets = weight_sync.plan_buckets(shapes, actor_world, torch.empty((), dtype=dtype).element_size(),
                                       bucket_bytes)
    total = 0
    for bucket in buckets:
        recv = torch.empty(bucket.numel, dtype=dtype, device=device)
        _broadcast(recv)
        bucket.unpack(recv, dst)
        total += sum(int(torch.Size(s).numel()) for s in bucket.shapes) * recv.element_size()
        progress.advance("weight bucket")
    return total
