"""Real-shaped workloads for bench/gpu.py (``--workload gsm8k-1.5b | gsm8k-0.5b``) and their figures.

Everything here is pure (no GPU, no timing) so it is tested on CPU: the workload's config and
prompt file, FLOP counts, the decode roofline, peak FLOP/s and memory bandwidth by device name,
and verl's ``perf/throughput``.

- **Model FLOPs** follow torchtitan (``get_num_flop_per_token``): per token, ``6·N + 12·L·H·D·T``
  for a training step (forward + backward) and a third of it, ``2·N + 4·L·H·D·T``, for a forward
  pass; ``N`` counts parameters without the input embedding, ``L`` layers, ``H`` heads, ``D`` head
  dim and ``T`` the sequence length (here the step's padded prompt + response columns).
- **Decode roofline**: a decode step must read every weight once and each row's KV cache so far;
  the bound is the bytes of all steps over the device's memory bandwidth (compute is ignored: at
  these batch sizes decode is bandwidth-bound).
- **verl throughput** (``perf/throughput``): the step's prompt + response tokens (attention-mask
  sum) / step seconds / GPUs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

#: Dense bf16 peak FLOP/s and HBM bandwidth (bytes/s), matched in order against the CUDA device
#: name ("NVIDIA H100 80GB HBM3" is the SXM part; the PCIe and NVL parts name themselves).
DEVICES = (("H100 PCIe", 756e12, 2.0e12), ("H100 NVL", 835e12, 3.9e12), ("H200", 989e12, 4.8e12),
           ("H100", 989e12, 3.35e12), ("A100", 312e12, 2.0e12))


@dataclass(frozen=True)
class Workload:
    """A model shape (a Hugging Face config, random weights) and a GSM8K-like batch."""

    name: str
    hf_config: dict = field(hash=False)
    prompts: int = 64
    n: int = 8
    prompt_len: int = 256
    max_new_tokens: int = 512

    @property
    def layers(self) -> int:
        return self.hf_config["num_hidden_layers"]

    @property
    def heads(self) -> int:
        return self.hf_config["num_attention_heads"]

    @property
    def head_dim(self) -> int:
        return self.hf_config["hidden_size"] // self.heads

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token takes over all layers (keys and values, grouped-query heads)."""
        return 2 * self.layers * self.hf_config["num_key_value_heads"] * self.head_dim * dtype_bytes


def _qwen2(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> dict:
    return {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True}


#: Shapes of Qwen2.5-1.5B and Qwen2.5-0.5B (their config.json), 64 prompts x 8 samples, 256 + 512.
WORKLOADS = {
    "gsm8k-1.5b": Workload("gsm8k-1.5b", _qwen2(1536, 28, 12, 2, 8960)),
    "gsm8k-0.5b": Workload("gsm8k-0.5b", _qwen2(896, 24, 14, 2, 4864)),
}


def write_prompts(path: Path, count: int, prompt_len: int, seed: int = 0) -> Path:
    """A JSONL file of ``count`` GSM8K-like word problems of exactly ``prompt_len`` characters
    (tokens, with the character tokenizer) and integer answers."""
    rng = random.Random(seed)
    words = ("apples", "pens", "trains", "hours", "coins", "miles", "boxes", "cups", "days", "books")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            text = f"Tom has {a} {rng.choice(words)} and buys {b} more. "
            while len(text) < prompt_len:
                text += f"Then {rng.randint(2, 9)} {rng.choice(words)} go. "
            text = text[:prompt_len - 9] + " Answer: "
            f.write(json.dumps({"prompt": text, "answer": str(a + b)}) + "\n")
    return path


def workload_config(w: Workload, prompt_file: Path) -> dict:
    """The config (a YAML-able dict) of a GRPO run of workload ``w`` on one GPU."""
    return {
        "model": {"kind": "hf", "hf_config": dict(w.hf_config),
                  "max_seq_len": w.prompt_len + w.max_new_tokens + 8},
        "data": {"task": "jsonl", "path": str(prompt_file), "reward_fn": "gsm8k", "batch_size": w.prompts},
        "rollout": {"n": w.n, "max_new_tokens": w.max_new_tokens, "temperature": 1.0},
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "actor": {"ppo_epochs": 1, "mini_batch_size": w.prompts * w.n // 4, "use_kl_loss": True,
                  "world_size": 1, "optim": {"lr": 1.0e-6}},
        "trainer": {"run_name": w.name},  # bench/gpu.py adds trainer.device=cuda
    }


def device_specs(device_name: str) -> tuple[float, float] | None:
    """(dense bf16 peak FLOP/s, memory bandwidth bytes/s) by CUDA device name; None if unknown."""
    for key, peak, bandwidth in DEVICES:
        if key.lower() in device_name.lower():
            return peak, bandwidth
    return None


def flops_per_token(non_embedding_params: int, layers: int, heads: int, head_dim: int, seq_len: int,
                    training: bool) -> float:
    """torchtitan's model FLOPs per token (see the module docstring)."""
    train = 6.0 * non_embedding_params + 12.0 * layers * heads * head_dim * seq_len
    return train if training else train / 3.0


def mfu(tokens: float, seconds: float, per_token_flops: float, peak: float, gpus: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``gpus`` x ``peak``."""
    return tokens * per_token_flops / seconds / (peak * gpus)


def decode_roofline_tokens_per_s(param_bytes: float, kv_bytes_per_token: float, batch: int, prompt_len: int,
                                 new_tokens: int, bandwidth: float) -> float:
    """Output tokens/s at the memory-bandwidth bound for ``batch`` rows each generating
    ``new_tokens`` after ``prompt_len`` (every step reads the weights and every row's cache)."""
    step_bytes = sum(param_bytes + batch * (prompt_len + t) * kv_bytes_per_token for t in range(new_tokens))
    return batch * new_tokens * bandwidth / step_bytes


def verl_throughput(tokens: float, step_seconds: float, gpus: int) -> float:
    """verl's ``perf/throughput``: prompt + response tokens of the step / step time / GPUs."""
    return tokens / step_seconds / gpus


def torchtitan_params(model) -> int:
    """Parameters as torchtitan counts them for FLOPs: every distinct parameter except embedding
    tables (a tied LM head is then not counted, as in torchtitan)."""
    from torch import nn

    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in embedding)


def workload_lines(w: Workload, summary: dict, rows: list[dict], params: int, peak: float | None,
                   gpus: int, ppo_epochs: int) -> list[str]:
    """The workload's figures from bench/train.py's ``summarize`` of the measured steps' rows:
    update and log-prob MFU (torchtitan), generation tokens/s inside the step, verl throughput."""
    seq = w.prompt_len + w.max_new_tokens
    tokens = summary["tokens_per_step"]
    phase = summary["phase_s"]
    train_tok = flops_per_token(params, w.layers, w.heads, w.head_dim, seq, training=True)
    fwd_tok = flops_per_token(params, w.layers, w.heads, w.head_dim, seq, training=False)
    lines = [f"workload {w.name}: torchtitan FLOPs/token {train_tok / 1e9:.2f} G (train), "
             f"{fwd_tok / 1e9:.2f} G (forward); N = {params / 1e6:.0f} M non-embedding params, T = {seq}"]
    for name, key, per_token, passes in (("update", "update_actor", train_tok, ppo_epochs),
                                         ("log-prob", "old_log_prob", fwd_tok, 1), ("ref log-prob", "ref", fwd_tok, 1)):
        secs = phase.get(key, 0.0)
        if secs <= 0:
            continue
        value = f"{100 * mfu(tokens * passes, secs, per_token, peak, gpus):.1f}%" if peak else "n/a (peak unknown)"
        lines.append(f"  {name} MFU: {value} ({1e3 * secs:.0f} ms per step)")
    responses = [r["response_length/mean"] * w.prompts * w.n for r in rows if "response_length/mean" in r]
    if responses and phase.get("gen", 0) > 0:
        lines.append(f"  generation in the step: {sum(responses) / len(responses) / phase['gen']:.0f} output tokens/s")
    lines.append(f"  throughput (verl perf/throughput): "
                 f"{verl_throughput(tokens, summary['step_s'], gpus):.0f} tokens/s/GPU")
    return lines
