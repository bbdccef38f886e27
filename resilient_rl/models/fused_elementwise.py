"""The elementwise work between a trained block's matrix products, compiled into fused kernels.

Eagerly, a Hugging Face RMS norm is six operators forward (``pow``, ``mean``, ``add``, ``rsqrt``
and two ``mul``; on fp32 input each ``mul`` writes a tensor of the residual stream) and about as
many backward, each a kernel that reads and writes the whole micro-batch, and autograd keeps their
intermediates for the backward. The SwiGLU of a block's MLP (``silu(gate) * up``) is two
operators forward and three backward, and keeps ``silu(gate)`` beside ``gate`` and ``up``. The
rotary embedding of query and key (``x * cos + rotate_half(x) * sin``) is five operators on each
forward (``neg``, ``cat``, two ``mul``, ``add``) and more backward (``rotate_half``'s slices come
back as zero-filled tensors that are added). In an update of the 1.5 B shape the norms' writes
alone were about half of the activation bytes written outside the products, the rotary embedding's
about a tenth (docs/performance.md). :func:`compile_elementwise` replaces the forward of each RMS
norm and MLP of the Llama family (Llama, Qwen2, Mistral, Qwen3) with the same arithmetic in one
compiled function each, and has its attention modules apply the rotary embedding through one (see
:func:`_install_rotary`), with the token count a symbol: inductor makes one kernel of a norm's
forward (its output already in the dtype the replica hands on, :mod:`.precision`) and one or two of
its backward, one of the SwiGLU and of the rotary embedding each way, and keeps only their inputs
for the backward (the rotary embedding ``cos`` and ``sin`` with one half negated, as small).

The values are the eager module's within float rounding (the reductions' order may differ).
``actor.compile_elementwise`` (the actor and the ref) and ``critic.compile_elementwise`` turn it on;
null: on a GPU. A process compiles at most a few graphs per function (with and without autograd;
fp32 or half-precision input), each once: the token count of a micro-batch is a symbol. A compiler
failure at a graph's first call leaves the process eager from then on, with one warning (the
values are as correct) and the updates' ``perf/actor_elementwise_eager`` and
``perf/critic_elementwise_eager`` metrics at 1.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from resilient_rl.models.compile_fallback import allow_recompiles, compiled_or_eager
from resilient_rl.models.fused_projections import MLP

__all__ = ["ELEMENTWISE_FAILURE", "NORMS", "ROTARY_ATTENTION", "compile_elementwise", "compiles_elementwise",
           "rms_norm", "rotary", "silu_mul"]

log = logging.getLogger(__name__)

#: RMS norm classes whose forward is :func:`rms_norm` (``weight * (x * rsqrt(mean(x^2) + eps))``,
#: computed in fp32 and cast back to the input's dtype before the weight).
NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm"})
#: Attention classes whose forward applies its modeling module's ``apply_rotary_pos_emb(q, k, cos, sin)``.
ROTARY_ATTENTION = frozenset({"LlamaAttention", "Qwen2Attention", "MistralAttention", "Qwen3Attention"})
#: Why this process's elementwise functions stopped compiling (None while they compile).
ELEMENTWISE_FAILURE: dict[str, str | None] = {"reason": None}


def compiles_elementwise(setting: bool | None, device: torch.device | str, blocks: bool = False) -> bool:
    """Whether a role's norms, rotary embedding and SwiGLU run compiled: ``setting``
    (``<role>.compile_elementwise``), or, when None, on CUDA; never where ``blocks``
    (``<role>.compile``) compiles the blocks that hold them."""
    return not blocks and (torch.device(device).type == "cuda" if setting is None else bool(setting))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """A Hugging Face RMS norm of the Llama family (the arithmetic of its ``forward``), in ``out_dtype``."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(out_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU of a Llama-family MLP: ``silu(gate) * up``."""
    return F.silu(gate) * up


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Hugging Face rotary embedding of the Llama family (``apply_rotary_pos_emb``: ``x * cos +
    rotate_half(x) * sin``, ``rotate_half(x) = (-x2, x1)``) of query and key ``[tokens, heads,
    head_dim]``, with ``cos`` and ``sin`` ``[tokens, 1, head_dim]``. ``rotate_half(x) * sin`` is
    computed as the halves of ``x`` swapped (a flip of a size-2 dimension) times ``(-sin1, sin2)``:
    compiled, an index computation each way on query and key, where concatenated slices of them are
    a masked load per half, and a backward of zero-filled slices added."""
    half = q.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * cos + x.unflatten(-1, (2, half)).flip(-2).flatten(-2) * signed

    return rotate(q), rotate(k)


#: Versions of each function the compiler keeps: with and without autograd, autocast on and off,
#: weights that do and do not require gradients (the actor's, the ref's), a second model's widths.
VERSIONS = 16


@functools.cache
def _compiled(fn):
    # Sizes other than the tokens' (marked where called) are constants of a graph, for which the
    # kernels are laid out: on a GPU inductor reduces a norm's row in one pass (a "persistent"
    # reduction) only where the hidden size is known to be at most 1,024 (0.5 B's 896, not 1.5 B's).
    allow_recompiles(VERSIONS)
    return torch.compile(fn, dynamic=None)


def _run(fn, *args):
    """``fn(*args)`` compiled; after a compiler failure eagerly for the rest of the process, with
    one warning (:func:`~resilient_rl.models.compile_fallback.compiled_or_eager`)."""
    return compiled_or_eager(ELEMENTWISE_FAILURE, log, "the compiled norms, rotary embedding and SwiGLU",
                             "<role>.compile_elementwise", _compiled(fn), fn, *args)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # The eager module's result dtype, or autocast's where that is narrower: the dtype the
    # replica's norms hand on in (:func:`~resilient_rl.models.precision.hand_on_in_autocast_dtype`).
    out = torch.promote_types(self.weight.dtype, hidden_states.dtype)
    kind = hidden_states.device.type
    if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind).itemsize < out.itemsize:
        out = torch.get_autocast_dtype(kind)
    _token_dims_any_size(hidden_states)
    return _run(rms_norm, hidden_states, self.weight, float(self.variance_epsilon), out)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    _token_dims_any_size(gate)
    _token_dims_any_size(up)
    return self.down_proj(_run(silu_mul, gate, up))


#: True inside the forward of an attention module whose rotary embedding runs compiled.
_COMPILED_ROTARY = contextvars.ContextVar("resilient_rl_compiled_rotary", default=False)


def _attention_forward(self, *args, **kwargs):
    token = _COMPILED_ROTARY.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _COMPILED_ROTARY.reset(token)


def _install_rotary(module_name: str) -> bool:
    """Have the modeling module ``module_name``'s ``apply_rotary_pos_emb``, which its attention
    forward calls by that global name, run :func:`rotary` compiled inside the forward of an
    attention module that :func:`compile_elementwise` replaced, and the module's own function
    anywhere else: in other models' attention (a rollout model of the same class in the process),
    and where a compiler traces it (the rollout engine's decode step, compiled blocks), which then
    fuses it with the rest. Whether the module has one to replace (installed once per process)."""
    module = sys.modules.get(module_name)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if getattr(original, "rrl_original", None) is not None:
        return True

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if torch.compiler.is_compiling() or not _COMPILED_ROTARY.get() or not _rotary_shapes(q, k, cos, sin,
                                                                                                unsqueeze_dim):
            return original(q, k, cos, sin, unsqueeze_dim)
        return _compiled_rotary(q, k, cos, sin)

    apply_rotary_pos_emb.rrl_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def _rotary_shapes(q, k, cos, sin, unsqueeze_dim) -> bool:
    """Whether the call has the shapes the Llama family's attention passes: query and key
    ``[rows, heads, tokens, head_dim]``, ``cos`` and ``sin`` ``[rows or 1, tokens, head_dim]``."""
    return (unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
            and q.shape[0] == k.shape[0] and cos.shape[0] in (1, q.shape[0])
            and q.shape[2:] == k.shape[2:] == cos.shape[1:])


def _compiled_rotary(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary` compiled on query and key ``[rows, heads, tokens, head_dim]``: rows and tokens
    become one dimension of ``rows * tokens`` (a view where the projection laid them out so, as it
    does), the graph's only symbol; the results are handed back in the layout the module's own
    function gives."""
    rows, _, tokens, dim = q.shape
    n = rows * tokens
    flat = [t.transpose(1, 2).reshape(n, t.shape[1], dim) for t in (q, k)]
    flat += [t.expand(rows, tokens, dim).reshape(n, 1, dim) for t in (cos, sin)]
    for t in flat:
        torch._dynamo.decorators.mark_unbacked(t, 0)
    q_out, k_out = _run(rotary, *flat)
    return (q_out.view(rows, tokens, -1, dim).transpose(1, 2), k_out.view(rows, tokens, -1, dim).transpose(1, 2))


def _token_dims_any_size(t: torch.Tensor) -> None:
    """Compile ``t``'s leading (row and token) dims as sizes not known to the graph: the compiler
    would otherwise specialise a size of 1, and a packed micro-batch is one row where a padded one
    has several, which would be two graphs."""
    for dim in range(t.dim() - 1):
        torch._dynamo.decorators.mark_unbacked(t, dim)


def _silu(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return type(act).__name__ in ("SiLU", "SiLUActivation") or act is F.silu


def compile_elementwise(model: nn.Module) -> int:
    """Replace the forward of ``model``'s RMS norms (:data:`NORMS`) and of its MLPs whose
    activation is SiLU with their compiled arithmetic, and have its attention modules
    (:data:`ROTARY_ATTENTION`) apply the rotary embedding compiled (see the module docs); hooks on
    those modules still run. How many modules were replaced."""
    replaced = 0
    for module in model.modules():
        name = type(module).__name__
        if name in NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)
        elif name in MLP and _silu(module):
            module.forward = types.MethodType(_mlp_forward, module)
        elif name in ROTARY_ATTENTION and _install_rotary(type(module).__module__):
            module.forward = types.MethodType(_attention_forward, module)
        else:
            continue
        replaced += 1
    return replaced
