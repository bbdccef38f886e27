"""Weight sync from the actor to the rollout, on the device.

The actor's FSDP2 parameters are ``Shard(0)`` DTensors. A sync gathers them bucket by bucket: each
rank packs its local shards of a bucket's parameters into one flat buffer in the rollout's dtype,
and one ``all_gather_single`` on the actor's process group (NCCL on GPU, gloo on CPU) fills a
rank-major receive buffer that a :class:`Bucket` knows how to unpack into full tensors. Buckets
bound the extra memory to about ``world_size + 1`` bucket sizes.

- Colocated (the rollout lives in the actor's process): the rollout's parameters are the *sink*
  of its process (:class:`Sink`, held by the rollout's weight part) and the actor unpacks straight
  into them (:meth:`Sink.push`). Unsharded
  (one rank), that is one device copy per tensor (``copy_`` also casts fp32 master weights to the
  rollout's bf16 on a GPU).
- Split (:mod:`resilient_rl.workers.weight_channel`): actor rank 0 broadcasts each gathered
  receive buffer to the rollout ranks over a process group of their own, and every rollout rank
  unpacks it with the same :class:`Bucket` layout (computed independently on both sides from the
  parameter names and shapes).

The sink records the version it holds; the rollout accepts exactly the version the controller
names, so a stale or missing sync is an error, never a silent stale generation.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from resilient_rl.errors import WorkerError
from resilient_rl.runtime import progress
from resilient_rl.workers.fsdp import is_fsdp

#: Default bucket size of a sync (bytes in the rollout's dtype).
DEFAULT_BUCKET_BYTES = 256 * 1024**2

def shard_rows(rows: int, world: int) -> list[int]:
    """Rows of each rank under ``Shard(0)`` (``torch.chunk`` semantics; trailing ranks may get none)."""
    chunk = -(-rows // world) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


@dataclass(frozen=True)
class Bucket:
    """Layout of one bucket's rank-major receive buffer: rank r's segment holds, parameter after
    parameter, the rows of each parameter that rank r owns."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    world: int

    def rows(self, i: int) -> list[int]:
        return shard_rows(self.shapes[i][0], self.world) if self.shapes[i] else [1] + [0] * (self.world - 1)

    def row_numel(self, i: int) -> int:
        n = 1
        for d in self.shapes[i][1:]:
            n *= d
        return n

    @property
    def width(self) -> int:
        """Elements of one rank's segment (the largest rank's; the others are padded)."""
        return max(sum(self.rows(i)[r] * self.row_numel(i) for i in range(len(self.names))) for r in range(self.world))

    @property
    def numel(self) -> int:
        return self.world * self.width

    def pack(self, shards: list[torch.Tensor], rank: int, out: torch.Tensor) -> None:
        """Write this rank's local shards (one per parameter, in order) into ``out`` (its segment)."""
        offset = 0
        for i, shard in enumerate(shards):
            n = self.rows(i)[rank] * self.row_numel(i)
            if n:
                out[offset:offset + n].copy_(shard.reshape(-1))
            offset += n

    def unpack(self, recv: torch.Tensor, dst: dict[str, torch.Tensor]) -> None:
        """Copy a filled receive buffer into the full tensors ``dst`` (contiguous, keyed by name)."""
        width = self.width
        for r in range(self.world):
            offset = r * width
            for i, name in enumerate(self.names):
                rows, row_numel = self.rows(i), self.row_numel(i)
                n = rows[r] * row_numel
                if n:
                    start = sum(rows[:r]) * row_numel
                    dst[name].view(-1)[start:start + n].copy_(recv[offset:offset + n])
                offset += n


def plan_buckets(shapes: list[tuple[str, tuple[int, ...]]], world: int, element_size: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Consecutive parameters grouped into buckets of at most ``bucket_bytes`` (one at least)."""
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = element_size
        for d in shape:
            nbytes *= d
        if groups[-1] and size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tuple(shape)))
        size += nbytes
    return [Bucket(tuple(n for n, _ in g), tuple(s for _, s in g), world) for g in groups if g]


def _shard_group(p) -> object:
    # The mesh's last dimension is the one sharded over (HSDP replicates over the first).
    return p.device_mesh.get_group(p.device_mesh.ndim - 1)


def layout_world(model: nn.Module) -> int:
    """The ranks ``model``'s weights are sharded over, as the buckets are laid out for them: the
    shard group's size (with HSDP, the ranks of one node's row of the mesh, not the world), 1
    when unsharded. A receiver must lay out its buckets for the same number."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and _local(p)[1]:
            return dist.get_world_size(_shard_group(p))
    return 1


def _local(p: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(local shard, sharded?) of a parameter; FSDP2's ``Shard(0)`` sharding is supported, and
    HSDP's ``(Replicate(), Shard(0))``, whose shard is gathered within its node's row of the mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return p.detach(), False
    if tuple(p.placements) not in ((Shard(0),), (Replicate(), Shard(0))):
        raise WorkerError(f"weight sync supports FSDP2 Shard(0) parameters (HSDP: Replicate(), Shard(0)), "
                          f"got {p.placements}", role="actor")
    return p.to_local().detach(), True


def model_buckets(model: nn.Module, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES
                  ) -> tuple[list[Bucket], dict[str, torch.Tensor], object]:
    """The buckets of ``model``'s parameters, their local shards, and the process group they are
    sharded over (None when unsharded)."""
    params = list(model.named_parameters())
    locals_, group = {}, None
    for name, p in params:
        locals_[name], sharded = _local(p)
        if sharded and group is None:
            group = _shard_group(p)
    world = dist.get_world_size(group) if group is not None else 1
    element_size = torch.empty((), dtype=dtype).element_size()
    return plan_buckets([(n, tuple(p.shape)) for n, p in params], world, element_size, bucket_bytes), locals_, group


@torch.no_grad()
def gather_buckets(model: nn.Module, dtype: torch.dtype, consume: Callable[[Bucket, torch.Tensor], None],
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Gather ``model``'s weights bucket by bucket and hand each filled receive buffer to ``consume``.

    A collective over the model's process group when the model is sharded: every rank calls it.
    Returns the bytes of full weights gathered.
    """
    buckets, shards, group = model_buckets(model, dtype, bucket_bytes)
    device = next(iter(shards.values())).device
    rank = dist.get_rank(group) if group is not None else 0
    total = 0
    for bucket in buckets:
        recv = torch.empty(bucket.numel, dtype=dtype, device=device)
        width = bucket.width
        if group is None:
            bucket.pack([shards[n] for n in bucket.names], 0, recv)
        else:
            send = torch.empty(width, dtype=dtype, device=device)
            bucket.pack([shards[n] for n in bucket.names], rank, send)
            # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there).
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(recv, send, group=group)
        consume(bucket, recv)
        total += sum(int(torch.Size(s).numel()) for s in bucket.shapes) * recv.element_size()
        progress.advance("weight bucket")  # a long sync over many buckets is not a hang
    return total


def check_same_parameters(model: nn.Module, dst: dict[str, torch.Tensor]) -> None:
    names = {name for name, _ in model.named_parameters()}
    if names != set(dst):
        raise WorkerError(f"weight sync: actor and rollout parameters differ: actor only "
                          f"{sorted(names - set(dst))[:5]}, rollout only {sorted(set(dst) - names)[:5]}",
                          role="rollout")


def write_into(model: nn.Module, dst: dict[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Write ``model``'s (possibly sharded) weights into the full tensors ``dst``; returns bytes written.

    Unsharded, one device copy per tensor; sharded, a collective over the model's process group
    (every rank calls it).
    """
    check_same_parameters(model, dst)
    params = dict(model.named_parameters())
    if not any(_local(p)[1] for p in params.values()):
        with torch.no_grad():
            torch._foreach_copy_([dst[n] for n in params], [p.detach() for p in params.values()])
        return sum(t.numel() * t.element_size() for t in dst.values())
    dtype = next(iter(dst.values())).dtype
    return gather_buckets(model, dtype, lambda bucket, recv: bucket.unpack(recv, dst), bucket_bytes)


# ---------------------------------------------------------------------------------------------
# The sink of a colocated rollout


class Sink:
    """A rollout's parameters as the destination of its process's weight syncs: the colocated
    actor writes into them (:meth:`push`), the rollout checks the version it then serves
    (:meth:`take`). The rollout's weight part owns it
    (:class:`~resilient_rl.workers.weight_parts.WeightReceiver`); the actor finds it there."""

    def __init__(self, model: nn.Module) -> None:
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        self.version: int | None = None
        self._lock = threading.Lock()
        #: The unsharded model last pushed and its parameters paired with the sink's (same
        #: order), so that a later push from it is one ``_foreach_copy_`` with no walk of either module.
        self._source: weakref.ref | None = None
        self._pairs: tuple[list[nn.Parameter], list[nn.Parameter]] | None = None
        self._nbytes = 0

    def _pair(self, model: nn.Module) -> None:
        """Pair ``model``'s parameters with the sink's when ``model`` is not FSDP2 (else clear the pairs).

        The pairs hold the parameter objects, not their data: a restore that copies into them or
        swaps their ``.data`` is seen by the next push. A rebuilt model is a new source. An FSDP2
        model is never paired: it swaps its registered parameters between the sharded and the
        gathered ones (a forward without backward leaves the gathered ones registered).
        """
        check_same_parameters(model, self.params)
        self._source = weakref.ref(model)
        if is_fsdp(model):
            self._pairs = None
            return
        params = dict(model.named_parameters())
        self._pairs = ([self.params[n] for n in params], list(params.values()))
        self._nbytes = sum(t.numel() * t.element_size() for t in self._pairs[0])

    def push(self, model: nn.Module, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Write ``model``'s weights into the sink and mark it ``version``; returns bytes written.

        Unsharded, one ``_foreach_copy_`` into the sink's parameters (a device copy per tensor,
        cast to the rollout's dtype); sharded, the bucketed gather of :func:`write_into`.
        """
        if self._source is None or self._source() is not model:
            self._pair(model)
        if self._pairs is None:
            nbytes = write_into(model, {n: p.data for n, p in self.params.items()}, bucket_bytes)
        else:
            with torch.no_grad():
                torch._foreach_copy_(*self._pairs)
            nbytes = self._nbytes
        with self._lock:
            self.version = int(version)
        return nbytes

    def take(self, version: int) -> None:
        """Check that the sink holds ``version`` (the rollout then serves it)."""
        with self._lock:
            held = self.version
        if held != int(version):
            raise WorkerError(f"weight sync: this process holds version {held}, asked for {version}",
                              role="rollout", cause="stale_weights")


def digest(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """sha256 of a full state dict, name by name, each tensor rounded to ``dtype`` first (equal
    weights, equal digest, on any placement: an fp32 actor's weights cast to the rollout's bf16
    have the digest of the rollout's copy)."""
    h = hashlib.sha256()
    for k, v in sorted(state.items()):
        h.update(k.encode())
        h.update(v.detach().to(dtype or v.dtype).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
