"""Generation throughput: the project's rollout engine vs Hugging Face ``generate`` and the plain mode.

One tiny Hugging Face causal LM built from a config (random weights, nothing downloaded; Llama- or
Qwen2-shaped), one batch of ``--prompts`` left-padded prompts x ``--n`` samples each, the same
``--new-tokens`` for every row (no eos, so every path generates the same number of tokens). Each
path runs ``--repeats`` times after one warm-up run; the median is reported as output tokens/s and
as a ratio against the engine, all measured in this run:

- ``engine``: :func:`resilient_rl.models.engine.generate_static` (static cache, one prefill per
  prompt, finish checks every 8 tokens, sampling on the device);
- ``hf``: ``model.generate(do_sample=True, num_return_sequences=n)`` with its default cache;
- ``plain``: :func:`resilient_rl.models.generation.generate`, the decode loop's plain mode, on the repeated batch.

    python bench/generation.py                         # Qwen2-shaped, 8 prompts x 4 samples, 64 + 64 tokens
    python bench/generation.py --arch llama --prompts 16 --n 8 --prompt-len 128
    python bench/generation.py --tiny                  # seconds; what the test runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resilient_rl.models.engine import generate_static  # noqa: E402
from resilient_rl.models.generation import generate  # noqa: E402

SHAPES = {  # (hidden, layers, heads, kv heads, intermediate, vocab)
    "default": (256, 4, 8, 2, 768, 4096),
    "tiny": (32, 2, 4, 2, 64, 128),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts (default: 8)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default: 4)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt columns, left-padded (default: 64)")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens per row (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path (default: 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch (seconds; for tests)")
    args = p.parse_args(argv)
    for name in ("prompts", "n", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tiny:
        args.prompts, args.n, args.prompt_len, args.new_tokens, args.repeats = 2, 2, 8, 6, 1
    return args


def build_model(arch: str, shape: str):
    """A random-weight HF causal LM built from a config, in eval mode."""
    import transformers

    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    cls = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    config = cls(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, intermediate_size=inter, max_position_embeddings=4096,
                 tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def make_batch(vocab: int, prompts: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths spread over [prompt_len/2, prompt_len]."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (prompts, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    for row in range(prompts):
        pad = (row * prompt_len // 2) // max(1, prompts - 1) if prompts > 1 else 0
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, kernels, lazy imports
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per path for the same model and batch."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.arch, "tiny" if args.tiny else "default")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids, mask = make_batch(model.config.vocab_size, args.prompts, args.prompt_len)
    rep_ids, rep_mask = ids.repeat_interleave(args.n, 0), mask.repeat_interleave(args.n, 0)
    rows, new = rep_ids.shape[0], args.new_tokens

    def engine():
        out = generate_static(model, rep_ids, rep_mask, max_new_tokens=new, temperature=1.0,
                              generator=torch.Generator().manual_seed(1))
        assert out.responses.shape == (rows, new)

    def hf():
        torch.manual_seed(1)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=new, min_new_tokens=new, num_return_sequences=args.n)
        assert out.shape == (rows, args.prompt_len + new)

    def plain():
        out = generate(model, rep_ids, rep_mask, max_new_tokens=new, temperature=1.0,
                       generator=torch.Generator().manual_seed(1))
        assert out.responses.shape == (rows, new)

    return {name: median_seconds(fn, args.repeats) for name, fn in (("engine", engine), ("hf", hf), ("plain", plain))}


def report(seconds: dict[str, float], output_tokens: int) -> list[str]:
    """Lines: output tokens/s per path and the engine's speed-up over each."""
    lines = []
    for name, s in seconds.items():
        ratio = "" if name == "engine" else f"   engine is {s / seconds['engine']:.2f}x faster"
        lines.append(f"  {name:<7}{1e3 * s:9.1f} ms  {output_tokens / s:9.0f} output tokens/s{ratio}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    seconds = run(args)
    rows = args.prompts * args.n
    print(f"{args.arch}{' (tiny)' if args.tiny else ''}: {args.prompts} prompts x n={args.n}, "
          f"prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("\n".join(report(seconds, rows * args.new_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
