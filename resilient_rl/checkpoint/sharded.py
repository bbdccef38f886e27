"""Worker side of sharded checkpoints: stage, write and (re)load each rank's own shards.

No collectives are needed to save or load, so saving can finish in a background thread while
the process group is busy (or gone). Each rank writes

- ``shard_{rank:05d}.safetensors``: its local chunks (the local tensor of every DTensor; plain
  tensors are replicated, so only rank 0 writes them, unless they lie under a ``rank_local``
  prefix such as per-rank RNG state);
- ``shard_{rank:05d}.json``: the index: per key the global shape, the global offset and shape of
  the chunk, its dtype and kind; plus the non-tensor values and the state's structure.

Loading into any world size (resharding) reads every rank's index, then for each tensor of this
rank's *template* state reads only the saved chunks that overlap the region the rank holds, as
byte ranges of the safetensors files, and copies them into the template's local tensors. Loading
never calls pickle or ``torch.load``. See :mod:`resilient_rl.checkpoint.reader` for the read path.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from resilient_rl.checkpoint.manifest import FORMAT_VERSION, FileRecord, shard_basename
from resilient_rl.checkpoint.reader import CheckpointDir, ReadTarget, read_targets
from resilient_rl.checkpoint.safetensors_io import build_header, dtype_name, iter_file_chunks
from resilient_rl.checkpoint.state_tree import flatten_state, is_under, unflatten_state
from resilient_rl.checkpoint.storage import Storage
from resilient_rl.page_lock import pinned_tensors
from resilient_rl.runtime import progress
from resilient_rl.errors import CheckpointCorruptError, CheckpointError

__all__ = [
    "BufferSpec", "StagedShard", "StagedTensor", "allocate_staging", "flatten_state",
    "gather_full_state", "load_shard_into", "stage", "staging_spec", "unflatten_state",
    "write_shard",
]

KIND_SHARD = "shard"          # a chunk of a DTensor
KIND_REPLICATED = "replicated"  # a plain tensor, identical on every rank: rank 0 writes it
KIND_LOCAL = "local"          # a plain tensor that differs per rank: every rank writes its own


@dataclass
class StagedTensor:
    """A host copy of one local chunk and where it sits in the global tensor. ``pinned``: its
    buffer was allocated to be page-locked (it is, unless CUDA refused: reused all the same)."""

    data: torch.Tensor
    kind: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    pinned: bool = False


@dataclass
class StagedShard:
    """Everything one rank writes, already copied off the live state."""

    rank: int
    world_size: int
    tensors: dict[str, StagedTensor]
    extras: dict[str, Any]
    rank_local: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.data.numel() * t.data.element_size() for t in self.tensors.values())


def default_rank() -> int:
    """This process's rank in the default group, or 0 without one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _default_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _pinned(t: torch.Tensor) -> bool:
    """Whether a host buffer for ``t`` is pinned: only for a CUDA source on a CUDA machine, where
    page-locked memory makes the device-to-host copy asynchronous and fast."""
    return t.device.type == "cuda" and torch.cuda.is_available()


#: (shape, dtype, pinned) of one host buffer to allocate.
_Want = tuple[tuple[int, ...], torch.dtype, bool]


def _fits(old: StagedTensor | None, want: _Want) -> bool:
    """Whether ``old`` (a buffer of an earlier save) can be staged into again: reusing memory
    skips the page faults, and on CUDA the page locking, of fresh memory."""
    return old is not None and tuple(old.data.shape) == want[0] and old.data.dtype == want[1] \
        and old.pinned == want[2]


def _host_buffers(wants: Mapping[str, _Want], touch: bool) -> dict[str, torch.Tensor]:
    """New host buffers for ``wants``. The pinned ones are views into one page-locked buffer of
    their exact packed size (:func:`~resilient_rl.page_lock.pinned_tensors`), not a
    ``pin_memory=True`` tensor each: torch's caching host allocator rounds every one up to a power
    of two (up to 2x the state's size in locked host memory, 25% on average); a view replaced
    later (its tensor changed shape) is freed with the rest of its allocation. The pageable ones
    are plain tensors, written once when ``touch`` so their pages are faulted in now."""
    pinned = [key for key, (_, _, pin) in wants.items() if pin]
    views, _ = pinned_tensors([wants[key][:2] for key in pinned]) if pinned else ([], False)
    out = dict(zip(pinned, views))
    for key, (shape, dtype, pin) in wants.items():
        if not pin:
            out[key] = torch.empty(shape, dtype=dtype)
            if touch:
                out[key].zero_()
    return out


def _dtensor_chunk(key: str, t: DTensor) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """(local tensor, global offset) of this rank's chunk; None when another rank writes it."""
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    for dim, placement in enumerate(t.placements):
        if type(placement) is Replicate:
            if coordinate[dim] != 0:
                return None  # the same chunk is written by the first replica
        elif type(placement) is not Shard:
            raise CheckpointError(
                f"tensor {key!r}: placement {placement} is not supported in checkpoints "
                "(only Shard(d) and Replicate(); reduce Partial tensors before saving)")
    local = t.to_local()
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(local_shape):
        raise CheckpointError(f"tensor {key!r}: local shape {tuple(local.shape)} differs from the "
                              f"expected {tuple(local_shape)} for placements {t.placements}")
    return local, tuple(int(o) for o in offset)


def stage(state: Mapping[str, Any], rank: int | None = None, *, world_size: int | None = None,
          rank_local: tuple[str, ...] = (), reuse: StagedShard | None = None,
          copy: bool = True) -> StagedShard:
    """Copy this rank's part of ``state`` to host memory and record where each chunk belongs.

    The only blocking part of an async save: afterwards the live tensors may change freely.
    ``rank_local`` lists flat key prefixes (``"rng"``, ``"rng/torch"``) whose plain tensors and
    values differ per rank; each rank saves its own and gets it back when loading into the same
    world size. ``reuse``: an earlier staged shard whose buffers are overwritten where shapes
    and dtypes match (its write must have finished; see ``AsyncShardWriter.stage_and_submit``).
    ``copy=False`` is for synchronous saves: contiguous CPU tensors are then written straight
    from the live state, which must not change until :func:`write_shard` returns."""
    rank = default_rank() if rank is None else rank
    world_size = _default_world_size() if world_size is None else world_size
    tensors, extras = flatten_state(state)
    chunks = list(_local_chunks(tensors, rank, rank_local))
    previous = reuse.tensors if reuse is not None else {}
    in_place = {key for key, local, *_ in chunks
                if not copy and local.device.type == "cpu" and local.is_contiguous()}
    wants = {key: (tuple(local.shape), local.dtype, _pinned(local)) for key, local, *_ in chunks if key not in in_place}
    fresh = _host_buffers({key: w for key, w in wants.items() if not _fits(previous.get(key), w)}, touch=False)
    staged: dict[str, StagedTensor] = {}
    any_device = False
    with torch.no_grad():
        for key, local, kind, global_shape, offset in chunks:
            any_device |= local.device.type != "cpu"
            if key in in_place:
                staged[key] = StagedTensor(local.detach(), kind, global_shape, offset)
                continue
            data = fresh[key] if key in fresh else previous[key].data
            data.copy_(local.detach(), non_blocking=local.device.type != "cpu")
            staged[key] = StagedTensor(data, kind, global_shape, offset, wants[key][2])
    if any_device and torch.cuda.is_available():
        torch.cuda.synchronize()
    return StagedShard(rank, world_size, staged, extras, tuple(rank_local))


def _local_chunks(tensors: Mapping[str, torch.Tensor], rank: int, rank_local: tuple[str, ...]):
    """(key, local tensor, kind, global shape, global offset) of every chunk this rank writes."""
    for key, t in tensors.items():
        if isinstance(t, DTensor):
            chunk = _dtensor_chunk(key, t)
            if chunk is None:
                continue
            local, offset = chunk
            kind = KIND_SHARD
        else:
            kind = KIND_LOCAL if is_under(key, rank_local) else KIND_REPLICATED
            if kind == KIND_REPLICATED and rank != 0:
                continue
            local, offset = t, (0,) * t.ndim
        dtype_name(t.dtype, key)  # refuse unstorable dtypes before anything is written
        yield key, local, kind, tuple(t.shape), offset


@dataclass(frozen=True)
class BufferSpec:
    """Shape, dtype and placement of the host buffer one chunk is staged into."""

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pinned: bool
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


def staging_spec(state: Mapping[str, Any], rank: int | None = None, *,
                 rank_local: tuple[str, ...] = ()) -> dict[str, BufferSpec]:
    """The host buffers :func:`stage` would fill for ``state``, without copying anything.

    Cheap (metadata only), so it can run on the training thread while
    :func:`allocate_staging` allocates the buffers elsewhere."""
    rank = default_rank() if rank is None else rank
    tensors, _ = flatten_state(state)
    return {key: BufferSpec(kind, tuple(local.shape), local.dtype, _pinned(local), global_shape, offset)
            for key, local, kind, global_shape, offset in _local_chunks(tensors, rank, rank_local)}


def allocate_staging(spec: Mapping[str, BufferSpec], rank: int, world_size: int, *,
                     rank_local: tuple[str, ...] = (), reuse: StagedShard | None = None) -> StagedShard:
    """Host buffers for every chunk of ``spec``, ready to be passed to :func:`stage` as ``reuse``.

    The first save of a run otherwise pays for allocating them inside the step stall: for a
    state on GPU, registering gigabytes of pinned (page-locked) host memory takes seconds; on
    CPU, the first touch of every fresh page. Buffers of ``reuse`` that already fit are kept.
    Pinned buffers are locked in memory at allocation, all of one call in one buffer of their
    exact size (:func:`_host_buffers`); plain ones are written once here so that their pages are
    faulted in before a save needs them. The buffers hold no state: the shard
    returned is not a checkpoint and must not be written. Buffers of ``reuse`` for keys outside
    ``spec`` are kept (the next :func:`stage` drops those its state does not have)."""
    previous = reuse.tensors if reuse is not None else {}
    wants = {key: (b.shape, b.dtype, b.pinned) for key, b in spec.items()}
    fresh = _host_buffers({key: w for key, w in wants.items() if not _fits(previous.get(key), w)}, touch=True)
    tensors = {key: StagedTensor(fresh[key] if key in fresh else previous[key].data, b.kind, b.global_shape,
                                 b.global_offset, b.pinned) for key, b in spec.items()}
    for key, old in previous.items():  # e.g. the model's, when ``spec`` covers only the optimizer
        tensors.setdefault(key, old)
    return StagedShard(rank, world_size, tensors, {}, tuple(rank_local))


def _index_bytes(staged: StagedShard, data_file: str) -> bytes:
    index = {
        "format_version": FORMAT_VERSION,
        "rank": staged.rank,
        "world_size": staged.world_size,
        "data_file": data_file,
        "rank_local": list(staged.rank_local),
        "tensors": {
            key: {"kind": st.kind, "dtype": dtype_name(st.data.dtype, key),
                  "global_shape": list(st.global_shape), "global_offset": list(st.global_offset),
                  "shape": list(st.data.shape)}
            for key, st in staged.tensors.items()
        },
        "extras": staged.extras,
    }
    try:
        return json.dumps(index, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"rank {staged.rank}: state values are not JSON-serialisable: {exc}") from exc


def write_shard(staged: StagedShard, storage: Storage, dir_path: str, rank: int | None = None,
                chunk_bytes: int = 16 * 1024 * 1024, guard: Callable[[], None] | None = None) -> list[FileRecord]:
    """Write ``staged`` as ``shard_{rank}.safetensors`` + ``shard_{rank}.json`` under ``dir_path``.

    The tensor file streams straight from the staged buffers while its sha256 is computed.
    ``guard`` (see :func:`~resilient_rl.checkpoint.write_guard.not_committed`) is called before
    streaming starts (no work on a write that would be dropped) and as the last step before each
    file replaces its name (after its fsync, before the atomic rename or the close that completes
    an upload); when it raises, the file is not published. Returns the two files' records, paths
    relative to ``dir_path``."""
    if rank is not None and rank != staged.rank:
        raise CheckpointError(f"write_shard: rank {rank} differs from the staged shard's rank {staged.rank}")
    stem = shard_basename(staged.rank)
    data_name, index_name = f"{stem}.safetensors", f"{stem}.json"
    data = {key: st.data for key, st in staged.tensors.items()}
    header = build_header(data, {"format": "pt", "rrl_format_version": str(FORMAT_VERSION)})
    if guard is not None:
        guard()
    written = storage.write_stream(Storage.join(dir_path, data_name),
                                   lambda: progress.advancing(iter_file_chunks(header, data, chunk_bytes), "ckpt"),
                                   before_publish=guard)
    index = storage.write_bytes_atomic(Storage.join(dir_path, index_name),
                                       _index_bytes(staged, data_name), before_publish=guard)
    return [FileRecord(data_name, written.size, written.sha256),
            FileRecord(index_name, index.size, index.sha256)]


def _template_target(key: str, t: torch.Tensor) -> ReadTarget | None:
    if isinstance(t, DTensor):
        if t.device_mesh.get_coordinate() is None:
            return None
        local = t.to_local()
        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(local.shape) != tuple(local_shape):
            raise CheckpointError(f"template tensor {key!r}: local shape {tuple(local.shape)} "
                                  f"differs from {tuple(local_shape)} for {t.placements}")
        return ReadTarget(key, local, tuple(int(o) for o in offset), tuple(t.shape))
    return ReadTarget(key, t, (0,) * t.ndim, tuple(t.shape))


def load_shard_into(template_state: Mapping[str, Any], storage: Storage, dir_path: str,
                    manifest_files: list[FileRecord] | None = None, verify: bool = True, *,
                    rank: int | None = None, strict: bool = True) -> dict[str, Any]:
    """Fill ``template_state`` (this rank's current state: DTensors of the current world size or
    plain tensors) from the checkpoint in ``dir_path``, resharding as needed.

    Tensors are filled in place (DTensors stay DTensors; call ``set_model_state_dict`` /
    ``set_optimizer_state_dict`` afterwards); the returned state has the saved structure and
    non-tensor values. With ``manifest_files`` (records relative to ``dir_path``, or to the step
    folder) and ``verify``, every file read is checked against its size and sha256. A key of the
    template missing from the checkpoint, a shape or dtype mismatch, or a damaged file raises
    CheckpointCorruptError; a saved key the template lacks raises CheckpointError when
    ``strict``, else it is returned as a full plain tensor. On error the template's tensors may
    be partly overwritten."""
    rank = default_rank() if rank is None else rank
    ckpt = CheckpointDir(storage, dir_path, manifest_files, verify)
    tensors, _ = flatten_state(template_state)
    with torch.no_grad():
        return _fill(ckpt, tensors, rank, strict)


def _fill(ckpt: CheckpointDir, tensors: dict[str, torch.Tensor], rank: int, strict: bool) -> dict[str, Any]:
    saved = ckpt.tensor_keys()
    missing = [k for k in tensors if k not in saved]
    if missing:
        raise CheckpointCorruptError(
            f"{ckpt.where}: key(s) {missing[:5]} of the state are not in the checkpoint "
            f"({len(missing)} missing; files {ckpt.index_files()[:3]}...)")
    unexpected = sorted(saved - tensors.keys())
    if unexpected and strict:
        raise CheckpointError(f"{ckpt.where}: the checkpoint has key(s) {unexpected[:5]} that the "
                              f"state lacks ({len(unexpected)} in all); pass strict=False to load them")
    out: dict[str, torch.Tensor] = dict(tensors)
    targets = [tg for k, t in tensors.items() if (tg := _template_target(k, t)) is not None]
    for key in unexpected:
        shape, dtype = ckpt.global_meta(key)
        out[key] = torch.empty(shape, dtype=dtype)
        targets.append(ReadTarget(key, out[key], (0,) * len(shape), shape))
    read_targets(ckpt, targets, rank)
    try:
        return unflatten_state(out, ckpt.extras_for(rank))
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        if isinstance(exc, CheckpointCorruptError):
            raise
        raise CheckpointCorruptError(f"{ckpt.where}: shard indexes: malformed state structure ({exc})") from exc


def gather_full_state(storage: Storage, dir_path: str, manifest_files: list[FileRecord] | None = None,
                      verify: bool = True, prefix: str = "") -> dict[str, torch.Tensor]:
    """Consolidate every saved chunk into full tensors: ``{flat key: tensor}``.

    With ``prefix`` (a flat key such as ``"model"``) only keys below it are gathered, with the
    prefix stripped (e.g. ``model/0.weight`` -> ``0.weight``)."""
    ckpt = CheckpointDir(storage, dir_path, manifest_files, verify)
    head = prefix.strip("/") + "/" if prefix else ""
    full: dict[str, torch.Tensor] = {}
    targets: list[ReadTarget] = []
    for key in sorted(ckpt.tensor_keys()):
        if not key.startswith(head):
            continue
        shape, dtype = ckpt.global_meta(key)
        t = full[key[len(head):]] = torch.empty(shape, dtype=dtype)
        targets.append(ReadTarget(key, t, (0,) * len(shape), shape))
    read_targets(ckpt, targets, rank=0)
    return full
