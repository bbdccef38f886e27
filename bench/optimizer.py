"""The optimizer step alone: AdamW's fused kernel against its multi-tensor (``foreach``) form.

Both run over the parameters of a gsm8k workload's model (its shapes, ``--layers`` of its blocks
and its embedding; Qwen ties the head to it), fp32 with fp32 gradients, as a trained role holds
them. Each form takes one untimed step (its moments are created there), then ``--repeat`` timed
steps; the best is printed, with the fused form's ratio to the ``foreach`` one and the largest
difference between the weights the two reach. The forms run alternately, twice each, so that a
noisy neighbour slows both.

    python bench/optimizer.py
    python bench/optimizer.py --workload gsm8k-1.5b --layers 28 --device cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from decode_bench import best_of  # noqa: E402
from gpu_workloads import WORKLOADS  # noqa: E402


def parameter_shapes(hf_config: dict, layers: int) -> list[tuple[int, ...]]:
    """The trained parameters' shapes of a Qwen2 model of ``hf_config`` with ``layers`` blocks."""
    h, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads, kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    d = h // heads
    block = [(h,), (heads * d, h), (heads * d,), (kv * d, h), (kv * d,), (kv * d, h), (kv * d,), (h, heads * d),
             (h,), (inter, h), (inter, h), (h, inter)]
    return [(hf_config["vocab_size"], h)] + block * layers + [(h,)]


def timed_steps(kind: str, shapes, device: str, repeat: int) -> tuple[float, list[torch.Tensor]]:
    """Best seconds of one AdamW step in form ``kind``, and the weights after all steps."""
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device=device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=device) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **{kind: True})
    opt.step()
    return best_of(opt.step, repeat), [p.detach() for p in params]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsm8k-0.5b")
    p.add_argument("--layers", type=int, default=2, help="blocks of the model (default: 2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="the workload's tiny dimensions (a check of the script)")
    args = p.parse_args(argv)
    w = WORKLOADS[args.workload].tiny() if args.tiny else WORKLOADS[args.workload]
    shapes = parameter_shapes(w.hf_config, args.layers)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"AdamW over {len(shapes)} tensors, {n / 1e6:.1f} M parameters ({w.name}, {args.layers} blocks), "
          f"{args.device}, best of {args.repeat}")
    best: dict[str, float] = {}
    weights = {}
    for kind in ("foreach", "fused", "foreach", "fused"):
        seconds, weights[kind] = timed_steps(kind, shapes, args.device, args.repeat)
        best[kind] = min(best.get(kind, float("inf")), seconds)
    diff = max((a - b).abs().max().item() for a, b in zip(weights["foreach"], weights["fused"]))
    print(f"  foreach {1e3 * best['foreach']:8.1f} ms  1.00x")
    print(f"  fused   {1e3 * best['fused']:8.1f} ms  {best['fused'] / best['foreach']:.2f}x")
    print(f"  largest weight difference after {args.repeat + 1} steps: {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
