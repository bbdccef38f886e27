"""The dtype an operator computes a tensor in under autocast, and activations handed on in it.

A replica (one rank, or no FSDP) keeps fp32 weights and computes under bf16 autocast. Its residual
stream stays fp32, and so do the outputs of a Hugging Face model's RMS norms and rotary embedding,
though every consumer of the norms' outputs is a matrix product that casts its input to bf16 (each
of them casting it again: five casts a layer for q, k, v, gate and up), and the rotary embedding's
fp32 ``cos``/``sin`` turn the bf16 query and key into fp32 tensors for the whole rotary arithmetic
(which the attention then casts back). :func:`hand_on_in_autocast_dtype` makes those outputs
autocast's dtype where they are made, as FSDP2's mixed precision has them: the products compute on
the same bf16 values, the rotary arithmetic and what it saves for the backward are half as wide,
and the casts happen once. In one update of the trainer's engine at the 1.5 B layer shape, the
activation bytes written outside the products fell from 1,017 KB to 889 KB a token
(``python bench/activation_bytes.py``; docs/performance.md).

A model that computes in bf16 without autocast (the rollout's) has its parameters cast by
:func:`cast_parameters`, not ``model.to(dtype)``, which casts the buffers too: a Hugging Face
model's rotary frequencies (``inv_freq``) rounded to bf16 turn each position by an angle that grows
with it (up to 0.9 rad by position 776 at Qwen2.5-1.5B's shape), so the rollout would sample from
other positional encodings than the actor and the ref score its tokens with.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["cast_parameters", "compute_dtype", "hand_on_in_autocast_dtype"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matrix product or attention computes floating-point ``x`` in: autocast's where
    it is on for ``x``'s device, else ``x``'s own. Under autocast over fp32 weights a Hugging Face
    model's query and key come out of the rotary embedding in fp32 (the half-precision projection
    times fp32 ``cos``/``sin``) unless :func:`hand_on_in_autocast_dtype` hooks the model, and the
    head's weight stays fp32, though both compute in bf16."""
    return compute_dtype_on(x.device.type, x.dtype)


def compute_dtype_on(kind: str, dtype: torch.dtype | None) -> torch.dtype | None:
    """:func:`compute_dtype` of inputs in ``dtype`` (None: not known) on device type ``kind``."""
    if (dtype is None or dtype.is_floating_point) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return dtype


def _in_autocast_dtype(module: nn.Module, args, output):
    """A forward hook: ``output`` (a tensor or a tuple of them) in autocast's dtype where autocast
    is on for its device and it is wider; else unchanged."""
    outputs = output if isinstance(output, tuple) else (output,)
    first = outputs[0]
    if not isinstance(first, torch.Tensor) or not torch.is_autocast_enabled(first.device.type):
        return output
    dtype = torch.get_autocast_dtype(first.device.type)
    cast = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.element_size() > dtype.itemsize else t for t in outputs)
    return cast if isinstance(output, tuple) else cast[0]


def hand_on_in_autocast_dtype(model: nn.Module) -> int:
    """Hook ``model``'s RMS norms and rotary embeddings (by class name: ``...RMSNorm``,
    ``...RotaryEmbedding``) so that, under autocast, their outputs leave in autocast's dtype (see
    the module docs); outside autocast nothing changes. How many modules were hooked."""
    hooked = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") or name.endswith("RotaryEmbedding"):
            module.register_forward_hook(_in_autocast_dtype)
            hooked += 1
    return hooked


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its floating-point parameters in ``dtype``, in place; buffers keep their dtype
    (see the module docs). A parameter stays the same object, so tied weights stay tied."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    return model
