"""Activation bytes an update writes outside its matrix products, counted, not timed: the
replica's RMS norms and rotary embedding handing on bf16 under autocast
(``resilient_rl/models/precision.py``) against handing on fp32 as before, in the same run.

One update of the trainer's own engine (``resilient_rl/workers/policy.py``: packed rows, the
chunked log-prob head, bf16 autocast over fp32 weights) at a workload's layer shape with
``--layers`` layers and a small vocabulary, on the CPU. A dispatch mode adds up the bytes of every
tensor an operator writes that has the tokens' dimension (activations, not weights), leaving out
the matrix products and the embedding. Elementwise work is bound by memory on a GPU, so these
bytes are its time there; the count is the same on any machine.

    python bench/activation_bytes.py --workload gsm8k-1.5b --layers 2 --rows 8
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import update_mfu  # noqa: E402
from gpu_workloads import WORKLOADS, Workload  # noqa: E402

#: Operators whose writes are not counted: the matrix products and the embedding.
PRODUCTS = {"mm", "addmm", "bmm", "embedding", "embedding_dense_backward"}


class Written(TorchDispatchMode):
    """Bytes written per operator into tensors with a dimension of ``tokens``."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens = tokens
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and self.tokens in t.shape:
                    self.bytes[func.overloadpacket.__name__] += t.numel() * t.element_size()
        return out


def count(w: Workload, rows: int, hand_on_bf16: bool) -> tuple[int, collections.Counter]:
    """Tokens of the batch and the bytes written per operator in one update."""
    import resilient_rl.workers.policy as policy
    from resilient_rl.protocol import DataProto

    original = policy.hand_on_in_autocast_dtype
    if not hand_on_bf16:
        policy.hand_on_in_autocast_dtype = lambda model: 0  # as before: nothing hooked
    try:
        torch.manual_seed(0)
        engine = update_mfu.build_engine(w, rows, w.prompt_len + w.max_new_tokens, "cpu",
                                         ["model.dtype=bfloat16", "actor.compile_head=false"])
    finally:
        policy.hand_on_in_autocast_dtype = original
    batch = update_mfu.ragged_rows(rows, w.prompt_len, w.max_new_tokens, w.tokenizer_vocab)
    tokens = int(batch["attention_mask"].sum())
    data = DataProto.from_dict(dict(batch))
    logp = engine.compute_log_prob(data).batch["log_probs"]
    data.batch["old_log_probs"] = logp
    data.batch["ref_log_prob"] = logp
    data.batch["advantages"] = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    data.meta_info["seed"] = 0
    written = Written(tokens)
    with written:
        engine.update(data, 1)
    return tokens, written.bytes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsm8k-1.5b")
    p.add_argument("--layers", type=int, default=2, help="layers of the workload's shape (default: 2)")
    p.add_argument("--vocab", type=int, default=8192, help="the model's vocabulary (default: 8192)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128, help="longest prompt (default: 128)")
    p.add_argument("--response", type=int, default=256, help="longest response (default: 256)")
    args = p.parse_args(argv)
    base = WORKLOADS[args.workload]
    config = {**base.hf_config, "num_hidden_layers": args.layers, "vocab_size": args.vocab}
    w = Workload(base.name, config, prompts=args.rows, n=1, prompt_len=args.prompt, max_new_tokens=args.response,
                 tokenizer_vocab=min(args.vocab, base.tokenizer_vocab))
    totals = {}
    for name, hand_on in (("norms and rotary fp32 (before)", False), ("norms and rotary bf16", True)):
        tokens, written = count(w, args.rows, hand_on)
        outside = {k: v for k, v in written.items() if k not in PRODUCTS}
        totals[name] = sum(outside.values()) / tokens
        top = ", ".join(f"{k} {v / tokens / 1e3:.0f}" for k, v in collections.Counter(outside).most_common(6))
        print(f"{name}: {totals[name] / 1e3:.0f} KB a token written outside the products ({tokens} tokens, "
              f"{args.layers} layers of {w.name}); KB a token by operator: {top}", flush=True)
    before, after = totals.values()
    print(f"ratio: {after / before:.2f}x")


if __name__ == "__main__":
    main()
