"""``micro_batch_tokens=auto``: micro-batches sized from a memory model of the device, the model
shape and the precision, so that an update pass fits the device by construction.

A pure model (no device calls) of the bytes one rank holds at the peak of an update pass, and
the largest token budget per micro-batch under the device's memory. The engines resolve ``auto``
with it when they are built (:func:`resolve`), and the controller prints the decision in one line.

Per token and transformer layer, without activation checkpointing, autograd keeps (``c``: bytes
of the compute dtype, ``r``: bytes of the residual stream: ``c`` when FSDP2 casts the parameters,
4 under autocast over fp32 weights; ``h`` hidden, ``i`` intermediate, ``kv`` the K/V width,
expanded to ``h`` where Hugging Face's ``repeat_kv`` copies K/V per query head, which it does
whenever an attention mask is passed)::

    2 RMSNorms      2 x (4h + r h + c h)   fp32 upcast of the input, the normalised input
                                           (weight multiply), the output (the projections' input)
    attention       c (3h + 2 kv) + 4 heads  rotated q, k and v as SDPA saves them, SDPA's output,
                                           o_proj's input (a contiguous copy), the log-sum-exp
    MLP             4 c i                  gate and up outputs, SiLU(gate), their product

For Qwen2.5 shapes under bf16 autocast (r=4, c=2, K/V expanded) that is 30 h + 8 i + 4 heads:
0.5 B (h 896, i 4864, 14 heads): 65,848 bytes (64.3 KiB); 1.5 B (h 1536, i 8960, 12 heads):
117,808 bytes (115.0 KiB); under FSDP2's bf16 parameters (r=2) 26 h + 8 i + 4 heads. With
activation checkpointing a layer keeps only its input (``r h``) and one layer's activations exist
again during its recomputation. Compiled norms and SwiGLU (``compile_elementwise``,
:mod:`resilient_rl.models.fused_elementwise`) keep about ``8 h + c i`` less (the norms' fp32
copies and SiLU(gate)); the plan counts the eager bytes, since a compiler failure at run time
leaves a process eager. Per token, outside the layers: the embedding output and the final
norm. Logits: the chunked head (:mod:`resilient_rl.workers.chunked_head`) holds one chunk of
``CHUNK_ELEMENTS`` logits at a time (the compute-dtype logits and, eagerly, three fp32 tensors
of the statistics or of their gradient) and, in the backward pass, the fp32 sum of its weight's
gradient, twice while a chunk's product is added into a new sum (``8 vocab h``): fixed terms; a
model that needs full logits keeps ``vocab x (c + 12)`` bytes per token.

Besides activations, a rank holds its share of the training state (fp32 master weights,
fp32 gradients, AdamW's two fp32 moments: 16 bytes per parameter, over the FSDP shard group, all
of it on a replica), the weights in the compute dtype while they are used (FSDP2's gathered
parameters, whole model when ``reshard_after_forward`` is false, else the root and two blocks;
autocast's cached casts on a replica), and what other colocated roles keep on the device. The
budget leaves ``HEADROOM`` of the device and ``RESERVED_BYTES`` (CUDA context, NCCL and cuBLAS
workspaces) free. The whole mini-batch runs in one forward when it fits (``null``: today's
behaviour, and CPU runs stay bit-identical); else the largest multiple of ``ROUND_TO`` tokens
that fits, at least one row.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from resilient_rl.errors import ConfigError

GIB = 2**30
#: Fraction of the device left free for the caching allocator's fragmentation.
HEADROOM = 0.10
#: Bytes left free besides: the CUDA context, NCCL buffers, cuBLAS workspaces.
RESERVED_BYTES = 2 * GIB
#: Token budgets are multiples of this (readable, and as good as any nearby number).
ROUND_TO = 256
#: Logits per chunk of the chunked log-prob head (the value of resilient_rl.workers.logprob).
CHUNK_ELEMENTS = 1 << 26
#: How a plan's line says that not even one row fits.
NO_FIT = ": one row does not fit"
#: Bytes per logit of a chunk alive at once: the compute-dtype logits plus three fp32 tensors.
LOGIT_FP32_COPIES = 3


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of a decoder-only transformer."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    #: The parameter count when known (a built model); else computed for a Llama/Qwen2 layout.
    params: int | None = None
    #: A critic: no LM head, no logits.
    value_head: bool = False

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def parameter_count(self) -> int:
        if self.params is not None:
            return self.params
        h, kv = self.hidden, self.kv_dim
        block = 2 * h * h + h + 2 * (h * kv + kv) + 3 * h * self.intermediate + 2 * h
        head = 0 if self.tied or self.value_head else self.vocab * h
        return self.vocab * h + self.layers * block + h + head + (h + 1 if self.value_head else 0)

    def block_parameters(self) -> int:
        h, kv = self.hidden, self.kv_dim
        return 2 * h * h + h + 2 * (h * kv + kv) + 3 * h * self.intermediate + 2 * h

    @classmethod
    def from_config(cls, config: Any, params: int | None = None, value_head: bool = False) -> "ModelShape":
        """From a built model's config: the tiny model's ``TinyLMConfig`` or a Hugging Face config
        (an object or a dict of its fields)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        layers = get("num_hidden_layers") or get("num_layers")
        heads = get("num_attention_heads") or get("num_heads")
        if not (layers and heads and get("hidden_size") and get("intermediate_size") and get("vocab_size")):
            raise ConfigError(f"micro_batch_tokens=auto cannot read the model's shape from {type(config).__name__} "
                              "(hidden_size, intermediate_size, layers, heads, vocab_size); set an int")
        tied = get("tie_word_embeddings")
        return cls(layers=int(layers), hidden=int(get("hidden_size")), intermediate=int(get("intermediate_size")),
                   heads=int(heads), kv_heads=int(get("num_key_value_heads") or heads), vocab=int(get("vocab_size")),
                   tied=bool(get("tie_embeddings") if tied is None else tied), params=params, value_head=value_head)


#: Qwen2.5-0.5B and Qwen2.5-1.5B (the gsm8k workloads).
QWEN25_05B = ModelShape(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True)
QWEN25_15B = ModelShape(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936, tied=True)


@dataclasses.dataclass(frozen=True)
class Precision:
    """``compute`` bytes per element of the matmuls; ``residual`` of the residual stream and norm
    outputs (FSDP2 mixed precision: the compute dtype; autocast over fp32 weights: 4)."""

    compute: int = 2
    residual: int = 4
    #: Whether the parameters are sharded by FSDP2 (their gathered copies are working weights).
    fsdp: bool = False

    @classmethod
    def of(cls, compute_bytes: int, fsdp: bool) -> "Precision":
        return cls(compute_bytes, compute_bytes if fsdp else 4, fsdp)


def layer_bytes_per_token(shape: ModelShape, prec: Precision, expanded_kv: bool = True) -> int:
    """Bytes autograd keeps per token in one layer without checkpointing (module docs)."""
    h, c, r = shape.hidden, prec.compute, prec.residual
    kv = h if expanded_kv else shape.kv_dim
    norms = 2 * (4 * h + r * h + c * h)
    attention = c * (3 * h + 2 * kv) + 4 * shape.heads
    mlp = 4 * c * shape.intermediate
    return norms + attention + mlp


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The decision for one role: ``tokens`` per micro-batch (None: one forward per mini-batch)
    and the figures behind it, all in bytes."""

    role: str
    tokens: int | None
    device_bytes: int
    device: str
    budget_bytes: int
    state_bytes: int
    weight_bytes: int
    other_bytes: int
    logit_bytes: int
    layer_token_bytes: int
    token_bytes: int
    fixed_bytes: int
    step_peak_bytes: int
    mini_batch_tokens: int
    peak_bytes: int
    fits: bool
    checkpointing: bool

    def peak_at(self, tokens: int) -> int:
        """Predicted peak of an update over micro-batches of ``tokens`` tokens (the pass, or the
        optimizer step after it)."""
        return max(self.fixed_bytes + tokens * self.token_bytes, self.step_peak_bytes)

    @property
    def line(self) -> str:
        chosen = "null (one forward per mini-batch)" if self.tokens is None else f"{self.tokens} tokens"
        text = (f"{self.role} micro_batch_tokens=auto -> {chosen} ({self.device_bytes / GIB:.1f} GiB {self.device}, "
                f"{self.state_bytes / GIB:.2f} GiB states, {self.weight_bytes / GIB:.2f} GiB working weights, "
                f"{self.other_bytes / GIB:.2f} GiB other roles, {self.logit_bytes / GIB:.2f} GiB log-prob head, "
                f"{self.layer_token_bytes / 1000:.1f} KB/token/layer"
                f"{' (checkpointed)' if self.checkpointing else ''}, {self.token_bytes / 1e6:.2f} MB/token, "
                f"mini-batch {self.mini_batch_tokens} tokens; peak {self.peak_bytes / GIB:.1f} GiB of a "
                f"{self.budget_bytes / GIB:.1f} GiB budget)")
        if not self.fits:
            text += (f"{NO_FIT}; set activation_checkpointing=true, add ranks, or shorten "
                     "model.max_seq_len")
        return text


def summary(lines: list[str | None]) -> str | None:
    """The one line printed at start for the roles' plans (each :attr:`MemoryPlan.line`, None for
    a role that did not ask for ``auto``); None when no role did."""
    lines = [line for line in lines if line]
    return "memory plan: " + "; ".join(lines) if lines else None


def announce(logger: Any, lines: list[str | None]) -> str | None:
    """Log :func:`summary` of ``lines`` once: INFO, or WARNING where a role's rows cannot fit."""
    line = summary(lines)
    if line:
        logger.log(logging.WARNING if NO_FIT in line else logging.INFO, line)
    return line


def budget(device_bytes: int) -> int:
    """What a plan may use of a device of ``device_bytes``."""
    return max(0, int(device_bytes * (1 - HEADROOM)) - RESERVED_BYTES)


def plan(shape: ModelShape, *, role: str, device_bytes: int, device: str, prec: Precision, shard_ranks: int,
         mini_batch_rows: int, seq_len: int, checkpointing: bool = False, reshard_after_forward: bool = False,
         chunked_logits: bool = True, expanded_kv: bool = True, other_bytes: int = 0) -> MemoryPlan:
    """The micro-batch budget of ``role`` for local mini-batches of ``mini_batch_rows`` rows of at
    most ``seq_len`` tokens, with the training state sharded over ``shard_ranks`` ranks (1: a
    replica)."""
    p = shape.parameter_count()
    c = prec.compute
    states = 16 * p // max(1, shard_ranks)
    if prec.fsdp and shard_ranks > 1:
        gathered = p if not reshard_after_forward else p - shape.layers * shape.block_parameters() \
            + 2 * shape.block_parameters()
        weights = c * gathered
    else:
        weights = c * p if c < 4 else 0  # autocast keeps a cast copy of every weight it used
    full_layer = layer_bytes_per_token(shape, prec, expanded_kv)
    h, r = shape.hidden, prec.residual
    kept_layer = r * h if checkpointing else full_layer
    outside = r * h + (4 * h + r * h + c * h) + c * h  # embedding output, final norm, head input
    token_bytes = shape.layers * kept_layer + outside + (full_layer if checkpointing else 0)
    logits = 0
    mb_tokens = mini_batch_rows * seq_len
    if not shape.value_head:
        if chunked_logits:  # one chunk at a time, no larger than the mini-batch's logits
            logits = min(CHUNK_ELEMENTS, mb_tokens * shape.vocab) * (c + 4 * LOGIT_FP32_COPIES) \
                + 8 * shape.vocab * shape.hidden
        else:
            token_bytes += shape.vocab * (c + 4 * LOGIT_FP32_COPIES)
    fixed = states + other_bytes + weights + logits
    # The optimizer step runs after the backward (activations and gathered weights gone): its
    # fp32 temporaries (about two shards' worth in the foreach AdamW) are a peak of their own.
    step_peak = states + other_bytes + 8 * p // max(1, shard_ranks)
    room = budget(device_bytes)
    if fixed + mb_tokens * token_bytes <= room:
        tokens = None
        peak = fixed + mb_tokens * token_bytes
    else:
        most = (room - fixed) // token_bytes if room > fixed else 0
        # Whole rows where the budget is small; else a round number. At least one row: the
        # split gives a longer row a micro-batch alone anyway.
        tokens = most // ROUND_TO * ROUND_TO if most >= ROUND_TO else most // seq_len * seq_len
        tokens = max(tokens, seq_len)
        peak = fixed + tokens * token_bytes
    peak = max(peak, step_peak)
    return MemoryPlan(role=role, tokens=tokens, device_bytes=device_bytes, device=device, budget_bytes=room,
                      state_bytes=states, weight_bytes=weights, other_bytes=other_bytes, logit_bytes=logits,
                      layer_token_bytes=full_layer, token_bytes=token_bytes,
                      fixed_bytes=fixed, step_peak_bytes=step_peak, mini_batch_tokens=mb_tokens, peak_bytes=peak,
                      fits=peak <= room, checkpointing=checkpointing)


def colocated_bytes(shape: ModelShape, prec: Precision, shard_ranks: int, roles: tuple[str, ...],
                    kv_rows: int = 0, seq_len: int = 0) -> int:
    """Bytes the other roles of a colocated process keep on the device through an update pass:
    ``ref`` its fp32 weights (sharded as the trained roles'), ``rollout`` a full copy of the
    weights in the compute dtype and a KV cache of ``kv_rows`` rows of ``seq_len`` tokens (kept
    across rollouts by a static-cache engine), ``actor``/``critic`` the other trained role's state."""
    p, shard = shape.parameter_count(), max(1, shard_ranks)
    total = 0
    for role in roles:
        if role == "ref":
            total += 4 * p // shard
        elif role == "rollout":
            total += prec.compute * p + kv_rows * seq_len * shape.layers * 2 * shape.kv_dim * prec.compute
        elif role in ("actor", "critic"):
            total += 16 * p // shard
    return total


# ---------------------------------------------------------------------------- the engines' side


def device_memory(device: Any) -> tuple[int, str]:
    """Total bytes of ``device`` (a ``torch.device``) and how the plan's line names it: a CUDA
    device's own memory; on CPU the host's memory shared by the node's ranks."""
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), props.name
    import psutil

    from resilient_rl import env

    local = int(env.get("LOCAL_WORLD_SIZE") or 1)
    return int(psutil.virtual_memory().total) // max(1, local), "host memory"


def model_parameters(model: Any) -> int:
    """Distinct parameters of ``model`` (a tied head counts once; a DTensor counts globally)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[id(p)] = p.numel()
    return sum(seen.values())


def resolve(value: Any, *, role: str, model: Any, device_plan: Any, role_cfg: Any, seq_len: int,
            colocated: tuple[str, ...] = (), kv_rows: int = 0) -> tuple[int | None, MemoryPlan | None]:
    """``role_cfg.micro_batch_tokens`` as an engine uses it: ``value`` itself unless it is
    ``auto``, which is planned for the built (and wrapped) ``model`` on ``device_plan``'s device,
    with ``colocated`` roles sharing it (:func:`colocated_bytes`). The plan comes back with the
    budget for the caller to print."""
    if value != "auto":
        return value, None
    import torch
    import torch.distributed as dist

    from resilient_rl import env
    from resilient_rl.workers.fsdp import is_fsdp, mesh_shape
    from resilient_rl.workers.logprob import supports_chunked_head

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    fsdp = is_fsdp(model)
    shard = mesh_shape(device_plan.sharding, world, int(env.get("LOCAL_WORLD_SIZE") or world))[-1] if fsdp else 1
    shape = ModelShape.from_config(model.config, params=model_parameters(model), value_head=role == "critic")
    prec = Precision.of(torch.finfo(device_plan.param_dtype).bits // 8, fsdp)
    device_bytes, name = device_memory(device_plan.device)
    chosen = plan(shape, role=role, device_bytes=device_bytes, device=name, prec=prec, shard_ranks=shard,
                  mini_batch_rows=max(1, role_cfg.mini_batch_size // world), seq_len=seq_len,
                  checkpointing=bool(role_cfg.activation_checkpointing),
                  reshard_after_forward=bool(role_cfg.reshard_after_forward),
                  chunked_logits=role == "critic" or supports_chunked_head(model),
                  other_bytes=colocated_bytes(shape, prec, shard, colocated, kv_rows, seq_len))
    return chosen.tokens, chosen


def main(argv: list[str] | None = None) -> None:
    """Print the plans of the gsm8k workloads' shapes (``python -m resilient_rl.workers.memory_plan``)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-gb", type=float, default=80.0, help="device memory, GB (1e9 bytes)")
    parser.add_argument("--rows", type=int, default=128, help="mini-batch rows over all ranks")
    parser.add_argument("--seq-len", type=int, default=768, help="longest prompt + response, tokens")
    parser.add_argument("--ranks", type=int, default=1, help="FSDP2 ranks (1: one GPU, autocast)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    args = parser.parse_args(argv)
    prec = Precision.of(2, fsdp=args.ranks > 1)
    for name, shape in (("Qwen2.5-0.5B", QWEN25_05B), ("Qwen2.5-1.5B", QWEN25_15B)):
        chosen = plan(shape, role="actor", device_bytes=int(args.device_gb * 1e9),
                      device=f"{args.device_gb:g} GB device", prec=prec, shard_ranks=args.ranks, mini_batch_rows=max(1, args.rows // args.ranks),
                      seq_len=args.seq_len, checkpointing=args.checkpointing)
        print(f"{name}: {layer_bytes_per_token(shape, prec)} bytes/token/layer; memory plan: {chosen.line}")


if __name__ == "__main__":
    main()
