"""The elementwise work between a trained block's matrix products, compiled into fused kernels.

Eagerly, a Hugging Face RMS norm is six operators forward (``pow``, ``mean``, ``add``, ``rsqrt``
and two ``mul``; on fp32 input each ``mul`` writes a tensor of the residual stream) and about as
many backward, each a kernel that reads and writes the whole micro-batch, and autograd keeps their
intermediates for the backward. The SwiGLU of a block's MLP (``silu(gate) * up``) is two
operators forward and three backward, and keeps ``silu(gate)`` beside ``gate`` and ``up``. In an
update of the 1.5 B shape the norms' writes alone were about half of the activation bytes written
outside the products (docs/performance.md). :func:`compile_elementwise` replaces the forward of
each RMS norm and MLP of the Llama family (Llama, Qwen2, Mistral, Qwen3) with the same arithmetic
in one compiled function each, with every size a symbol: inductor makes one kernel of a norm's
forward (its output already in the dtype the replica hands on, :mod:`.precision`) and one or two of
its backward, one of the SwiGLU each way, and keeps only the inputs for the backward.

The values are the eager module's within float rounding (the reductions' order may differ).
``actor.compile_elementwise`` (the actor and the ref) and ``critic.compile_elementwise`` turn it on;
null: on a GPU. A process compiles at most a few graphs per function (with and without autograd;
fp32 or half-precision input), each once: the token count of a micro-batch is a symbol. A compiler
failure at a graph's first call leaves the process eager from then on, with one warning (the
values are as correct) and the updates' ``perf/actor_elementwise_eager`` and
``perf/critic_elementwise_eager`` metrics at 1.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
import torch.nn.functional as F
from torch import nn

from resilient_rl.models.compile_fallback import compiled_or_eager
from resilient_rl.models.fused_projections import MLP

__all__ = ["ELEMENTWISE_FAILURE", "NORMS", "compile_elementwise", "compiles_elementwise", "rms_norm", "silu_mul"]

log = logging.getLogger(__name__)

#: RMS norm classes whose forward is :func:`rms_norm` (``weight * (x * rsqrt(mean(x^2) + eps))``,
#: computed in fp32 and cast back to the input's dtype before the weight).
NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm"})
#: Why this process's elementwise functions stopped compiling (None while they compile).
ELEMENTWISE_FAILURE: dict[str, str | None] = {"reason": None}


def compiles_elementwise(setting: bool | None, device: torch.device | str, blocks: bool = False) -> bool:
    """Whether a role's norms and SwiGLU run compiled: ``setting`` (``<role>.compile_elementwise``),
    or, when None, on CUDA; never where ``blocks`` (``<role>.compile``) compiles the blocks that
    hold them."""
    return not blocks and (torch.device(device).type == "cuda" if setting is None else bool(setting))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """A Hugging Face RMS norm of the Llama family (the arithmetic of its ``forward``), in ``out_dtype``."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(out_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU of a Llama-family MLP: ``silu(gate) * up``."""
    return F.silu(gate) * up


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _run(fn, *args) -> torch.Tensor:
    """``fn(*args)`` compiled; after a compiler failure eagerly for the rest of the process, with
    one warning (:func:`~resilient_rl.models.compile_fallback.compiled_or_eager`)."""
    for a in args[:2]:
        _token_dims_any_size(a)
    return compiled_or_eager(ELEMENTWISE_FAILURE, log, "the compiled norms and SwiGLU", "<role>.compile_elementwise",
                             _compiled(fn), fn, *args)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # The eager module's result dtype, or autocast's where that is narrower: the dtype the
    # replica's norms hand on in (:func:`~resilient_rl.models.precision.hand_on_in_autocast_dtype`).
    out = torch.promote_types(self.weight.dtype, hidden_states.dtype)
    kind = hidden_states.device.type
    if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind).itemsize < out.itemsize:
        out = torch.get_autocast_dtype(kind)
    return _run(rms_norm, hidden_states, self.weight, float(self.variance_epsilon), out)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_run(silu_mul, self.gate_proj(x), self.up_proj(x)))


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
    activation is SiLU with their compiled arithmetic (see the module docs); hooks on those modules
    still run. How many modules were replaced."""
    replaced = 0
    for module in model.modules():
        name = type(module).__name__
        if name in NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)
        elif name in MLP and _silu(module):
            module.forward = types.MethodType(_mlp_forward, module)
        else:
            continue
        replaced += 1
    return replaced
