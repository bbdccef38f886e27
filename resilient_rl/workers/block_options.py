"""Per-block options of a trained model: activation checkpointing and ``torch.compile``.

Both are applied to each transformer block (:func:`~resilient_rl.models.factory.transformer_blocks`)
before FSDP2 wraps it, in place: a block keeps its class and its parameter names, so checkpoints,
weight sync and the rollout's copy see the same model with or without them.

- Activation checkpointing runs the block's forward under ``torch.utils.checkpoint``
  (non-reentrant): only the block's inputs are kept for the backward pass, which recomputes the
  rest. It applies only when gradients are enabled, so log-prob passes run as before.
- Compilation uses ``nn.Module.compile`` per block (as torchtitan does): the blocks share one
  compiled graph, and the output layer, which the chunked log-prob head replaces per call
  (:mod:`resilient_rl.workers.logprob`), stays outside it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from resilient_rl.models.factory import transformer_blocks
from resilient_rl.models.varlen import outside_graph

__all__ = ["apply_block_options", "checkpointed_blocks"]


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.__rrl_checkpointed__ = True  # type: ignore[attr-defined]
    return run


def checkpointed_blocks(model: nn.Module) -> int:
    """How many of ``model``'s blocks run under activation checkpointing."""
    return sum(bool(getattr(b.__dict__.get("forward"), "__rrl_checkpointed__", False))
               for b in transformer_blocks(model))


def apply_block_options(model: nn.Module, activation_checkpointing: bool = False, compile: bool = False) -> nn.Module:
    """Apply the options to every block of ``model`` in place; returns ``model``."""
    if not (activation_checkpointing or compile):
        return model
    if compile:
        outside_graph()  # the packed attention the compiled blocks call where no varlen kernel serves
    for block in transformer_blocks(model):
        if activation_checkpointing and not getattr(block.__dict__.get("forward"), "__rrl_checkpointed__", False):
            block.forward = _checkpointed(block.forward)
        if compile:
            # dynamic: micro-batches sized by tokens change the sequence length from call to call.
            block.compile(dynamic=True)
    return model
