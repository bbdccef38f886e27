"""The copy path of in-memory snapshots: a rank's tensors packed into one flat host buffer.

A snapshot copies the engine's own tensors, not a state dict built for the occasion: the local
shard of every model parameter and persistent buffer (FSDP2 keeps a parameter's shard in place
across steps) and every tensor of the optimizer's per-parameter state (AdamW: ``step``,
``exp_avg``, ``exp_avg_sq``), in a fixed order (:func:`named_tensors`). Their byte layout
(:class:`Layout`: name, dtype, shape and offset of each) is computed once and reused while the
tensors keep their names, shapes and dtypes; each snapshot copies them into a preallocated host
buffer (:class:`HostRing`, page-locked on CUDA at its exact size:
:func:`~resilient_rl.page_lock.pinned_host_buffer`),
chunk by chunk, reporting progress after each chunk
(:mod:`resilient_rl.runtime.progress`), so a rank copying a large state still advances. On
CUDA the copies run on a side stream (after the current stream's queued work) into pinned memory
with ``non_blocking=True``; :func:`copy_out` waits for each chunk's event (the GIL is released
while it waits, so the health concurrency group answers) and returns only once the host copy is
complete.

The buffer travels as a NumPy array: Ray serializes it out of band (one memory copy into the
object store, no pickling of tensors) and hands it to a reader as a zero-copy view.

:func:`copy_in` writes a packed copy back into the same tensors in place (``copy_``), after
checking that the layout matches name by name (a :class:`ValueError` names the first path that
differs); a pageable copy into GPU tensors goes through two small page-locked buffers
(:mod:`resilient_rl.workers.snapshots.staged`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Iterator

import numpy as np
import torch

from resilient_rl import page_lock
from resilient_rl.page_lock import pinned_host_buffer
from resilient_rl.runtime import progress
from resilient_rl.workers.snapshots.staged import staged_copy, wants_staging
from resilient_rl.workers.fsdp import reshard

#: Alignment of every tensor in a packed buffer (bytes): any dtype can be viewed at any offset.
ALIGN = 64
#: Bytes copied between two progress reports (and, on CUDA, between two waited events).
CHUNK_BYTES = 256 * 2**20


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself, not a copy), else ``t``."""
    shard = getattr(t, "_local_tensor", None)  # what to_local returns without autograd, minus its overhead
    if shard is not None:
        return shard
    if hasattr(t, "to_local"):
        with torch.no_grad():
            return t.to_local()
    return t


def named_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, torch.Tensor]]:
    """The tensors a snapshot copies, in a fixed order: ``model/<name>`` for each parameter
    and persistent buffer (local shards), ``optim/<param name>/<key>`` for each tensor of the
    optimizer's per-parameter state (parameters in ``param_groups`` order, keys sorted). An FSDP2
    model is resharded first (a survivor of a step cut short may hold its root gathered)."""
    reshard(model)
    out: list[tuple[str, torch.Tensor]] = []
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        out.append((f"model/{name}", local(p)))
    for mod_name, mod in model.named_modules():
        if not mod._buffers:
            continue
        skip = mod._non_persistent_buffers_set
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in skip:
                out.append((f"model/{mod_name + '.' if mod_name else ''}{b_name}", local(b)))
    if optimizer is not None:
        index = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                pname = names.get(id(p), f"param{index}")
                index += 1
                state = optimizer.state.get(p)
                for key in sorted(state or {}):
                    if torch.is_tensor(state[key]):
                        out.append((f"optim/{pname}/{key}", local(state[key])))
    return out


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a packed buffer."""

    name: str
    dtype: str  # str(torch.dtype), e.g. "torch.float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def as_tuple(self) -> tuple:
        return (self.name, self.dtype, self.shape, self.offset, self.nbytes)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each tensor lives in a packed buffer; ``total`` bytes in all."""

    entries: tuple[Entry, ...]
    total: int

    @classmethod
    def of(cls, tensors: list[tuple[str, torch.Tensor]]) -> "Layout":
        entries, offset = [], 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(Entry(name, str(t.dtype), tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return cls(tuple(entries), offset)

    def matches(self, tensors: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether ``tensors`` have this layout's names, dtypes and shapes, in order."""
        return len(tensors) == len(self.entries) and all(
            e.name == n and e.dtype == str(t.dtype) and e.shape == tuple(t.shape)
            for e, (n, t) in zip(self.entries, tensors))

    def to_list(self) -> list[tuple]:
        return [e.as_tuple() for e in self.entries]

    @classmethod
    def from_list(cls, rows: list) -> "Layout":
        entries = tuple(Entry(str(n), str(d), tuple(int(x) for x in s), int(o), int(b)) for n, d, s, o, b in rows)
        total = max((e.offset + e.nbytes for e in entries), default=0)
        return cls(entries, total)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """A view of each entry in the flat uint8 tensor ``buf``."""
        return [buf[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape) for e in self.entries]

    def check_against(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Raise a ValueError naming the first path where ``tensors`` differ from this layout."""
        have = {n: t for n, t in tensors}
        mine = {e.name for e in self.entries}
        for e in self.entries:
            t = have.get(e.name)
            if t is None:
                raise ValueError(f"snapshot does not match the state at {e.name}: not in the rank's state")
            if e.shape != tuple(t.shape):
                raise ValueError(f"snapshot shard at {e.name} has shape {e.shape}, the rank's {tuple(t.shape)}")
            if e.dtype != str(t.dtype):
                raise ValueError(f"snapshot does not match the state at {e.name}: dtype {e.dtype}, the rank's {t.dtype}")
        extra = [n for n, _ in tensors if n not in mine]
        if extra:
            raise ValueError(f"snapshot does not match the state at {extra[0]}: not in the snapshot")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"snapshot names an unknown dtype {name!r}")
    return dtype


def _chunks(layout: Layout, n: int) -> Iterator[range]:
    """Index ranges of consecutive entries of about :data:`CHUNK_BYTES` each."""
    start, size = 0, 0
    for i, e in enumerate(layout.entries[:n]):
        size += e.nbytes
        if size >= CHUNK_BYTES:
            yield range(start, i + 1)
            start, size = i + 1, 0
    if start < n:
        yield range(start, n)


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool) -> None:
    """``dst[i].copy_(src[i])``, one multi-tensor copy per (source device, destination device)."""
    groups: dict[tuple, tuple[list, list]] = {}
    for d, s in zip(dst, src):
        ds, ss = groups.setdefault((d.device, s.device), ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss, non_blocking=non_blocking)


class HostRing:
    """``slots`` flat host buffers of one layout's size, reused in turn (pinned where CUDA is).

    With ``files`` (:class:`~resilient_rl.workers.snapshots.node_memory.NodeFiles`) the buffers are that
    rank's files in node memory, which outlive the process; else the process's own memory."""

    def __init__(self, slots: int, files=None) -> None:
        self.slots = slots
        self.files = files
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self._pinned = [False] * slots
        # CUDA refused to page-lock the slot's buffer: keep it pageable rather than allocating
        # a new one (of the whole state's size) at every snapshot only to be refused again.
        self._pin_refused = [False] * slots
        self._unlock: list[Callable[[], None] | None] = [None] * slots  # process-memory buffers
        self._views: list[tuple[Layout | None, list]] = [(None, [])] * slots
        self._stream = None

    def buffer(self, slot: int, nbytes: int, pin: bool) -> torch.Tensor:
        buf = self.buffers[slot]
        if buf is None or buf.numel() != nbytes or (pin and not self._pinned[slot] and not self._pin_refused[slot]):
            self.forget(slot)  # free the old one first
            if self.files is None and pin:
                buf, self._unlock[slot] = pinned_host_buffer(nbytes)
                self._pinned[slot] = self._unlock[slot] is not None
            elif self.files is None:
                buf = torch.empty(nbytes, dtype=torch.uint8)
            else:
                buf = self.files.map(slot, nbytes)
                self._pinned[slot] = pin and page_lock.pin(buf)
            self._pin_refused[slot] = pin and not self._pinned[slot]
            self.buffers[slot] = buf
        return buf

    def adopt(self, slot: int, buf: torch.Tensor) -> None:
        """Use ``buf`` (a node-memory file read back) as buffer ``slot``."""
        self.forget(slot)
        self.buffers[slot] = buf

    def release(self) -> None:
        """Unregister the page-locked node-memory buffers (the ring is being replaced; readers of
        its buffers keep them)."""
        for slot in range(self.slots):
            self.forget(slot)

    def forget(self, slot: int) -> None:
        """Give ``slot`` a new buffer at its next use (whoever still reads the old one keeps it)."""
        if self._pinned[slot] and self.files is not None:
            page_lock.unpin(self.buffers[slot])
        unlock, self._unlock[slot] = self._unlock[slot], None
        if unlock is not None:
            unlock()
        self.buffers[slot] = None
        self._pinned[slot] = False
        self._pin_refused[slot] = False
        self._views[slot] = (None, [])

    def views(self, slot: int, layout: Layout) -> list[torch.Tensor]:
        """The views of ``layout`` into buffer ``slot`` (made once per layout and buffer)."""
        cached, views = self._views[slot]
        if cached is not layout:
            views = layout.views(self.buffers[slot])
            self._views[slot] = (layout, views)
        return views

    def copy_out(self, layout: Layout, tensors: list[torch.Tensor], slot: int) -> np.ndarray:
        """Copy ``tensors`` (laid out as ``layout``) into buffer ``slot``; the buffer as a NumPy
        array once the copy is complete."""
        cuda = [t.device for t in tensors if t.is_cuda]
        buf = self.buffer(slot, layout.total, pin=bool(cuda))
        dst = self.views(slot, layout)
        with torch.no_grad():
            if not cuda:
                for r in _chunks(layout, len(tensors)):
                    _copy(dst[r.start:r.stop], tensors[r.start:r.stop], non_blocking=False)
                    progress.advance("snapshot")
            else:
                device = cuda[0]
                if self._stream is None or self._stream.device != device:
                    self._stream = torch.cuda.Stream(device)
                self._stream.wait_stream(torch.cuda.current_stream(device))
                events = []
                with torch.cuda.stream(self._stream):
                    for r in _chunks(layout, len(tensors)):
                        _copy(dst[r.start:r.stop], tensors[r.start:r.stop], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self._stream)
                        events.append(ev)
                for ev in events:  # the GIL is released while waiting
                    ev.synchronize()
                    progress.advance("snapshot")
        return buf.numpy()


def as_tensor(data: np.ndarray) -> torch.Tensor:
    """A flat uint8 tensor over ``data`` without a copy (a read-only object-store view is only
    read from: torch's warning about non-writable arrays does not apply)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data, dtype=np.uint8).reshape(-1))


def copy_in(layout: Layout, data: np.ndarray, tensors: list[tuple[str, torch.Tensor]],
            staged: bool | None = None) -> None:
    """Write the packed ``data`` into ``tensors`` in place, after :meth:`Layout.check_against`.

    ``staged``: through two page-locked buffers (:mod:`resilient_rl.workers.snapshots.staged`);
    None: where a tensor is on a GPU and ``data`` is pageable."""
    layout.check_against(tensors)
    if data.nbytes < layout.total:
        raise ValueError(f"snapshot data has {data.nbytes} bytes, its layout needs {layout.total}")
    flat = as_tensor(data)
    by_name = {n: t for n, t in tensors}
    dst = [by_name[e.name] for e in layout.entries]
    if staged if staged is not None else wants_staging(flat, dst):
        staged_copy(flat, [e.offset for e in layout.entries], dst)
        return
    src = layout.views(flat)
    with torch.no_grad():
        for r in _chunks(layout, len(dst)):
            _copy(dst[r.start:r.stop], src[r.start:r.stop], non_blocking=False)
            progress.advance("snapshot")
