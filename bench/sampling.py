"""The sampling pass of a decode step: the two-level inverse CDF of the compiled engine
(``resilient_rl.models.sampling.pick_from_weights``) against the full-width one (softmax, then a
running sum as wide as the vocabulary; what an eager pick uses), on the same logits and draws,
both compiled (``--eager``: neither).

Prints each one's time per call, the ratio, the bytes of the full-width running sum, and how often
the two pick the same token (they differ only where fp32 rounding puts a draw on a boundary).

    python bench/sampling.py                          # 64 rows x 151,936 ids (Qwen2.5's vocabulary)
    python bench/sampling.py --rows 512 --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from resilient_rl.models.sampling import pick_from_weights


def full_width(logits: torch.Tensor, temperature: float, draw: torch.Tensor) -> torch.Tensor:
    """Normalised probabilities and their running sum over the whole vocabulary."""
    cdf = torch.softmax(logits.float() / temperature, dim=-1).cumsum(dim=-1)
    return torch.searchsorted(cdf, draw * cdf[:, -1:], right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


def two_levels(logits: torch.Tensor, temperature: float, draw: torch.Tensor) -> torch.Tensor:
    """The compiled engine's pick without a nucleus filter."""
    logits = logits.float()
    return pick_from_weights(logits, draw, top=logits.amax(dim=-1, keepdim=True), temperature=temperature)


def timed(fn, logits, draw, repeats: int) -> float:
    for _ in range(3):
        fn(logits, 0.7, draw)  # compile and warm up
    sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(logits, 0.7, draw)
    sync()
    return (time.perf_counter() - t0) / repeats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--eager", action="store_true", help="compile neither pass")
    args = p.parse_args(argv)
    gen = torch.Generator(device=args.device).manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    logits = (torch.randn(args.rows, args.vocab, generator=gen, device=args.device) * 3).to(dtype)
    draw = torch.rand(args.rows, 1, generator=gen, device=args.device)
    wrap = (lambda f: f) if args.eager else (lambda f: torch.compile(f, dynamic=False))
    new_fn, base_fn = wrap(two_levels), wrap(full_width)
    base = timed(base_fn, logits, draw, args.repeats)
    new = timed(new_fn, logits, draw, args.repeats)
    same = (new_fn(logits, 0.7, draw) == base_fn(logits, 0.7, draw)).float().mean().item()
    print(f"{args.rows} rows x {args.vocab} ids on {args.device} ({'eager' if args.eager else 'compiled'}); "
          f"the full-width running sum is {args.rows * args.vocab * 4 / 1e6:.0f} MB of fp32")
    print(f"  full width (softmax, running sum)  {base * 1e3:8.3f} ms  1.00x")
    print(f"  two levels (blocks, then one)      {new * 1e3:8.3f} ms  {new / base:.2f}x")
    print(f"  the same token in {same:.1%} of rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
