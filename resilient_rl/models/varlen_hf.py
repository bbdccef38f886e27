"""Packed attention (:mod:`resilient_rl.models.varlen`) in Hugging Face models.

The attention function registered with transformers' ``AttentionInterface`` under
:data:`HF_ATTENTION` (:func:`use_varlen_attention`). Where transformers would detect packed rows
(no attention mask, no cache, ``position_ids`` that restart) and its SDPA path would build the dense
block-diagonal mask, the model's mask function hands every layer the rows' layout instead; every
other call, an all-ones attention mask included, is the model's usual SDPA attention with its usual
mask.
"""

from __future__ import annotations

import contextvars
import inspect

import torch

from resilient_rl.models.precision import compute_dtype_on
from resilient_rl.models.packing import PackedLayout, given_layout_of, packed_layout
from resilient_rl.models.varlen import KernelPlan, plan_kernel, varlen_attention

__all__ = ["HF_ATTENTION", "use_varlen_attention"]

#: The name of the packed-aware attention function in transformers' ``AttentionInterface``.
HF_ATTENTION = "rrl_varlen"


class _PackedMask:
    """What :func:`_hf_mask` hands the attention layers of a packed call in place of a mask tensor:
    the rows' :class:`~resilient_rl.models.packing.PackedLayout`, read once per forward."""

    __slots__ = ("layout", "plan")

    def __init__(self, layout: PackedLayout, plan: KernelPlan | None = None):
        self.layout, self.plan = layout, plan

    def __repr__(self) -> str:
        return f"PackedMask(lengths={self.layout.lengths})"


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  **kwargs):
    """transformers' attention-function contract (outputs ``[B, T, heads, D]``, no weights)."""
    if isinstance(attention_mask, _PackedMask):
        out = varlen_attention(query, key, value, attention_mask.layout, scale=scaling, dropout=dropout,
                               window=sliding_window, plan=attention_mask.plan)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  sliding_window=sliding_window, **kwargs)


#: The position ids of the base-model forward in progress when its call is one transformers reads
#: as packed (no attention mask, no cache), else None; unset outside such a forward.
_POSITIONS: contextvars.ContextVar = contextvars.ContextVar("rrl_packed_positions")
#: The layout the caller found on the host for the packed base-model forward in progress, else None.
_HOST_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("rrl_given_packed_layout")


def _hf_mask(*, batch_size: int, attention_mask=None, q_length: int, kv_length: int, **kwargs):
    """transformers' mask-function contract. Where transformers would detect packed rows (no
    attention mask, no cache, position ids that restart), or the all-ones mask of packed rows
    whose layout was found on the host (:func:`_track_positions`), the rows' layout in a
    :class:`_PackedMask`; else (rows of one sequence each included) SDPA's own mask."""
    host = _HOST_LAYOUT.get(None)
    if host is not None and (batch_size, q_length, kv_length) == (host.batch, host.seq, host.seq):
        return _packed_mask(host, host.cu_seqlens.device, kwargs.get("dtype"))  # one sequence a row too
    positions = _POSITIONS.get(None)
    if attention_mask is None and positions is not None and q_length == kv_length == positions.shape[-1]:
        layout = packed_layout(positions.expand(batch_size, -1))
        if len(layout.lengths) > batch_size:  # else one sequence a row: SDPA's own causal attention
            return _packed_mask(layout, positions.device, kwargs.get("dtype"))
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size=batch_size, attention_mask=attention_mask, q_length=q_length, kv_length=kv_length,
                     **kwargs)


def _packed_mask(layout: PackedLayout, device: torch.device, dtype: torch.dtype | None) -> _PackedMask:
    """The :class:`_PackedMask` of packed rows of ``layout`` whose activations are in ``dtype``."""
    # The kernel of compiled blocks, decided here, outside them.
    return _PackedMask(layout, plan_kernel(layout, device, compute_dtype_on(device.type, dtype)))


def _track_positions(base: torch.nn.Module) -> None:
    """Hooks on ``base`` (the module that builds the masks) that expose a packed call's position
    ids to :func:`_hf_mask` for the length of its forward. Where the caller found their layout on
    the host (:func:`~resilient_rl.models.packing.given_layout`), they hand transformers an
    all-ones attention mask instead of none, so that its mask code skips its own packed-rows check
    (which reads the positions back from the device), and :func:`_hf_mask` that layout."""
    signature = inspect.signature(base.forward)
    mask_at = list(signature.parameters).index("attention_mask") if "attention_mask" in signature.parameters \
        else None
    tokens: list = []

    # A compiled forward (the rollout engine's decode step) skips both hooks: they would break its
    # graph, and its masks then come from transformers as they would without them.
    def before(module, args, kwargs):
        if torch.compiler.is_compiling():
            return
        bound = signature.bind_partial(*args, **kwargs).arguments
        cached = bound.get("cache") is not None or bound.get("past_key_values") is not None
        use_cache = bound.get("use_cache")
        use_cache = getattr(module.config, "use_cache", False) if use_cache is None else use_cache
        packed = bound.get("attention_mask") is None and not cached and not use_cache
        positions = bound.get("position_ids") if packed else None
        layout = given_layout_of(positions) if positions is not None and mask_at is not None else None
        tokens.append((_POSITIONS.set(positions), _HOST_LAYOUT.set(layout)))
        if layout is None:
            return None
        ones = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        if mask_at < len(args):
            return (*args[:mask_at], ones, *args[mask_at + 1:]), kwargs
        return args, {**kwargs, "attention_mask": ones}

    def after(module, args, kwargs, output):
        if tokens and not torch.compiler.is_compiling():
            positions, given = tokens.pop()
            _HOST_LAYOUT.reset(given)
            _POSITIONS.reset(positions)

    base.register_forward_pre_hook(before, with_kwargs=True)
    base.register_forward_hook(after, with_kwargs=True, always_call=True)


def use_varlen_attention(model) -> None:
    """Switch the Hugging Face ``model`` from SDPA attention to :data:`HF_ATTENTION`, which is the
    same for every call but a packed one (see the module docs). Models set to another attention
    implementation keep it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, _hf_mask)
    _track_positions(getattr(model, "base_model", model))
    model.config._attn_implementation = HF_ATTENTION
