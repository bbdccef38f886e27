"""A tiny decoder-only transformer, built from config, that needs no download.

It follows the Hugging Face calling convention (``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values``, ``use_cache``; the output has ``.logits`` and ``.past_key_values``) so the same
generation, actor and critic code serves it and Hugging Face models. The transformer blocks live in
``model.layers`` so FSDP2 can ``fully_shard`` each block and then the root.

Prompts are left-padded: pad keys are masked in attention and positions skip the padding, so a
padded row computes the same logits for its real tokens as the unpadded row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from resilient_rl.errors import ConfigError, ModelInputError
from resilient_rl.models.cache_attention import cache_attention
from resilient_rl.models.generation import compute_position_ids
from resilient_rl.models.packing import PackedLayout, layout_of
from resilient_rl.models.varlen import varlen_attention

__all__ = ["CausalLMOutput", "KVCache", "TinyCausalLM", "TinyLMConfig"]

# One (key, value) pair per layer, each [batch, heads, seq, head_dim].
KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass
class TinyLMConfig:
    """Shape of a :class:`TinyCausalLM`. ``max_seq_len`` bounds prompt + response length."""

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_seq_len: int = 64
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_seq_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{key} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                              f"model.num_heads ({self.num_heads})")
        if not self.init_std > 0:
            raise ConfigError(f"model.init_std must be > 0, got {self.init_std!r}")


@dataclass
class CausalLMOutput:
    """Output of :class:`TinyCausalLM` (attribute names match Hugging Face outputs)."""

    logits: torch.Tensor
    past_key_values: KVCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


# A pytree node, as Hugging Face registers its ModelOutput: code that finds a module's output
# tensors by flattening it sees the logits. FSDP2 of torch 2.11 and older registers a sharded root's
# backward hook that way; with the output a leaf the hook never ran, so the gradients never reached
# the shards the optimizer steps, and a sharded run on CPU (root-only FSDP2) trained nothing.
torch.export.register_dataclass(CausalLMOutput, serialized_type_name=f"{__name__}.CausalLMOutput")


class TinyAttention(nn.Module):
    """Multi-head causal self-attention over ``scaled_dot_product_attention`` with a KV cache."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | PackedLayout,
                past: tuple[torch.Tensor, torch.Tensor] | None,
                use_cache: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``x`` [B,T,H] and either a boolean ``mask`` [B,1,T,past+T] (True = attend) or, for packed
        rows, their :class:`~resilient_rl.models.packing.PackedLayout`. Returns output and new (k, v)."""
        batch, seq, hidden = x.shape
        q, k, v = self.qkv_proj(x).view(batch, seq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        if isinstance(mask, PackedLayout):
            out = varlen_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # The cache is copied out of the fused projection's view: FSDP2 must not see a block
        # return views, and later concatenations read contiguous memory.
        present = (k.contiguous(), v.contiguous()) if use_cache else None
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, hidden)), present

    def forward_static(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """Attention through the rollout engine's cache (``step``, an
        :class:`~resilient_rl.models.cache_attention.EngineStep`): the new keys/values are written
        in place into layer ``layer``'s buffers and the queries attend through them."""
        batch, seq, hidden = x.shape
        q, k, v = self.qkv_proj(x).view(batch, seq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = cache_attention(q, k, v, layer, step)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class TinyMLP(nn.Module):
    """Two-layer feed-forward block with a GELU."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class TinyBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.attn = TinyAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.mlp = TinyMLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | PackedLayout,
                past: tuple[torch.Tensor, torch.Tensor] | None,
                use_cache: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        attn_out, present = self.attn(self.attn_norm(x), mask, past, use_cache)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x)), present

    def forward_static(self, x: torch.Tensor, layer: int, step) -> torch.Tensor:
        """:meth:`forward` through the rollout engine's cache (see :meth:`TinyAttention.forward_static`)."""
        x = x + self.attn.forward_static(self.attn_norm(x), layer, step)
        return x + self.mlp(self.mlp_norm(x))


class TinyCausalLM(nn.Module):
    """A small decoder-only transformer with learned absolute positions.

    Initialisation draws from the global torch RNG, so ``torch.manual_seed(s)`` before
    construction fixes the weights. ``lm_head`` may be set to None by a value model that only
    needs hidden states; :meth:`forward_hidden` works either way.
    """

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_seq_len, config.hidden_size)
        self.layers = nn.ModuleList(TinyBlock(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (Hugging Face naming)."""
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear | None:
        """The LM head, or None once a value model removed it (Hugging Face naming)."""
        return self.lm_head

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """Final (normalised) hidden states ``[B, T, H]`` and, if ``use_cache``, the new KV cache.

        ``attention_mask`` covers the cached tokens plus ``input_ids`` (``[B, past+T]``), as in
        Hugging Face models; ``position_ids`` ``[B, T]`` default to ``cumsum(mask) - 1`` for the
        last ``T`` columns.
        """
        batch, seq = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        total = past_len + seq
        if past_key_values is not None and len(past_key_values) != len(self.layers):
            raise ModelInputError(f"past_key_values has {len(past_key_values)} layers, "
                                  f"the model has {len(self.layers)}")
        # Without an attention mask, explicit positions may pack several sequences per row, as
        # Hugging Face models accept them.
        packed = attention_mask is None and position_ids is not None and past_key_values is None
        if attention_mask is None:
            attention_mask = torch.ones((batch, total), dtype=torch.long, device=input_ids.device)
        elif attention_mask.shape != (batch, total):
            raise ModelInputError(
                f"attention_mask {tuple(attention_mask.shape)} must be [batch, past+seq] = "
                f"[{batch}, {total}] (past={past_len}, input_ids {tuple(input_ids.shape)})")
        if position_ids is None:
            position_ids = compute_position_ids(attention_mask)[:, past_len:]
        elif position_ids.shape != input_ids.shape:
            raise ModelInputError(f"position_ids {tuple(position_ids.shape)} must match "
                                  f"input_ids {tuple(input_ids.shape)}")
        max_pos = int(position_ids.max()) if position_ids.numel() else 0
        if max_pos >= self.config.max_seq_len:
            raise ConfigError(f"position {max_pos} is past model.max_seq_len={self.config.max_seq_len}; "
                              "raise model.max_seq_len to cover prompt + response length")

        if packed:  # sequences laid end to end, told apart by their positions (models/packing.py)
            mask = layout_of(position_ids)
        else:
            mask = attention_mask_4d(attention_mask, past_len, seq)
        x = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, mask, past_key_values[i] if past_key_values else None, use_cache)
            presents.append(present)
        return self.norm(x), (tuple(presents) if use_cache else None)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        output_hidden_states: bool = False,
    ) -> CausalLMOutput:
        """Logits ``[B, T, V]``; see :meth:`forward_hidden` for the arguments.

        ``output_hidden_states`` returns only the final hidden state (``hidden_states[-1]``),
        which is all the value model reads.
        """
        if self.lm_head is None:
            raise ModelInputError("this TinyCausalLM has no lm_head (it backs a value model); "
                                  "call forward_hidden instead")
        hidden, presents = self.forward_hidden(input_ids, attention_mask, position_ids,
                                               past_key_values, use_cache)
        return CausalLMOutput(logits=self.lm_head(hidden), past_key_values=presents,
                              hidden_states=(hidden,) if output_hidden_states else None)


    def forward_static(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step) -> torch.Tensor:
        """Logits of the last input position ``[B, V]`` through the rollout engine's cache (``step``,
        an :class:`~resilient_rl.models.cache_attention.EngineStep`).

        No argument checks and no host synchronisation: the engine validates lengths once before
        generating, and this runs once per generated token.
        """
        if self.lm_head is None:
            raise ModelInputError("this TinyCausalLM has no lm_head (it backs a value model)")
        x = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for i, layer in enumerate(self.layers):
            x = layer.forward_static(x, i, step)
        return self.lm_head(self.norm(x[:, -1]))


def attention_mask_4d(attention_mask: torch.Tensor, past_len: int, seq: int) -> torch.Tensor:
    """Boolean ``[B, 1, seq, past+seq]`` mask: causal, pad keys hidden.

    Every query may also attend to itself, so a padding query never has a fully masked row
    (which would make SDPA return NaN); real queries never see a pad key because a pad key is
    never their own position.
    """
    total = past_len + seq
    device = attention_mask.device
    key_idx = torch.arange(total, device=device)
    query_idx = torch.arange(past_len, total, device=device)
    causal = key_idx[None, :] <= query_idx[:, None]
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    allowed = allowed | (key_idx[None, :] == query_idx[:, None])[None]
    return allowed[:, None]
