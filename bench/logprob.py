"""The log-prob and update passes of a Qwen2.5-shaped policy: chosen-token log-probs in chunks
(resilient_rl/workers/logprob.py) against full-vocabulary logits, in the same run.

For each variant it times the no-grad log-prob pass and a forward + backward of
``sum(log_prob) + sum(entropy)`` (the update's shape of work) and, on CUDA, reads the peak of
allocated memory. Variants: ``full`` (``[B, T, V]`` logits, then log-softmax, as before),
``chunked``, ``chunked+ckpt`` (activation checkpointing of every block), ``chunked+packed`` (the
rows' real tokens in one row, no padding computed), ``chunked+head`` (the head's reductions
compiled, ``actor.compile_head``; its warm-up call compiles) and, with ``--compile``,
``chunked+compile`` (``torch.compile``'d blocks; its warm-up call compiles). Random weights, built
from the config; nothing is downloaded. Prints each figure and its ratio to ``full``.
``--shape qwen-vocab`` puts Qwen's 151,936-id vocabulary behind a small body, so that the head
takes its full-size share of the passes on a CPU. ``--head-rows N`` times the head alone instead
over ``--head-chunks K`` chunks of N rows (default 1), forward and backward: the chunked head eager
and compiled, each chunk as its own ``F.linear`` (before it), and the matrix products alone;
``--bf16`` computes in bf16 under autocast on a CPU, as a GPU does.

    python bench/logprob.py                                # CPU, tiny shape
    python bench/logprob.py --ragged                       # responses of different lengths
    python bench/logprob.py --shape qwen2.5-1.5b --batch 8 --prompt 256 --response 512   # one GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
try:
    import ray  # noqa: F401  (the library's root package imports Ray)
except ImportError:
    # A GPU image without Ray: load the library's modules without its Ray-facing root package.
    package = types.ModuleType("resilient_rl")
    package.__path__ = [str(ROOT / "resilient_rl")]
    sys.modules["resilient_rl"] = package

from resilient_rl.workers.block_options import apply_block_options  # noqa: E402
from resilient_rl.workers.logprob import full_response_logprobs, response_logprobs  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096),
    # Qwen's vocabulary behind a small body: the head's share of the passes as at full size, on a CPU.
    "qwen-vocab": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
}


def build(shape: str, device: torch.device, checkpointing: bool, compile: bool = False) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", max_position_embeddings=4096, tie_word_embeddings=True,
                                  rope_theta=1e6, **SHAPES[shape])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # fp32 master weights
    return apply_block_options(model, activation_checkpointing=checkpointing, compile=compile)


def batch(vocab: int, rows: int, prompt: int, response: int, device: torch.device,
          ragged: bool = False) -> dict[str, torch.Tensor]:
    """Rows of left-padded prompts and responses; ``ragged``: responses that end at different
    lengths (an eighth of ``response`` to all of it, right-padded), as a rollout's do."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):  # left padding of varied length, as a batch of prompts has
        mask[r, :(r * 37) % (prompt // 2)] = 0
        if ragged:
            mask[r, prompt + int(torch.randint(max(1, response // 8), response + 1, (), generator=g)):] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, position_ids=pos,
                                               responses=ids[:, prompt:]).items()}


def measure(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """(median seconds, peak allocated GiB on CUDA else nan) over ``repeats`` calls after one warm-up."""
    fn()
    times, peak = [], float("nan")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
    return statistics.median(times), peak


def head_alone(shape: str, rows: int, chunks: int, device: torch.device, dtype: torch.dtype, repeats: int) -> None:
    """The head alone over ``chunks`` chunks of ``rows`` rows, forward and backward: the chunked
    head (resilient_rl/workers/chunked_head.py) eager and compiled; before it, each chunk as its own
    ``F.linear`` and statistics, recomputed in the backward (under autocast, each chunk's product
    casts the fp32 weight again and sends the weight its own gradient); and the products alone."""
    from torch.utils.checkpoint import checkpoint

    from resilient_rl.testing.op_writes import writes_of_size
    from resilient_rl.workers.chunked_head import chunked_head_stats, fused_logit_stats, logit_stats

    vocab, hidden_size = SHAPES[shape]["vocab_size"], SHAPES[shape]["hidden_size"]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows * chunks, hidden_size, generator=g).to(device).requires_grad_(True)
    weight = (0.02 * torch.randn(vocab, hidden_size, generator=g)).to(device).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows * chunks,), generator=g).to(device)
    spans = [(s, s + rows) for s in range(0, rows * chunks, rows)]

    def stats_of(h, w, y):
        return logit_stats(torch.nn.functional.linear(h, w), y)

    compiled_stats_of = torch.compile(lambda h, w, y: fused_logit_stats(torch.nn.functional.linear(h, w), y),
                                      dynamic=True)

    def per_chunk(fn):
        return lambda: torch.cat([checkpoint(fn, hidden[s:e], weight, labels[s:e], use_reentrant=False)
                                  if chunks > 1 else fn(hidden[s:e], weight, labels[s:e]) for s, e in spans])

    def backward_of(fn):
        def run():
            hidden.grad = weight.grad = None
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                out = fn()
            out.float().sum().backward()
        return run

    cases = {"per-chunk F.linear": backward_of(per_chunk(stats_of)),
             "per-chunk, compiled": backward_of(per_chunk(compiled_stats_of)),
             "chunked head, eager": backward_of(lambda: chunked_head_stats(hidden, weight, None, labels, rows)),
             "chunked head, compiled": backward_of(lambda: chunked_head_stats(hidden, weight, None, labels, rows,
                                                                              compiled=True)),
             "matrix products alone": backward_of(
                 lambda: torch.cat([torch.nn.functional.linear(hidden[s:e], weight) for s, e in spans]))}
    times = {name: measure(fn, device, repeats)[0] for name, fn in cases.items()}
    base, before = times["matrix products alone"], times["per-chunk F.linear"]
    print(f"the head: {chunks} chunk(s) of {rows} rows x {vocab} ids, hidden {hidden_size}, forward + backward, "
          f"{device}, compute {dtype}, fp32 weight")
    for name, t in times.items():
        print(f"  {name:<24} {t:8.4f} s   {t / before:5.2f}x per-chunk F.linear   beyond the products: "
              f"{t - base:8.4f} s")
    # What each way writes at the weight's size (casts, gradients, their sums), eagerly: the
    # memory traffic that the matrix products' own output does not explain.
    for name in ("per-chunk F.linear", "chunked head, eager"):
        writes = writes_of_size(cases[name], weight.numel())
        total = sum(size for _, size in writes.values())
        print(f"  weight-sized writes, {name}: {total / 2**20:.0f} MiB ("
              + ", ".join(f"{op} {n}x" for op, (n, _) in sorted(writes.items())) + ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also a variant with torch.compile'd blocks")
    ap.add_argument("--ragged", action="store_true", help="responses that end at different lengths")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--head-rows", type=int, default=0,
                    help="time chunks of this many rows of the head alone (eager, compiled) and stop")
    ap.add_argument("--head-chunks", type=int, default=1, help="chunks of --head-rows rows (default: 1)")
    ap.add_argument("--bf16", action="store_true", help="compute in bf16 under autocast on the CPU too")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" or args.bf16 else torch.float32  # model.dtype=auto
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")) if device.type == "cpu" else torch.get_num_threads())
    if args.head_rows:
        head_alone(args.shape, args.head_rows, args.head_chunks, device, dtype, args.repeats)
        return
    data = batch(SHAPES[args.shape]["vocab_size"], args.batch, args.prompt, args.response, device, args.ragged)
    real = data["attention_mask"].cpu()
    print(f"shape {args.shape} ({SHAPES[args.shape]['num_hidden_layers']} layers, vocab "
          f"{SHAPES[args.shape]['vocab_size']}), batch {args.batch} x (prompt {args.prompt} + response "
          f"{args.response}{', ragged' if args.ragged else ''}; {int(real.sum())} real tokens of "
          f"{real.numel()}), {device}, compute {dtype}, fp32 master weights")
    results, values = {}, {}
    variants = [("full", False, False, False), ("chunked", True, False, False), ("chunked+ckpt", True, True, False),
                ("chunked+packed", "packed", False, False), ("chunked+head", "head", False, False)]
    if args.compile:
        variants.append(("chunked+compile", True, False, True))
    for name, chunked, ckpt, compiled in variants:
        model = build(args.shape, device, ckpt, compiled)
        fn = full_response_logprobs if not chunked else response_logprobs
        if chunked == "packed":
            def fn(model, data, device):  # noqa: E731 - the rows' real tokens in one row
                return response_logprobs(model, data, device, pack=True)
        elif chunked == "head":
            def fn(model, data, device):  # noqa: E731 - the head's reductions compiled (warm-up call compiles)
                return response_logprobs(model, data, device, compile_head=True)

        def logprob():
            with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                values[name] = fn(model, data, device)[0].float().cpu()

        def update():
            model.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logp, ent = fn(model, data, device)
            (logp.sum() + ent.sum()).backward()

        model.train(True)
        results[name] = measure(logprob, device, args.repeats) + measure(update, device, args.repeats)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results["full"]
    print(f"{'':14s} {'log-prob s':>11s} {'peak GiB':>9s} {'fwd+bwd s':>10s} {'peak GiB':>9s}   ratios to full "
          "(time log-prob, fwd+bwd; peak log-prob, fwd+bwd)")
    for name, (t_lp, m_lp, t_up, m_up) in results.items():
        print(f"{name:14s} {t_lp:11.4f} {m_lp:9.2f} {t_up:10.4f} {m_up:9.2f}   "
              f"{t_lp / base[0]:.2f}x {t_up / base[2]:.2f}x; {m_lp / base[1]:.2f}x {m_up / base[3]:.2f}x")
    valid = real[:, args.prompt:].bool()  # response tokens (a padded one's log-prob means nothing)
    packed_diff = (values["chunked+packed"] - values["full"])[valid].abs().max().item()
    print(f"max |packed - full| log-prob: {packed_diff:.3g}")
    head_diff = (values["chunked+head"] - values["chunked"])[valid].abs().max().item()
    print(f"max |chunked+head - chunked| log-prob: {head_diff:.3g}")
    diff = (values["chunked"] - values["full"])[valid].abs().max().item()
    print(f"max |chunked - full| log-prob: {diff:.3g} ({'bit-identical' if diff == 0 else 'compute dtype ' + str(dtype)})")


if __name__ == "__main__":
    main()
