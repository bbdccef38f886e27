"""Page-locked host memory at its exact size: ``cudaHostRegister`` of pageable memory, best effort.

Copies from the GPU run asynchronously only into page-locked (pinned) host memory. torch's way to
get some, ``torch.empty(..., pin_memory=True)``, goes through its caching host allocator, which
rounds every block up to a power of two (a 19 GiB state locks 32 GiB; 25% more on average), and
keeps freed blocks cached. So the large, long-lived host buffers (a snapshot ring's, in process or
node memory; a checkpoint's staging buffers) are allocated pageable at their exact size and then
registered with CUDA (:func:`pin`, :func:`pinned_host_buffer`, :func:`pinned_tensors`). CUDA may
refuse (a registration larger than the node lets this process lock, memory already registered):
the copies then go to pageable memory, correct but not overlapped.

A refusal must not cost more than that. torch's binding of the runtime call returns its error
code and raises nothing, but the CUDA runtime also keeps a failed call's error as the thread's
last error, until something reads it; torch reads it after its next kernel launch and raises it
there. Left alone, a refused page lock would end the next training step with an unrelated
``CUDA error``. So every failed call here consumes that error at once: ``cudaGetLastError`` of
each CUDA runtime library mapped in the process (:func:`drain`; torch's binding has no such
call, and the error is kept per library instance, so the one torch loaded must be among them).
"""

from __future__ import annotations

import ctypes
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Runtime libraries opened so far, by path (opening a mapped library again returns it).
_OPENED: dict[str, Any] = {}


#: Alignment of each tensor in a buffer of :func:`pinned_tensors` (bytes): any dtype at any offset.
ALIGN = 64


def pinned_host_buffer(nbytes: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A flat uint8 host buffer of exactly ``nbytes``, page-locked for asynchronous copies from
    the GPU, and the call that unlocks it (None when CUDA refused: the copies then go to pageable
    memory, correct but not overlapped).

    Allocated pageable at its size and registered (``cudaHostRegister``), never through torch's
    power-of-two caching host allocator (see the module docstring). The unlock runs at most once:
    when the owner lets the buffer go, or else when the last tensor or array over it is gone
    (before the memory is freed: a freed range must not stay registered)."""
    array = np.empty(nbytes, dtype=np.uint8)
    buf = torch.from_numpy(array)  # the tensor (and every view of it) keeps ``array`` alive
    if not pin(buf):
        return buf, None
    return buf, weakref.finalize(array, unregister, buf.data_ptr(), torch.cuda.cudart())


def packed_size(shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """(offset of each tensor, total bytes) of ``shapes`` packed one after another, each starting
    on an :data:`ALIGN` boundary: what :func:`pinned_tensors` allocates, to the byte."""
    offsets, total = [], 0
    for shape, dtype in shapes:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return offsets, total


def pinned_tensors(shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[torch.Tensor], bool]:
    """Host tensors of the given (shape, dtype), views into one :func:`pinned_host_buffer` of
    their packed size (:func:`packed_size`), and whether CUDA page-locked it.

    One registration for them all rather than one each: registering is a system call per
    buffer, and each tensor's own buffer would round up to whole pages. The memory is unlocked
    and freed once the last of the tensors (or a view of one) is gone."""
    offsets, total = packed_size(shapes)
    buf, unlock = pinned_host_buffer(total)
    return [buf[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype) in zip(offsets, shapes)], unlock is not None


def pin(t: torch.Tensor, cudart: Any = None, runtimes: list | None = None) -> bool:
    """Page-lock ``t``'s memory for asynchronous copies from the GPU; False when CUDA refuses,
    with the refusal's error consumed (``runtimes``: the libraries to consume it from, by default
    every CUDA runtime mapped in the process)."""
    if not t.numel():
        return False
    cudart = cudart if cudart is not None else torch.cuda.cudart()
    code = _code(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if code == 0:
        return True
    drain(runtimes)
    logger.warning("cudaHostRegister of %d bytes of host memory failed (error %d): copies "
                   "from the GPU into it are not asynchronous", t.numel() * t.element_size(), code)
    return False


def unregister(ptr: int, cudart: Any = None, runtimes: list | None = None) -> None:
    """Undo :func:`pin` of the memory at ``ptr``; a failure is logged and its error consumed."""
    cudart = cudart if cudart is not None else torch.cuda.cudart()
    code = _code(cudart.cudaHostUnregister(ptr))
    if code != 0:
        drain(runtimes)
        logger.warning("cudaHostUnregister of host memory at %#x failed (error %d)", ptr, code)


def unpin(t: torch.Tensor, cudart: Any = None, runtimes: list | None = None) -> None:
    unregister(t.data_ptr(), cudart, runtimes)


def drain(runtimes: list | None = None) -> list[int]:
    """Read (and so clear) the last error of this thread in each CUDA runtime library of
    ``runtimes`` (default: :func:`loaded_runtimes`); the errors that were pending."""
    found = []
    for runtime in loaded_runtimes() if runtimes is None else runtimes:
        code = _code(runtime.cudaGetLastError())
        if code != 0:
            found.append(code)
    return found


def loaded_runtimes() -> list:
    """Every CUDA runtime library mapped in this process, opened through ctypes (the same
    instance: the dynamic loader returns a library already loaded from that path)."""
    try:
        with open("/proc/self/maps") as f:
            paths = runtime_paths(f.read())
    except OSError:
        return []
    runtimes = []
    for path in paths:
        if path not in _OPENED:
            try:
                lib = ctypes.CDLL(path)
                lib.cudaGetLastError.restype = ctypes.c_int
                lib.cudaGetLastError.argtypes = []
            except (OSError, AttributeError) as exc:
                logger.debug("cannot open the CUDA runtime %s: %s", path, exc)
                lib = None
            _OPENED[path] = lib
        if _OPENED[path] is not None:
            runtimes.append(_OPENED[path])
    return runtimes


def runtime_paths(maps: str) -> list[str]:
    """The CUDA runtime libraries among the files of a ``/proc/<pid>/maps`` text, each once: the
    CUDA toolkit's ``libcudart.so.N`` and the renamed copies wheels bundle (``libcudart-<hash>.so.N``)."""
    paths = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].removesuffix(" (deleted)")
        name = path.rsplit("/", 1)[-1]
        if name.startswith("libcudart") and ".so" in name and path not in paths:
            paths.append(path)
    return paths


def _code(err: Any) -> int:
    """A cudaError value as an int (torch's binding returns an enum member)."""
    return int(getattr(err, "value", err))
