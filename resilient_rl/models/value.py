"""A critic: a causal-LM backbone with a scalar value head on its last hidden state.

The backbone is the same family as the actor (the built-in tiny model or a Hugging Face model).
Its LM head is dropped: the critic never needs vocabulary logits, and an unused ``[hidden, vocab]``
matrix would cost memory, optimizer state and checkpoint space while getting no gradient (which
FSDP2 and the optimizer would have to special-case). For a Hugging Face causal LM the wrapper keeps
only ``model.base_model`` (e.g. ``LlamaModel``); for the tiny model it sets ``lm_head`` to None.
Parameter names are therefore ``backbone.<base model names>`` and ``value_head.{weight,bias}``.

FSDP2: shard each block of :attr:`CausalLMWithValueHead.layers`, then the wrapper itself (not the
backbone separately), so the embeddings, final norm and value head share the root's group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from resilient_rl.models.hf import hf_layers
from resilient_rl.models.tiny import TinyCausalLM

__all__ = ["CausalLMWithValueHead"]


class CausalLMWithValueHead(nn.Module):
    """Backbone + ``value_head = nn.Linear(hidden, 1)``; :meth:`forward` returns values ``[B, T]``.

    The wrapper takes ownership of ``backbone`` and removes its LM head (see the module docs).
    The value head is initialised from the global torch RNG (normal with the backbone's init std,
    zero bias), so seeding before construction fixes it.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        if isinstance(backbone, TinyCausalLM):
            backbone.lm_head = None
            hidden_size = backbone.config.hidden_size
            init_std = backbone.config.init_std
        else:
            # A Hugging Face causal LM keeps its decoder under `base_model`; a base model is its own.
            backbone = getattr(backbone, "base_model", backbone)
            config = backbone.config
            hidden_size = config.hidden_size
            init_std = getattr(config, "initializer_range", 0.02)
        self.backbone = backbone
        dtype = next(backbone.parameters()).dtype
        self.value_head = nn.Linear(hidden_size, 1, dtype=dtype)
        nn.init.normal_(self.value_head.weight, mean=0.0, std=init_std)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self) -> Any:
        """The backbone's config (``TinyLMConfig`` or a Hugging Face config)."""
        return self.backbone.config

    @property
    def layers(self) -> nn.ModuleList:
        """The backbone's transformer blocks, for FSDP2 to shard one by one."""
        if isinstance(self.backbone, TinyCausalLM):
            return self.backbone.layers
        return hf_layers(self.backbone)

    def get_input_embeddings(self) -> nn.Module:
        """The backbone's token embedding."""
        return self.backbone.get_input_embeddings()

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The backbone's final hidden states ``[B, T, H]`` (after its final norm)."""
        if isinstance(self.backbone, TinyCausalLM):
            hidden, _ = self.backbone.forward_hidden(input_ids, attention_mask, position_ids)
            return hidden
        # The base model's own output is the final hidden state: asking for every layer's
        # (output_hidden_states) would keep num_layers + 1 extra [B, T, H] tensors alive until
        # the values are computed, for nothing.
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, return_dict=True)
        return out.last_hidden_state

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Values ``[B, T]`` in float32: one scalar per token position."""
        hidden = self.forward_hidden(input_ids, attention_mask, position_ids)
        # A 1-D weight gives [B, T] directly; squeezing [B, T, 1] would return a view, which
        # FSDP2 warns about on a root module's output.
        values = F.linear(hidden, self.value_head.weight[0], self.value_head.bias[0])
        return values.float()
