"""Built-in models: a tiny causal LM built from config and Hugging Face causal LMs."""

from resilient_rl.models.factory import (
    build_causal_lm,
    build_value_model,
    seeded_init,
    tiny_config,
    transformer_blocks,
)
from resilient_rl.models.generation import (
    GenerationOutput,
    compute_position_ids,
    generate,
    sample_next_token,
)
from resilient_rl.models.hf import hf_layers, load_hf_causal_lm, tiny_llama_config
from resilient_rl.models.tiny import CausalLMOutput, TinyCausalLM, TinyLMConfig
from resilient_rl.models.value import CausalLMWithValueHead

__all__ = [
    "CausalLMOutput",
    "CausalLMWithValueHead",
    "GenerationOutput",
    "TinyCausalLM",
    "TinyLMConfig",
    "build_causal_lm",
    "build_value_model",
    "compute_position_ids",
    "generate",
    "hf_layers",
    "load_hf_causal_lm",
    "sample_next_token",
    "seeded_init",
    "tiny_config",
    "tiny_llama_config",
    "transformer_blocks",
]
