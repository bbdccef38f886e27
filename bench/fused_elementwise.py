"""The elementwise work of a trained block, forward and backward: each eager way against the same
arithmetic compiled (``resilient_rl/models/fused_elementwise.py``, ``<role>.compile_elementwise``;
on a GPU by default).

Per block: two RMS norms, each on a micro-batch of the residual stream as a replica's update has
it (fp32 under bf16 autocast: ``--tokens`` x the workload's hidden size, fp32 weight, output in
bf16), the rotary embedding of query and key (bf16, laid out as the projections hand them on; Hugging
Face's ``apply_rotary_pos_emb`` against the function a compiled attention calls), and one SwiGLU
(``silu(gate) * up``, bf16, ``--tokens`` x the intermediate size). The norm's
eager ways are Hugging Face's module and ``F.rms_norm`` (on CUDA one fused kernel each way where
the input and weight dtypes match; on a CPU it decomposes). For each way: the best time of
``--repeat`` (the ways alternate, two rounds), its ratio to the eager module, the operators it
dispatches (eager ways) and the bytes a token autograd keeps for the backward; then the largest
differences against the module, and one block's two norms, rotary embedding and SwiGLU summed.

    python bench/fused_elementwise.py --device cuda
    python bench/fused_elementwise.py --tokens 2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from decode_bench import best_of  # noqa: E402
from gpu_workloads import WORKLOADS  # noqa: E402

from resilient_rl.models.fused_elementwise import (_compiled_rotary, _run, _token_dims_any_size,  # noqa: E402
                                                   compile_elementwise, silu_mul)


def norm_modules(hidden: int, eps: float, device: str):
    """Hugging Face's Qwen2 RMS norm, and one whose forward is compiled, with equal weights."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    g = torch.Generator().manual_seed(1)
    eager, fused = Qwen2RMSNorm(hidden, eps), Qwen2RMSNorm(hidden, eps)
    with torch.no_grad():
        eager.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
        fused.weight.copy_(eager.weight)
    assert compile_elementwise(torch.nn.Sequential(fused)) == 1
    return eager.to(device), fused.to(device)


def forward_backward(fn, inputs: list[torch.Tensor], grad: torch.Tensor | tuple, params=()) -> tuple[torch.Tensor, ...]:
    """Outputs and gradients of the inputs and ``params`` of ``fn`` under bf16 autocast, its outputs
    in bf16 as the replica hands them on (``grad``: one per output)."""
    grads = grad if isinstance(grad, tuple) else (grad,)
    inputs = [t.detach().requires_grad_() for t in inputs]
    for p in params:
        p.grad = None
    with torch.autocast(grads[0].device.type, dtype=torch.bfloat16):
        out = fn(*inputs)
        outs = [o.to(torch.bfloat16) for o in (out if isinstance(out, tuple) else (out,))]
    torch.autograd.backward(outs, grads)
    return (*outs, *(t.grad for t in inputs), *(p.grad for p in params))


def dispatched(fn) -> int:
    """How many operators ``fn`` dispatches (views left out)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in ("detach", "ones_like", "zeros_like"):
                Ops.count += 1
            return func(*args, **(kwargs or {}))

    with Ops():
        fn()
    return Ops.count


def kept_bytes(fn, inputs: list[torch.Tensor], tokens: int) -> int:
    """Bytes of the tensors of ``tokens`` rows that autograd keeps for ``fn``'s backward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t):
        if tokens in t.shape:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    inputs = [t.detach().requires_grad_() for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(inputs[0].device.type,
                                                                                     dtype=torch.bfloat16):
        fn(*inputs)
    return sum(storages.values())


def compare(title: str, ways: dict, inputs: list[torch.Tensor], grad: torch.Tensor | tuple, params: dict, repeat: int,
            tokens: int) -> dict[str, float]:
    """Print one part's lines; the best seconds of each way."""
    best: dict[str, float] = {}
    for name, fn in ways.items():  # first calls (the compile) outside the timing
        forward_backward(fn, inputs, grad, params.get(name, ()))
    for _ in range(2):
        for name, fn in ways.items():
            best[name] = min(best.get(name, float("inf")),
                             best_of(lambda: forward_backward(fn, inputs, grad, params.get(name, ())), repeat))
    first = next(iter(ways))
    print(f"  {title}")
    for name, fn in ways.items():
        ops = "" if "compiled" in name else f"  {dispatched(lambda: forward_backward(fn, inputs, grad)):3d} operators"
        print(f"    {name:<24} {1e3 * best[name]:9.3f} ms  {best[name] / best[first]:5.2f}x{ops or ' ' * 15}"
              f"  kept {kept_bytes(fn, inputs, tokens) / tokens / 1000:6.2f} KB a token")
    want = forward_backward(ways[first], inputs, grad, params.get(first, ()))
    for name in list(ways)[1:]:
        got = forward_backward(ways[name], inputs, grad, params.get(name, ()))
        diffs = ", ".join(f"{(a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30):.2e}"
                          for a, b in zip(got, want))
        print(f"    {name}: largest relative difference of output and gradients against {first}: {diffs}")
    return best


def compiled_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU as a compiled MLP runs it."""
    _token_dims_any_size(gate)
    _token_dims_any_size(up)
    return _run(silu_mul, gate, up)


def compare_rotary(hf: dict, tokens: int, device: str, g: torch.Generator, repeat: int) -> dict[str, float]:
    """The rotary embedding of one packed micro-batch's query and key, as the attention has them:
    ``[1, heads, tokens, head_dim]`` views of the projections' ``[1, tokens, heads * head_dim]``,
    with bf16 ``cos`` and ``sin`` (the replica's, :mod:`resilient_rl.models.precision`)."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    apply = getattr(apply_rotary_pos_emb, "rrl_original", apply_rotary_pos_emb)
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    dim = hf["hidden_size"] // heads

    def laid_out(n: int) -> torch.Tensor:
        return torch.randn(1, tokens, n * dim, generator=g, device=device).to(torch.bfloat16).view(
            1, tokens, n, dim).transpose(1, 2)

    q, k = laid_out(heads), laid_out(kv_heads)
    angles = torch.rand(1, tokens, dim, generator=g, device=device) * 6.3
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    grads = (laid_out(heads), laid_out(kv_heads))
    return compare(f"rotary embedding ({heads} query and {kv_heads} key heads of {dim}, bf16)",
                   {"Hugging Face's function": lambda a, b: apply(a, b, cos, sin),
                    "compiled": lambda a, b: _compiled_rotary(a, b, cos, sin)}, [q, k], grads, {}, repeat, tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsm8k-1.5b")
    p.add_argument("--tokens", type=int, default=20992, help="tokens of the micro-batch (default: 20,992)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    hf = WORKLOADS[args.workload].hf_config
    hidden, inter, eps, t = hf["hidden_size"], hf["intermediate_size"], hf["rms_norm_eps"], args.tokens
    g = torch.Generator(device=args.device).manual_seed(0)
    print(f"elementwise work of a {args.workload} block, {t} tokens, {args.device}, forward and backward "
          f"under bf16 autocast, best of {args.repeat}")
    eager, fused = norm_modules(hidden, eps, args.device)
    x = torch.randn(t, hidden, generator=g, device=args.device)
    grad = torch.randn(t, hidden, generator=g, device=args.device).to(torch.bfloat16)
    norm = compare(f"RMS norm (hidden {hidden}, fp32 in, bf16 out)",
                   {"Hugging Face's module": eager, "F.rms_norm": lambda h: F.rms_norm(h, (hidden,), eager.weight, eps),
                    "compiled": fused}, [x], grad,
                   {"Hugging Face's module": [eager.weight], "F.rms_norm": [eager.weight], "compiled": [fused.weight]},
                   args.repeat, t)
    rotary = compare_rotary(hf, t, args.device, g, args.repeat)
    gate, up = (torch.randn(t, inter, generator=g, device=args.device).to(torch.bfloat16) for _ in range(2))
    grad = torch.randn(t, inter, generator=g, device=args.device).to(torch.bfloat16)
    swiglu = compare(f"SwiGLU (intermediate {inter}, bf16)",
                     {"eager": lambda a, b: F.silu(a) * b, "compiled": compiled_swiglu}, [gate, up], grad, {},
                     args.repeat, t)
    before = 2 * norm["Hugging Face's module"] + rotary["Hugging Face's function"] + swiglu["eager"]
    after = 2 * norm["compiled"] + rotary["compiled"] + swiglu["compiled"]
    print(f"  a block's two norms, rotary embedding and SwiGLU: eager {1e3 * before:.3f} ms, compiled "
          f"{1e3 * after:.3f} ms ({after / before:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
