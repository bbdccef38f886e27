"""Causal attention over packed rows (:mod:`resilient_rl.models.packing`) without a ``T x T`` mask.

:func:`varlen_attention` takes ``q`` ``[B, heads, T, D]`` and ``k``/``v`` ``[B, kv_heads, T, D]``
(grouped-query: ``heads`` a multiple of ``kv_heads``) and attends causally within each sequence of
the rows' :class:`~resilient_rl.models.packing.PackedLayout`. :func:`choose_backend` picks how:

- ``"flash"``: flash-attn's ``flash_attn_varlen_func``, for CUDA tensors in fp16/bf16 when
  ``flash_attn`` is importable. All rows' tokens form one ``[total, heads, D]`` batch whose
  sequences start at ``cu_seqlens``; the kernel reads grouped key/value heads as they are.
- ``"torch"``: the same layout through torch's own ``varlen_attn``
  (``torch.nn.attention.varlen``: the FlashAttention-2 kernels built into torch's CUDA build), for
  CUDA tensors in fp16/bf16 on a device of compute capability 8.0 or newer where flash-attn is not
  installed, so a cluster without flash-attn's wheels gets one kernel per packed batch too. It needs
  a torch whose ``varlen_attn`` takes the causal mask as ``window_size`` (2.11 and newer); it has
  no attention dropout (a call with dropout takes ``"split"``). Grouped key/value heads go to the
  kernel as they are where it takes ``enable_gqa``, else (torch 2.11) repeated to the query heads
  in the copy that lays the tokens out for the kernel, where ``"split"`` costs one kernel per
  sequence (on an H200, 96 sequences of 128-512 tokens took 15.36 ms forward and backward split,
  against 1.86 ms through this kernel with the heads repeated, then in a copy of their own: the
  table below). Under autocast the choice and the kernel's inputs take autocast's dtype, as
  ``scaled_dot_product_attention`` would (:func:`~resilient_rl.models.precision.compute_dtype`):
  a Hugging Face model's query and key leave the rotary embedding in fp32 there. Where the kernel
  raises (a shape or device it does not take), the process logs why once and takes ``"split"``
  from then.
- ``"flex"``: chosen by name only. ``flex_attention``, compiled once per process with dynamic
  shapes (a new packed length does not recompile), under a document-causal ``BlockMask`` built
  from the sequence boundaries at block granularity: blocks outside every sequence's causal
  triangle are skipped, blocks inside one are computed without the mask, and no score matrix is
  materialised.
- ``"split"``: everything else (the CPU, and a GPU neither of those kernels serves).
  ``scaled_dot_product_attention`` with ``is_causal=True`` on each sequence (a row's sequences are
  contiguous, so this is a split along the tokens and a concatenation); each call runs a fused
  kernel (flash or memory-efficient on a GPU), which keeps no score matrix.

Why ``"split"`` on the CPU: measured with ``python bench/varlen.py --repeat 15`` (torch 2.13 CPU
build, 2 cores, fp32, best of 15). Compiled flex attention raises ``NotImplementedError`` ("does
not support backward on CPU") for any input that requires grad, and the update pass trains through
attention; nested jagged tensors find no CPU SDPA backend ("No viable backend"). Forward only /
forward and backward:

=====================================  ==============  ==============  ===============  ==========
shape                                  split           right-padded    dense T x T      flex
=====================================  ==============  ==============  ===============  ==========
8 sequences of 1..111 (T=484),         0.29 / 1.04 ms  0.67 / 1.89 ms  1.04 / 2.69 ms   1.57 ms /
4 heads over 2, D=16                                                                    (none)
12 sequences of 113..349 (T=2706),     27 / 70 ms      42 / 142 ms     191 / 643 ms     1305 ms /
14 heads over 2, D=64                                                                   (none)
=====================================  ==============  ==============  ===============  ==========

(right-padded: the sequences padded to the longest and batched through one causal SDPA call;
flex's first call also compiles, 2-8 s.) The split is also the computation each sequence gets
when it runs alone: the same kernel, one sequence at a time.

Why ``"split"``, not ``"flex"``, where neither varlen kernel serves: on an H200 (torch 2.11+cu130,
bf16, ``python bench/varlen.py --device cuda --repeat 10``, best of 10; before the ``"torch"``
backend, which that bench now times too), forward / forward and backward:

=====================================  ==============  ==============  ===============  ==============
shape                                  split           right-padded    dense T x T      flex
=====================================  ==============  ==============  ===============  ==============
8 sequences of 1..111 (T=484)          0.24 / 1.38 ms  0.24 / 1.30 ms  0.09 / 0.43 ms   1.72 / 2.98 ms
12 sequences of 113..349 (T=2706)      0.31 / 1.93 ms  0.26 / 1.50 ms  0.23 / 0.86 ms   1.73 / 2.78 ms
=====================================  ==============  ==============  ===============  ==============

The dense mask is quickest at these lengths but grows as ``T x T`` (memory and time) with the
packed length; flex was the slowest way that keeps no score matrix.

``"torch"`` on the same H200 and torch (its ``varlen_attn`` has no ``enable_gqa``, so the grouped
heads were repeated), in the same run as the others, forward and backward (best of 10):

=====================================  =========  ============  ==========  =========
shape                                  split      right-padded  flex        torch
=====================================  =========  ============  ==========  =========
12 sequences of 113..349 (T=2706)      1.96 ms    2.14 ms       3.55 ms     1.53 ms
96 sequences of 128..512 (T=32369)     15.36 ms   3.16 ms       4.19 ms     1.86 ms
=====================================  =========  ============  ==========  =========

The second shape is a micro-batch of the 0.5 B workload: there the split takes 8 times the
varlen kernel's time, one kernel launch per sequence and layer.

Compiled blocks (``actor.compile``) keep the varlen kernels inside their graphs: a packed
forward's kernel is decided before the blocks run (:func:`plan_kernel`), and both kernels are
custom operators; only the split breaks a compiled block at its attention.

Hugging Face models reach this through :mod:`resilient_rl.models.varlen_hf`.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from resilient_rl.errors import ModelInputError
from resilient_rl.models.packing import PackedLayout
from resilient_rl.models.precision import compute_dtype
from resilient_rl.models.varlen_flex import BLOCK, document_block_mask, flex_packed_attention

__all__ = ["BLOCK", "KernelPlan", "choose_backend", "document_block_mask", "outside_graph", "plan_kernel",
           "varlen_attention"]

logger = logging.getLogger(__name__)


@functools.cache
def _flash_varlen_func():
    """flash-attn's ``flash_attn_varlen_func``, or None when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen_func():
    """torch's own ``varlen_attn`` where this torch has it and takes the causal mask as
    ``window_size`` (torch 2.11 and newer; 2.10 took ``is_causal``), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


@functools.cache
def _takes_gqa(kernel) -> bool:
    return "enable_gqa" in inspect.signature(kernel).parameters


def _torch_varlen_serves(dropout: float) -> bool:
    """Whether torch's ``varlen_attn`` can take a call with attention ``dropout``: it has none."""
    return _torch_varlen_func() is not None and not dropout


#: Why torch's varlen kernel failed in this process, once it has: packed attention then runs split.
_TORCH_VARLEN_FAILED: list[str] = []
#: How each backend is named in the line a process logs the first time it chooses it.
_BACKEND_NAMES = {"flash": "flash-attn's varlen kernel", "torch": "torch's varlen kernel (torch.nn.attention.varlen)",
                  "split": "one scaled_dot_product_attention call per sequence"}
_ANNOUNCED: set[str] = set()


@functools.cache
def _flash_capable(index: int | None) -> bool:
    """Whether CUDA device ``index`` runs torch's FlashAttention-2 kernels (compute capability 8.0
    or newer, and a torch built with them for CUDA: a ROCm build's varlen path is not the same)."""
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    return bool(available) and torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 0)


def choose_backend(device: torch.device, dtype: torch.dtype, dropout: float = 0.0) -> str:
    """``"flash"``, ``"torch"`` or ``"split"`` for tensors on ``device`` in ``dtype``, with attention
    ``dropout`` (see the module docs)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "split"
    if _flash_varlen_func() is not None:
        return "flash"
    if _torch_varlen_serves(dropout) and not _TORCH_VARLEN_FAILED and _flash_capable(device.index):
        return "torch"
    return "split"


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                     scale: float | None = None, backend: str | None = None, dropout: float = 0.0,
                     window: int | None = None, plan: KernelPlan | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence of ``layout``; returns ``[B, heads, T, D]``.

    ``dropout``: attention dropout probability. ``window``: a sliding window, each query seeing
    its last ``window`` keys (itself included); the split backend masks only the sequences longer
    than the window, each with its own ``L x L`` band. The flex backend has neither and raises
    :class:`ModelInputError` when asked. ``backend`` overrides :func:`choose_backend`.

    Inside a compiled region (``actor.compile``: every block compiled) a call with a
    :class:`KernelPlan` (``plan``, made by :func:`plan_kernel` before the blocks run) and no dropout
    runs its varlen kernel inside the graph: the kernels are custom operators, the sequence
    starts a tensor and the longest a symbol, so each block stays one graph. Any other call runs
    outside the graph (the split's sequence lengths are host values, which a graph would
    specialise on); the flex backend compiles its own call.
    """
    if torch.compiler.is_compiling():
        if plan is not None and backend is None and not dropout:
            return _planned(q, k, v, plan, scale, window)
        return outside_graph()(q, k, v, layout, scale, backend, dropout, window, plan)
    return _attention(q, k, v, layout, scale, backend, dropout, window, plan)


@dataclass(frozen=True, eq=False)
class KernelPlan:
    """A packed forward's varlen kernel, decided before its compiled blocks run: the backend
    (``"flash"`` or ``"torch"``), the dtype it computes in, the sequences' starts on the device,
    the longest sequence, the kernel, and whether it reads grouped key/value heads as they are."""

    backend: str
    dtype: torch.dtype
    cu_seqlens: torch.Tensor
    longest: int
    kernel: Callable
    gqa: bool


def plan_kernel(layout: PackedLayout, device: torch.device, dtype: torch.dtype | None) -> KernelPlan | None:
    """The :class:`KernelPlan` of a packed forward on ``device`` computing in ``dtype``, or None
    where no varlen kernel serves it (the split then runs outside the graph)."""
    backend = choose_backend(device, dtype, 0.0) if dtype is not None else "split"
    if backend not in ("flash", "torch"):
        return None
    kernel = _flash_varlen_func() if backend == "flash" else _torch_varlen_func()
    cu, longest = _cu_seqlens(layout, device)
    return KernelPlan(backend, dtype, cu, longest, kernel, backend == "flash" or _takes_gqa(kernel))


def _planned(q, k, v, plan: KernelPlan, scale: float | None, window: int | None) -> torch.Tensor:
    """:func:`varlen_attention` through ``plan``'s kernel: nothing here reads a host value."""
    window = _reaching(window, plan.longest)
    if plan.backend == "flash":
        return _flash_call(q, k, v, plan.kernel, plan.cu_seqlens, plan.longest, scale, 0.0, window, plan.dtype)
    return _torch_varlen_call(q, k, v, plan.kernel, plan.gqa, plan.cu_seqlens, plan.longest, scale, window, plan.dtype)


def _reaching(window: int | None, longest: int) -> int | None:
    """``window``, or None where no sequence reaches past it (up to ``longest`` tokens)."""
    return None if window is not None and window >= longest else window


_OUTSIDE_GRAPH: list = []


def outside_graph():
    """:func:`_attention` marked to run outside a compiled graph. Not made at import: marking it
    would import the compiler (``torch._dynamo``, about as much CPU time as torch itself) into every
    process, where a restarted rank's start-up pays for it. Whatever compiles blocks makes it first
    (:func:`~resilient_rl.workers.block_options.apply_block_options`): made inside a compiled call,
    torch 2.11's compiler breaks that graph at the ``disable`` call and at the append."""
    if not _OUTSIDE_GRAPH:
        _OUTSIDE_GRAPH.append(torch.compiler.disable(_attention))
    return _OUTSIDE_GRAPH[0]


def _attention(q, k, v, layout: PackedLayout, scale: float | None, backend: str | None, dropout: float,
               window: int | None, plan: KernelPlan | None = None) -> torch.Tensor:
    batch, heads, seq, dim = q.shape
    if (batch, seq) != (layout.batch, layout.seq) or k.shape[2] != seq or heads % k.shape[1]:
        raise ModelInputError(f"packed attention: q {tuple(q.shape)}, k {tuple(k.shape)} do not fit "
                              f"rows [{layout.batch}, {layout.seq}] with heads a multiple of key/value heads")
    chosen = backend is None
    dtype = compute_dtype(q)
    if plan is not None and (plan.cu_seqlens.device != q.device or plan.dtype != dtype):
        plan = None  # made for another call
    if chosen and plan is not None and not dropout and not _TORCH_VARLEN_FAILED:
        backend = plan.backend  # the forward's choice (plan_kernel), made once for its layers
    backend = backend or choose_backend(q.device, dtype, dropout)
    if chosen and backend not in _ANNOUNCED:
        _ANNOUNCED.add(backend)
        logger.info("packed attention: %s", _BACKEND_NAMES.get(backend, backend))
    window = _reaching(window, max(layout.lengths, default=0))
    if backend in ("flash", "torch"):  # the sequence starts on the device: once a forward (its plan)
        starts = (plan.cu_seqlens, plan.longest) if plan is not None else _cu_seqlens(layout, q.device)
    if backend == "flash":
        return _flash(q, k, v, starts, scale, dropout, window, dtype)
    if backend == "torch":
        if not _torch_varlen_serves(dropout):
            raise ModelInputError(f"packed attention on the torch backend needs torch's varlen_attn with "
                                  f"window_size (torch {torch.__version__}) and takes no attention dropout "
                                  f"(got {dropout})")
        try:
            return _torch_varlen(q, k, v, starts, scale, window, dtype)
        except torch.OutOfMemoryError:  # the device's memory, not the kernel: every way needs it
            raise
        except RuntimeError as exc:  # e.g. a head size or device its kernels do not take
            if not chosen:
                raise
            _TORCH_VARLEN_FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            logger.warning("packed attention: torch's varlen kernel failed (%s); this process attends per "
                           "sequence from now on", _TORCH_VARLEN_FAILED[0])
            backend = "split"
            _ANNOUNCED.add(backend)  # the warning said so
    if backend == "flex":
        if dropout or window is not None:
            raise ModelInputError(f"packed attention on the flex backend has no attention dropout (got "
                                  f"{dropout}) and no sliding window (got {window}, sequences up to "
                                  f"{max(layout.lengths)} tokens)")
        out = flex_packed_attention(_tokens(q), _tokens(k), _tokens(v), layout, scale)
    elif backend == "split":
        out = _split(_tokens(q), _tokens(k), _tokens(v), layout, scale, dropout, window)
    else:
        raise ModelInputError(f"unknown packed attention backend {backend!r} (flash, torch, flex, split)")
    return out[0].view(heads, batch, seq, dim).transpose(0, 1)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``[B, h, T, D]`` -> ``[1, h, B*T, D]``: the rows end to end (a view when ``B`` is 1)."""
    batch, heads, seq, dim = x.shape
    return x.transpose(0, 1).reshape(1, heads, batch * seq, dim)


def _split(q, k, v, layout: PackedLayout, scale: float | None, dropout: float, window: int | None) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    parts = []
    for qs, ks, vs in zip(q.split(layout.lengths, 2), k.split(layout.lengths, 2), v.split(layout.lengths, 2)):
        length = qs.shape[2]
        if window is None or length <= window:
            parts.append(F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scale,
                                                        enable_gqa=gqa))
            continue
        ahead = torch.arange(length, device=q.device)[:, None] - torch.arange(length, device=q.device)[None, :]
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=(ahead >= 0) & (ahead < window),
                                                    dropout_p=dropout, scale=scale, enable_gqa=gqa))
    return torch.cat(parts, dim=2) if parts else q.new_empty(q.shape)


def _token_major(x: torch.Tensor, repeat: int = 1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, h, T, D]`` -> ``[B*T, h * repeat, D]`` in ``dtype`` (default ``x``'s): the layout of the
    varlen kernels, each head ``repeat`` times in a row (head ``i`` of the result is head
    ``i // repeat`` of ``x``, as the models' ``repeat_kv`` lays grouped key/value heads out), in the
    one copy the layout makes (none where ``x`` is laid out so already, in ``dtype``)."""
    batch, heads, seq, dim = x.shape
    x = x.transpose(1, 2)
    dtype = dtype or x.dtype
    if repeat == 1 and dtype == x.dtype:
        return x.reshape(batch * seq, heads, dim)
    if repeat > 1:
        x = x[:, :, :, None, :].expand(batch, seq, heads, repeat, dim)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    out.copy_(x)  # the layout, the repeated heads and the cast in one pass
    return out.view(batch * seq, heads * repeat, dim)


def _head_major(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A varlen kernel's ``[B*T, h, D]`` output back to ``like``'s ``[B, h, T, D]``."""
    batch, heads, seq, dim = like.shape
    return out.view(batch, seq, heads, dim).transpose(1, 2)


def _cu_seqlens(layout: PackedLayout, device: torch.device) -> tuple[torch.Tensor, int]:
    """The sequences' starts (and the end) as the varlen kernels take them, and the longest."""
    return layout.cu_seqlens.to(device=device, dtype=torch.int32), max(layout.lengths, default=0)


def _flash(q, k, v, starts: tuple[torch.Tensor, int], scale: float | None, dropout: float, window: int | None,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    kernel = _flash_varlen_func()
    if kernel is None:
        raise ModelInputError("the flash packed-attention backend needs flash-attn (pip install flash-attn)")
    return _flash_call(q, k, v, kernel, *starts, scale, dropout, window, dtype)


def _flash_call(q, k, v, kernel, cu: torch.Tensor, longest: int, scale: float | None, dropout: float,
                window: int | None, dtype: torch.dtype | None) -> torch.Tensor:
    # flash-attn's window counts the keys on each side of the query, the query not included.
    q_, k_, v_ = (_token_major(x, dtype=dtype) for x in (q, k, v))
    out = kernel(q_, k_, v_, cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scale, causal=True,
                 window_size=(-1, -1) if window is None else (window - 1, 0))
    return _head_major(out, q)


def _torch_varlen(q, k, v, starts: tuple[torch.Tensor, int], scale: float | None, window: int | None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    kernel = _torch_varlen_func()
    return _torch_varlen_call(q, k, v, kernel, _takes_gqa(kernel), *starts, scale, window, dtype)


def _torch_varlen_call(q, k, v, kernel, takes_gqa: bool, cu: torch.Tensor, longest: int, scale: float | None,
                       window: int | None, dtype: torch.dtype | None) -> torch.Tensor:
    grouped, repeat = {}, 1
    if q.shape[1] != k.shape[1]:
        if takes_gqa:
            grouped = {"enable_gqa": True}
        else:  # query head i reads key/value head i // repeat
            repeat = q.shape[1] // k.shape[1]
    # (-1, 0) is causal; (w, 0) a causal window of w keys before the query, as flash-attn counts it.
    q_, k_, v_ = _token_major(q, dtype=dtype), _token_major(k, repeat, dtype), _token_major(v, repeat, dtype)
    out = kernel(q_, k_, v_, cu, cu, longest, longest, scale=scale,
                 window_size=(-1, 0) if window is None else (window - 1, 0), **grouped)
    return _head_major(out, q)
