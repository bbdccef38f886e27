"""The chunked log-prob head: the chosen token's log-prob and the entropy of ``hidden @ weight.T``
(+ ``bias``), ``rows`` positions at a time, never more than one chunk of logits at once.

:func:`chunked_head_stats` projects each chunk and reduces it at once to ``[rows, 2]`` (fp32). With
gradients it is one autograd function over all chunks (:class:`_ChunkedHead`): its forward keeps
no logits, and its backward recomputes each chunk's logits, takes their gradient in closed form
(:func:`logit_grad`) and from it the chunk's share of the hidden states' gradient and of the
weight's. In mixed precision:

- the weight is cast to the compute dtype (autocast's, else its own) once per forward and once per
  backward, not once per chunk: under autocast, a per-chunk ``F.linear`` with its own recomputation
  cast the fp32 weight again for every chunk of the backward (the tied 151,936 x 1,536 head of
  Qwen2.5-1.5B: 0.9 GB of fp32 read and 0.5 GB of bf16 written each time, about 80 chunks a
  1.5 B update);
- the chunks' weight gradients are summed in fp32 into one buffer (where the device has it, the
  product adds into that buffer itself: ``addmm`` with ``out_dtype``), and autograd receives one
  gradient for the weight per pass in the weight's dtype. Per-chunk gradients instead each
  reached the fp32 weight through the cast's backward: a bf16 gradient, its fp32 copy and an fp32
  add of the whole weight, for every chunk;
- the hidden states' gradient is written chunk by chunk into one tensor of their dtype.

The closed form, with ``p = softmax(z)`` and ``E[z] = sum(p * z)`` over the vocabulary:
``d log p[y] / dz = onehot(y) - p`` and ``d entropy / dz = -p * (z - E[z])``. The values equal
autograd's through :func:`logit_stats` within float rounding (tests/test_chunked_logprob.py).

With ``compiled`` (``actor.compile_head``; see :mod:`resilient_rl.workers.logprob`) the statistics
(:func:`fused_logit_stats`) and the gradient run compiled: each is one expression over the chunk's
logits with the rows as a symbol, so inductor fuses the passes over the vocabulary into a few
kernels, and the chosen logit is a masked sum, not a gather (no scatter into a zeroed ``[rows,
vocab]`` tensor). A process compiles two graphs, both without autograd: the statistics and the
gradient.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from resilient_rl.algos.losses import entropy_from_logits, logprobs_from_logits

__all__ = ["HEAD_FAILURE", "chunked_head_stats", "fused_logit_stats", "logit_grad", "logit_stats"]

log = logging.getLogger(__name__)

#: Why this process's head stopped compiling (None while it compiles): see :func:`_run`.
HEAD_FAILURE: dict[str, str | None] = {"reason": None}
#: Why this process's products stopped adding into the fp32 buffer themselves (see :func:`_accumulate`).
_FUSED_ADD_FAILED: list[str] = []


def logit_stats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` fp32: the log-prob of ``labels`` and the entropy, from ``logits`` ``[n, V]``, by
    the full-logits path's arithmetic (:mod:`resilient_rl.algos.losses`)."""
    return torch.stack([logprobs_from_logits(logits, labels), entropy_from_logits(logits)], dim=-1)


def fused_logit_stats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`logit_stats` as one expression, for the compiler. The chosen logit is a masked sum:
    it adds zeros to the one chosen value, so it equals the gather exactly."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    z = z - z.amax(dim=-1, keepdim=True)
    lse = torch.logsumexp(z, dim=-1)
    ids = torch.arange(z.shape[-1], device=z.device)
    picked = torch.where(ids == labels[:, None], z, 0.0).sum(dim=-1)
    return torch.stack([picked - lse, lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)], dim=-1)


def logit_grad(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`logit_stats` with respect to ``logits`` ``[n, V]``, given ``grad``
    ``[n, 2]`` (of the log-prob and of the entropy), in ``logits``' dtype, computed in fp32 (at
    least): ``g_lp * (onehot - p) - g_ent * p * (z - E[z])``."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    z = z - z.amax(dim=-1, keepdim=True)
    p = torch.exp(z - torch.logsumexp(z, dim=-1, keepdim=True))
    mean_z = (p * z).sum(dim=-1, keepdim=True)
    g = grad.to(z.dtype)
    g_lp, g_ent = g[:, :1], g[:, 1:]
    ids = torch.arange(z.shape[-1], device=z.device)
    return (torch.where(ids == labels[:, None], g_lp, 0.0) - p * (g_lp + g_ent * (z - mean_z))).to(logits.dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _run(fn, eager, compiled: bool, *args) -> torch.Tensor:
    """``fn(*args)`` compiled when ``compiled``; after a compiler failure (at a graph's first call)
    ``eager(*args)`` for the rest of the process, with one warning: the eager values are as
    correct. Only the compiler's own errors are caught: an out-of-memory error passes through."""
    if compiled and HEAD_FAILURE["reason"] is None:
        try:
            return _compiled(fn)(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:  # inductor's and Triton's errors too
            HEAD_FAILURE["reason"] = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("the log-prob head's compiled reductions failed (%s); this process computes them "
                        "eagerly from now on (actor.compile_head=false skips the compile)", HEAD_FAILURE["reason"])
    return eager(*args)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in: autocast's where it is on, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and weight.dtype.is_floating_point:
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _accumulate(acc: torch.Tensor, dlogits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``acc + dlogits.T @ hidden`` into the fp32 (or wider) ``acc``. Where the inputs are narrower,
    ``addmm`` with ``out_dtype`` adds the product in fp32 in its epilogue (CUDA has it); where that
    fails (the CPU, or a torch without it), once per process, the product is added to ``acc`` after it."""
    if dlogits.dtype == acc.dtype:
        return acc.addmm_(dlogits.t(), hidden)
    if not _FUSED_ADD_FAILED:
        try:
            return torch.addmm(acc, dlogits.t(), hidden, out_dtype=acc.dtype)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError) as exc:  # e.g. no such kernel on the CPU
            _FUSED_ADD_FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            log.info("the log-prob head adds its weight gradient after the product (%s)", _FUSED_ADD_FAILED[0])
    return acc.add_(dlogits.t() @ hidden)


def _chunks(total: int, rows: int):
    return [(start, min(start + rows, total)) for start in range(0, total, rows)]


def _own(x: torch.Tensor) -> torch.Tensor:
    """A chunk of a row-wise input (labels, their gradient) as a tensor of its own: the compiler
    guards on a view's base, whose rows would then be compared with the chunk's (a recompile)."""
    return x.clone()


def _stats(hidden, weight, bias, labels, rows: int, compiled: bool) -> torch.Tensor:
    """The forward over all chunks, no autograd (see the module docs)."""
    dtype = _compute_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        parts = [_run(fused_logit_stats, logit_stats, compiled, F.linear(hidden[s:e].to(dtype), w, b),
                      _own(labels[s:e])) for s, e in _chunks(hidden.shape[0], rows)]
    return torch.cat(parts) if parts else hidden.new_zeros((0, 2), dtype=torch.float32)


class _ChunkedHead(torch.autograd.Function):
    """:func:`_stats` with the backward of the module docs."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows: int, compiled: bool):
        ctx.dtype = _compute_dtype(hidden, weight)
        ctx.rows, ctx.compiled = rows, compiled
        ctx.save_for_backward(hidden, weight, bias, labels)
        return _stats(hidden, weight, bias, labels, rows, compiled)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        hidden, weight, bias, labels = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype, acc_dtype = ctx.dtype, torch.promote_types(ctx.dtype, torch.float32)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for s, e in _chunks(hidden.shape[0], ctx.rows):
                h = hidden[s:e].to(dtype)
                dlogits = _run(logit_grad, logit_grad, ctx.compiled, F.linear(h, w, b), _own(labels[s:e]),
                                _own(grad[s:e]))
                if need_hidden:
                    grad_hidden[s:e] = dlogits @ w
                if need_weight:
                    grad_weight = _accumulate(grad_weight, dlogits, h)
                if need_bias:
                    grad_bias += dlogits.sum(dim=0, dtype=acc_dtype)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None)


def chunked_head_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       labels: torch.Tensor, rows: int, compiled: bool = False) -> torch.Tensor:
    """``[n, 2]`` fp32 log-probs of ``labels`` ``[n]`` and entropies under ``hidden`` ``[n, H]``
    projected by ``weight`` ``[V, H]`` (and ``bias``), ``rows`` positions per chunk; with gradients
    where autograd needs them (see the module docs)."""
    tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _ChunkedHead.apply(hidden, weight, bias, labels, rows, compiled)
    return _stats(hidden, weight, bias, labels, rows, compiled)
