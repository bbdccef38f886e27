"""The chunked log-prob head: the chosen token's log-prob and the entropy of ``hidden @ weight.T``
(+ ``bias``), ``rows`` positions at a time, never more than one chunk of logits at once.

:func:`chunked_head_stats` projects each chunk and reduces it at once to ``[rows, 2]`` (fp32). With
gradients it is one autograd function over all chunks (:class:`_ChunkedHead`): its forward keeps
no logits (but where one chunk holds them all), and its backward recomputes each chunk's logits,
takes their gradient in closed form (:func:`logit_grad`: one pass over the logits, the rows'
log-sum-exp and mean logit recovered from the forward's log-prob and entropy and the chosen logit)
and from it the chunk's share of the hidden states' gradient and of the weight's. In mixed
precision:

- the weight is cast to the compute dtype (autocast's, else its own) once per forward and once per
  backward, not once per chunk: under autocast, a per-chunk ``F.linear`` with its own recomputation
  cast the fp32 weight again for every chunk of the backward (the tied 151,936 x 1,536 head of
  Qwen2.5-1.5B: 0.9 GB of fp32 read and 0.5 GB of bf16 written each time, about 80 chunks a
  1.5 B update);
- the chunks' weight gradients are summed in fp32 into one buffer (where the device has them,
  ``mm`` and ``addmm`` with ``out_dtype`` write the first product and add each later one in fp32
  themselves), and autograd receives one gradient for the weight per pass in the weight's dtype.
  Per-chunk gradients instead each reached the fp32 weight through the cast's backward: a bf16
  gradient, its fp32 copy and an fp32 add of the whole weight, for every chunk;
- the hidden states' gradient is written chunk by chunk into one tensor of their dtype;
- eagerly, a chunk's gradient keeps at most three fp32 ``[rows, vocab]`` tensors alive beside its
  logits (the memory plan's chunk term: :mod:`resilient_rl.workers.memory_plan`), and no chunk's
  logits or gradient outlive it.

The closed form, with ``p = softmax(z)`` and ``E[z] = sum(p * z)`` over the vocabulary:
``d log p[y] / dz = onehot(y) - p`` and ``d entropy / dz = -p * (z - E[z])``; the forward gave
``log p[y] = z[y] - lse`` and ``entropy = lse - E[z]``. The values equal autograd's through
:func:`logit_stats` within float rounding (tests/test_chunked_logprob.py).

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
from resilient_rl.models.compile_fallback import compiled_or_eager
from resilient_rl.models.precision import compute_dtype

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
    # The softmax's mean of z, with the softmax computed where it is read: nothing vocabulary-wide is written.
    return torch.stack([picked - lse, lse - (torch.exp(z - lse[:, None]) * z).sum(dim=-1)], dim=-1)


def logit_grad(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor,
               mean: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`logit_stats` with respect to ``logits`` ``[n, V]``, given ``grad``
    ``[n, 2]`` (of the log-prob and of the entropy) and the rows' ``lse`` (log-sum-exp of the
    logits) and ``mean`` (the mean logit under the softmax), in ``logits``' dtype, computed in fp32
    (at least): ``g_lp * (onehot - p) - g_ent * p * (logits - mean)``, ``p = exp(logits - lse)``.
    One pass over the logits: the rows' reductions come from the forward's values (:func:`_row_terms`)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    g = grad.to(x.dtype)
    g_lp, g_ent = g[:, :1], g[:, 1:]
    # In place and freed as soon as read, so that eagerly at most three fp32 [n, V] tensors live
    # at once (the memory plan's chunk term); compiled, all of it is one pass.
    p = (x - lse[:, None]).exp_()
    d = x - mean[:, None]
    del x
    d.mul_(g_ent).add_(g_lp).mul_(p)
    del p
    ids = torch.arange(d.shape[-1], device=d.device)
    return d.neg_().add_(torch.where(ids == labels[:, None], g_lp, 0.0)).to(logits.dtype)


def _row_terms(logits: torch.Tensor, labels: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lse`` and ``mean`` of :func:`logit_grad` from the forward's ``stats`` (log-prob, entropy)
    and the chosen logits: ``log p[y] = logit[y] - lse`` and ``entropy = lse - mean``."""
    picked = logits.gather(-1, labels[:, None]).squeeze(-1).to(stats.dtype)
    lse = picked - stats[:, 0]
    return lse, lse - stats[:, 1]


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _run(fn, eager, compiled: bool, *args) -> torch.Tensor:
    """``fn(*args)`` compiled when ``compiled``; after a compiler failure ``eager(*args)`` for the
    rest of the process, with one warning (:func:`~resilient_rl.models.compile_fallback.compiled_or_eager`)."""
    if not compiled:
        return eager(*args)
    return compiled_or_eager(HEAD_FAILURE, log, "the log-prob head's compiled reductions", "actor.compile_head",
                             _compiled(fn), eager, *args)


def _accumulate(acc: torch.Tensor | None, dlogits: torch.Tensor, hidden: torch.Tensor,
                acc_dtype: torch.dtype) -> torch.Tensor:
    """``acc + dlogits.T @ hidden`` (``acc`` None: the product alone) in ``acc_dtype``, fp32 or wider.
    Where the inputs are narrower, ``mm``/``addmm`` with ``out_dtype`` compute and add in fp32 in
    the product's epilogue (CUDA has them); where that fails (the CPU, or a torch without it), once
    per process, the narrower product is widened and added after it."""
    if dlogits.dtype == acc_dtype:
        return dlogits.t() @ hidden if acc is None else acc.addmm_(dlogits.t(), hidden)
    if not _FUSED_ADD_FAILED:
        try:
            if acc is None:
                return torch.mm(dlogits.t(), hidden, out_dtype=acc_dtype)
            return torch.addmm(acc, dlogits.t(), hidden, out_dtype=acc_dtype)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError) as exc:  # e.g. no such kernel on the CPU
            _FUSED_ADD_FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            log.info("the log-prob head adds its weight gradient after the product (%s)", _FUSED_ADD_FAILED[0])
    product = dlogits.t() @ hidden
    return product.to(acc_dtype) if acc is None else acc.add_(product)


def _chunks(total: int, rows: int):
    return [(start, min(start + rows, total)) for start in range(0, total, rows)]


def _own(x: torch.Tensor) -> torch.Tensor:
    """A chunk of a row-wise input (labels, their gradient) as a tensor of its own: the compiler
    guards on a view's base, whose rows would then be compared with the chunk's (a recompile)."""
    return x.clone()


def _stats(hidden, weight, bias, labels, rows: int, compiled: bool, kept: list | None = None) -> torch.Tensor:
    """The forward over all chunks, no autograd (see the module docs). ``kept``: receives the
    logits where they are one chunk, so that a backward need not project them again."""
    dtype = compute_dtype(weight)
    spans = _chunks(hidden.shape[0], rows)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        parts = []
        for s, e in spans:
            logits = F.linear(hidden[s:e].to(dtype), w, b)
            parts.append(_run(fused_logit_stats, logit_stats, compiled, logits, _own(labels[s:e])))
            if kept is not None and len(spans) == 1:
                kept.append(logits)
            del logits  # not alive beside the next chunk's
    return torch.cat(parts) if parts else hidden.new_zeros((0, 2), dtype=torch.float32)


class _ChunkedHead(torch.autograd.Function):
    """:func:`_stats` with the backward of the module docs."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows: int, compiled: bool):
        ctx.dtype = compute_dtype(weight)
        ctx.rows, ctx.compiled = rows, compiled
        kept: list[torch.Tensor] = []
        out = _stats(hidden, weight, bias, labels, rows, compiled, kept)
        ctx.save_for_backward(hidden, weight, bias, labels, out, *kept)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        hidden, weight, bias, labels, out, *kept = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype, acc_dtype = ctx.dtype, torch.promote_types(ctx.dtype, torch.float32)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None  # the first chunk's product, then the sum
        grad_bias = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for s, e in _chunks(hidden.shape[0], ctx.rows):
                h = hidden[s:e].to(dtype)
                logits = kept[0] if kept else F.linear(h, w, b)
                chunk_labels = _own(labels[s:e])
                lse, mean = _row_terms(logits, chunk_labels, out[s:e])
                dlogits = _run(logit_grad, logit_grad, ctx.compiled, logits, chunk_labels, _own(grad[s:e]), lse, mean)
                del logits
                if need_hidden:
                    grad_hidden[s:e] = dlogits @ w
                if need_weight:
                    grad_weight = _accumulate(grad_weight, dlogits, h, acc_dtype)
                if need_bias:
                    grad_bias += dlogits.sum(dim=0, dtype=acc_dtype)
                del dlogits  # not alive beside the next chunk's logits
        if need_weight and grad_weight is None:  # no rows
            grad_weight = torch.zeros_like(weight)
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
