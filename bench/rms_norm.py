"""A trained model's RMS norm, forward and backward: Hugging Face's (the Qwen2/Llama module, what the
trained roles run now) against torch's ``F.rms_norm`` (on CUDA one fused kernel each way, where
the input and weight dtypes match).

The input is a micro-batch of the residual stream as a replica's update has it (fp32 under bf16
autocast: ``--tokens`` x the workload's hidden size), the weight fp32; the output goes on in bf16,
as the replica's norms hand it on (``resilient_rl/models/precision.py``). In an update's counted
activation bytes the norms' fp32 writes are about 220 KB a token and layer of the 1.5 B shape's
445 outside the products (``bench/activation_bytes.py``); this times them. Both ways alternate,
best of ``--repeat``; it prints each time, the ratio, and the largest difference of outputs and
gradients. On a CPU both run decomposed (``F.rms_norm`` has no fused CPU kernel): a check of the
script.

    python bench/rms_norm.py --device cuda
    python bench/rms_norm.py --tokens 2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from decode_bench import best_of  # noqa: E402
from gpu_workloads import WORKLOADS  # noqa: E402


def hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Qwen2RMSNorm.forward, as written there."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def forward_backward(norm, x, weight, grad, eps):
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    out = norm(x, weight, eps).to(torch.bfloat16)  # handed on in autocast's dtype
    out.backward(grad)
    return out, x.grad, weight.grad


def dispatched(fn) -> list[str]:
    """The operators ``fn`` dispatches (views left out), in order: one fused operator each way
    where the device has the kernel, the decomposition's operators elsewhere."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in ("detach", "ones_like", "zeros_like"):
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        fn()
    return ops.names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsm8k-1.5b")
    p.add_argument("--tokens", type=int, default=20992, help="tokens of the micro-batch (default: 20,992)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    hidden = WORKLOADS[args.workload].hf_config["hidden_size"]
    eps = WORKLOADS[args.workload].hf_config["rms_norm_eps"]
    g = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(1, args.tokens, hidden, generator=g, device=args.device)
    weight = 1 + 0.1 * torch.randn(hidden, generator=g, device=args.device)
    grad = torch.randn(1, args.tokens, hidden, generator=g, device=args.device).to(torch.bfloat16)
    ways = {"hf": hf_norm, "torch": torch_norm}
    best: dict[str, float] = {}
    for _ in range(2):
        for name, norm in ways.items():
            best[name] = min(best.get(name, float("inf")),
                             best_of(lambda: forward_backward(norm, x, weight, grad, eps), args.repeat))
    (out_a, gx_a, gw_a), (out_b, gx_b, gw_b) = (forward_backward(n, x, weight, grad, eps) for n in ways.values())
    print(f"RMS norm of {args.tokens} tokens x {hidden} ({args.workload}), fp32 in, bf16 out, forward and backward, "
          f"{args.device}, best of {args.repeat}")
    print(f"  Hugging Face's module  {1e3 * best['hf']:8.3f} ms  1.00x")
    print(f"  F.rms_norm             {1e3 * best['torch']:8.3f} ms  {best['torch'] / best['hf']:.2f}x")
    for name, norm in ways.items():
        ops = dispatched(lambda: forward_backward(norm, x, weight, grad, eps))
        shown = ", ".join(ops) if len(ops) <= 6 else f"{', '.join(ops[:6])}, ..."
        print(f"  {name}: {len(ops)} operators forward and backward ({shown})")
    print(f"  largest difference: output {(out_a.float() - out_b.float()).abs().max().item():.2e}, "
          f"input gradient {(gx_a - gx_b).abs().max().item():.2e}, weight gradient "
          f"{(gw_a - gw_b).abs().max().item() / gw_a.abs().max().item():.2e} (relative)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
