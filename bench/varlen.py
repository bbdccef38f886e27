"""Packed-attention benchmark: the ways to attend causally within the sequences of one packed row.

For each shape (sequence lengths, query heads over key/value heads, head size) it times, forward
and backward together and forward alone without gradients (best of ``--repeat``):

- ``split``: SDPA ``is_causal=True`` per sequence (models/varlen.py's CPU backend);
- ``padded``: the sequences right-padded to the longest and batched through one causal SDPA call;
- ``dense``: SDPA under the dense ``T x T`` block-diagonal mask (what packing used before);
- ``nested``: SDPA on nested jagged tensors;
- ``flex``: ``flex_attention`` compiled, under the document-causal block mask (its first call,
  the compilation, is printed apart);
- ``flash``: ``flash_attn_varlen_func`` (CUDA, bf16 inputs, flash-attn installed);
- ``torch``: torch's own ``varlen_attn`` (CUDA, bf16 inputs, torch 2.11 and newer).

On a GPU it also times one packed micro-batch of the gsm8k workloads' size (``GPU_SHAPES``).

A way that cannot run prints why (flex has no backward on the CPU: its ``fwd+bwd`` fails there).

    python bench/varlen.py
    python bench/varlen.py --device cuda --repeat 20
    python bench/varlen.py --device cuda --shapes qwen-0.5b-micro-batch --ways split,padded,flash,torch
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from resilient_rl.models import varlen
from resilient_rl.models.packing import packed_layout

SHAPES = {  # name: (lengths, heads, kv_heads, head_dim)
    "tiny": ([1, 65, 59, 44, 88, 83, 33, 111], 4, 2, 16),
    "qwen-0.5b": ([141, 159, 232, 348, 349, 116, 243, 113, 340, 202, 121, 342], 14, 2, 64),
}
#: On a GPU also one packed micro-batch of the gsm8k workloads' size: 96 sequences of 128 to 512
#: tokens (about 31 k), where one kernel launch per sequence and layer (split) shows. Its dense
#: ``T x T`` mask alone is about 1 GB; on the CPU the dense way's scores would not fit in memory.
GPU_SHAPES = {
    "qwen-0.5b-micro-batch": (torch.randint(128, 513, (96,), generator=torch.Generator().manual_seed(0)).tolist(),
                              14, 2, 64),
}


def _padded(q, k, v, layout):
    lengths = torch.tensor(layout.lengths, device=q.device)
    longest, total = int(lengths.max()), q.shape[2]
    index = (layout.cu_seqlens[:-1, None].long() + torch.arange(longest, device=q.device)).clamp(max=total - 1)
    valid = torch.arange(longest, device=q.device)[None] < lengths[:, None]

    def rows(x):  # [1, h, T, D] -> [N, h, longest, D]
        return x[0][:, index].transpose(0, 1)

    out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)[:, valid][None]


def _dense(q, k, v, layout):
    ids = layout.sequence_ids
    total = ids.numel()
    causal = torch.ones(total, total, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal & (ids[:, None] == ids[None]), enable_gqa=True)


def _nested(q, k, v, layout):
    offsets = layout.cu_seqlens.long()

    def jagged(x):  # [1, h, T, D] -> [N, h, j, D]
        x = x[0].transpose(0, 1).repeat_interleave(q.shape[1] // x.shape[1], 1).contiguous()
        return torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2)

    out = F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v), is_causal=True)
    return out.transpose(1, 2).values().transpose(0, 1)[None]


WAYS = {
    "split": lambda q, k, v, layout: varlen.varlen_attention(q, k, v, layout, backend="split"),
    "padded": _padded,
    "dense": _dense,
    "nested": _nested,
    "flex": lambda q, k, v, layout: varlen.varlen_attention(q, k, v, layout, backend="flex"),
    "flash": lambda q, k, v, layout: varlen.varlen_attention(q, k, v, layout, backend="flash"),
    "torch": lambda q, k, v, layout: varlen.varlen_attention(q, k, v, layout, backend="torch"),
}


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _names(text: str | None, known: dict, option: str, parser: argparse.ArgumentParser) -> list[str]:
    """The names ``text`` lists (all of ``known`` when None); an unknown one is a usage error."""
    names = list(known) if text is None else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"{option}: unknown {', '.join(unknown) or 'empty list'} (known here: {', '.join(known)})")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: every one here)")
    parser.add_argument("--ways", default=None, help=f"comma-separated ways (default: all of {', '.join(WAYS)})")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, {dtype}")
    shapes = {**SHAPES, **(GPU_SHAPES if device.type == "cuda" else {})}
    shapes = {name: shapes[name] for name in _names(args.shapes, shapes, "--shapes", parser)}
    ways = {name: WAYS[name] for name in _names(args.ways, WAYS, "--ways", parser)}
    if "split" not in ways:
        ways = {"split": WAYS["split"], **ways}  # every way is compared against it
    for name, (lengths, heads, kv_heads, dim) in shapes.items():
        total = sum(lengths)
        layout = packed_layout(torch.cat([torch.arange(n) for n in lengths])[None].to(device))
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, h, total, dim, device=device, dtype=dtype, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))
        print(f"{name}: {len(lengths)} sequences, T={total}, {heads} heads over {kv_heads}, D={dim}")
        reference = WAYS["split"](q.detach(), k.detach(), v.detach(), layout)
        for way, fn in ways.items():
            try:
                with torch.no_grad():
                    start = time.perf_counter()
                    out = fn(q.detach(), k.detach(), v.detach(), layout)
                    first = (time.perf_counter() - start) * 1e3
                    forward = _best(lambda: fn(q.detach(), k.detach(), v.detach(), layout), args.repeat)
                error = (out.float() - reference.float()).abs().max().item()
                line = f"  {way:7s} fwd {forward:9.2f} ms (first call {first:8.1f} ms)  max diff {error:.1e}"
            except Exception as exc:  # noqa: BLE001 - a way that cannot run here says why
                print(f"  {way:7s} fwd: {type(exc).__name__}: {str(exc).splitlines()[0][:110]}")
                continue
            try:
                both = _best(lambda: fn(q, k, v, layout).float().square().sum().backward(), args.repeat)
                print(f"{line}  fwd+bwd {both:9.2f} ms")
            except Exception as exc:  # noqa: BLE001
                print(f"{line}  fwd+bwd: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")


if __name__ == "__main__":
    main()
