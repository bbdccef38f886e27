"""One matrix product where a rollout model's layer makes several from the same input.

A decoder layer of the Llama family (Llama, Qwen2, Mistral) projects its input three times for
attention (query, key, value) and twice for the MLP (gate, up). At the batch of a decode step each
of these is a small product, and the step is a few hundred small kernels: fewer, larger products
take less of it (inference engines fuse them the same way). :func:`fuse_projections` gives each
such module one weight (and bias) holding the projections end to end, and makes the projections'
own parameters views into it. The module then computes one product and splits its output:

- the MLP always: ``down(act(gate) * up)`` from one product (the same arithmetic);
- the attention in the rollout engine's calls (they carry the engine's step,
  :mod:`resilient_rl.models.cache_attention`): one product for query, key and value, then the
  model's own rotary embedding and attention function, as the model's forward does. Any other call
  (Hugging Face ``generate`` with its cache, say) runs the model's own forward, on the same weights.

The parameters keep their names, shapes and dtypes, so weight syncs and checkpoints see the model
as before, and a sync's in-place copies write the fused weight through the views. Something that
replaced a parameter's storage would cut it off from the fused weight: :func:`refuse` (run before
each generation) finds that by data pointer and fuses again.

Only modules of the classes in :data:`ATTENTION` and :data:`MLP` are fused, whose forwards this
module reproduces; any other model is left as it is.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ATTENTION", "MLP", "fuse_projections", "fused_modules", "refuse"]

#: Attention classes whose forward :class:`_FusedAttention` reproduces (projections, rotary
#: embedding, the attention function, the output projection).
ATTENTION = frozenset({"LlamaAttention", "Qwen2Attention", "MistralAttention"})
#: MLP classes computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.
MLP = frozenset({"LlamaMLP", "Qwen2MLP", "MistralMLP", "Qwen3MLP"})

#: The projections fused per kind of module.
_GROUPS = {"attention": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
_FUSED = "_rrl_fused"


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    """The projections ``names`` of ``module`` when they can be fused: plain linear maps of one
    input width, dtype and device, all with a bias or none."""
    linears = [getattr(module, name, None) for name in names]
    if not all(type(lin) is nn.Linear for lin in linears):
        return None
    first = linears[0]
    same = all(lin.in_features == first.in_features and lin.weight.dtype == first.weight.dtype
               and lin.weight.device == first.weight.device and (lin.bias is None) == (first.bias is None)
               for lin in linears)
    return linears if same else None


def _kind(module: nn.Module) -> str | None:
    """``attention``, ``mlp`` or None, by the model's own class (a fused class names it)."""
    name = getattr(type(module), "_rrl_base", (None, type(module).__name__))[1]
    return "attention" if name in ATTENTION else "mlp" if name in MLP else None


def _fuse(module: nn.Module, kind: str, copy: bool = True) -> bool:
    """Give ``module`` its fused weight (and bias), the projections' parameters views into it;
    ``copy``: holding the projections' values (else allocated only)."""
    linears = _linears(module, _GROUPS[kind])
    if linears is None:
        return False
    with torch.no_grad():
        weight = _joined([lin.weight for lin in linears], copy)
        bias = None if linears[0].bias is None else _joined([lin.bias for lin in linears], copy)
    sizes = [lin.out_features for lin in linears]
    start = 0
    for lin, size in zip(linears, sizes):
        # The same parameter objects, now viewing the fused weight: whatever holds them (the
        # colocated actor's sink pairs its parameters with them once) writes into it.
        lin.weight.data = weight[start:start + size]
        if bias is not None:
            lin.bias.data = bias[start:start + size]
        start += size
    # Buffers (not saved with the model's state): the graph of a compiled step takes them as inputs.
    module.register_buffer("rrl_fused_weight", weight, persistent=False)
    module.register_buffer("rrl_fused_bias", bias, persistent=False)
    setattr(module, _FUSED, sizes)
    module.__class__ = _fused_class(type(module))
    return True


def _joined(tensors: list[torch.Tensor], copy: bool) -> torch.Tensor:
    """``tensors`` end to end along their first dimension: copied, or a new uninitialised tensor
    of that shape."""
    if copy:
        return torch.cat(tensors)
    first = tensors[0]
    return torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), dtype=first.dtype, device=first.device)


def fuse_projections(model: nn.Module, copy: bool = True) -> int:
    """Fuse the projections of every module of ``model`` of a known class (see the module docs);
    how many modules were fused. Call it after the model has its final device and dtype (a
    ``.to`` that copies the parameters cuts the views; :func:`refuse` then repairs them).
    ``copy=False``: the fused weights are allocated, not copied from the projections', for a model
    built empty whose weights the next sync writes (a copy would read memory never written)."""
    return sum(_fuse(module, kind, copy) for module in model.modules()
               if (kind := _kind(module)) is not None and not hasattr(module, _FUSED))


def fused_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if hasattr(module, _FUSED)]


def refuse(model: nn.Module) -> int:
    """Fuse again every fused module whose projections no longer view its fused weight (a
    parameter was replaced, or the model copied to another device or dtype); how many. A data
    pointer per projection, no device work where nothing changed."""
    again = 0
    for module in fused_modules(model):
        kind = _kind(module)
        linears = _linears(module, _GROUPS[kind])
        weight, bias = module.rrl_fused_weight, module.rrl_fused_bias
        starts = [0]
        for size in getattr(module, _FUSED):
            starts.append(starts[-1] + size)
        intact = linears is not None and all(
            lin.weight.data_ptr() == weight[s:s + 1].data_ptr() and lin.weight.dtype == weight.dtype
            and (bias is None or lin.bias.data_ptr() == bias[s:s + 1].data_ptr())
            for lin, s in zip(linears, starts))
        if not intact:
            _unfuse(module)
            again += _fuse(module, kind)
    return again


def _unfuse(module: nn.Module) -> None:
    """``module`` as it was before :func:`_fuse`: its own class and forward, no fused weight."""
    module.__class__ = type(module)._rrl_cls
    for name in ("rrl_fused_weight", "rrl_fused_bias", _FUSED):
        delattr(module, name)


class _FusedMLP:
    """The forward of a fused MLP (the first base of its fused class, before the model's own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.rrl_fused_weight, self.rrl_fused_bias).split(getattr(self, _FUSED), dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class _FusedAttention:
    """The forward of a fused attention (the first base of its fused class, before the model's own)."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        """The model's attention forward with query, key and value from one product, for the
        engine's calls; any other call runs the model's own forward."""
        if kwargs.get("rrl_engine_step") is None:
            return super().forward(hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, **kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        product = F.linear(hidden_states, self.rrl_fused_weight, self.rrl_fused_bias)
        q, k, v = (t.view(shape).transpose(1, 2) for t in product.split(getattr(self, _FUSED), -1))
        cos, sin = position_embeddings
        q, k = sys.modules[self._rrl_base[0]].apply_rotary_pos_emb(q, k, cos, sin)
        attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                 sliding_window=getattr(self, "sliding_window", None), **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


_PREFIX = "Fused_"


def _fused_class(cls: type) -> type:
    """The fused class of the model's class ``cls``: this module's forward first, then ``cls``.
    Named in this module (``Fused_<module path>__<class>``), so that a compiled step kept for
    another process refers to it by name (:func:`__getattr__` makes it there on first use)."""
    name = _PREFIX + cls.__module__.replace(".", "_") + "__" + cls.__name__
    if name not in globals():
        mixin = _FusedAttention if cls.__name__ in ATTENTION else _FusedMLP
        fused = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name, "_rrl_cls": cls,
                                          "_rrl_base": (cls.__module__, cls.__name__)})
        globals()[name] = fused
    return globals()[name]


def __getattr__(name: str):
    """A fused class by its name (:func:`_fused_class`), made on first use in a new process."""
    if name.startswith(_PREFIX) and "__" in name[len(_PREFIX):]:
        path, cls_name = name[len(_PREFIX):].rsplit("__", 1)
        for module_name, module in list(sys.modules.items()):
            if module_name.replace(".", "_") == path and isinstance(getattr(module, cls_name, None), type):
                return _fused_class(getattr(module, cls_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
