"""The actor's update pass alone, at a workload's shape: its MFU (the project's FLOP count and
verl's) and where the device's time goes.

The trainer's own engine (``resilient_rl/workers/policy.py``) as a one-rank actor of the workload
runs it: fp32 master weights under bf16 autocast on a GPU, the workload's actor config (packed
rows, the chunked log-prob head, AdamW) and ``micro_batch_tokens=auto`` planned beside the
workload's ref and rollout, as in ``bench/gpu.py``. Its weights are random, drawn on the device
(:func:`random_weights`). The rows hold random tokens, and their prompts
and responses vary in length (from half of ``--prompt`` and ``--response`` to all of it), as a
rollout's do. One update is one optimizer step over one mini-batch of all the rows.

It prints the memory plan, then the seconds and MFU of the log-prob pass and of the update. Then
it prints a profile of one update:
- the device's time by kind of work (matrix products, attention, copies and casts, optimizer,
  the rest);
- the share of the update's wall time in which the device computed nothing (time spent
  launching, synchronising and in Python);
- the longest kernels;
- the heaviest copies and casts, and elementwise operators, each at its input shapes;
- where the device idled: by the phase of the update the host was in, the longest gaps with the
  operator that ended each, and the host calls that waited for the device (``bench/device_idle.py``).
``--trace PATH`` also writes the profiled update's trace (Chrome's JSON; gzipped where PATH ends in
``.gz``), so that it can be read again without a GPU.

On a GPU the update's line also gives what the caching allocator reserved at its peak and how
often it had to free its cache and retry ``cudaMalloc`` (each retry a device synchronisation).

Each ``--variant NAME=KEY=VALUE[,KEY=VALUE]`` (a config override, e.g.
``ckpt=actor.activation_checkpointing=true``) is timed after the workload's own config in the
same run, with its ratio to it. Without a GPU, the workload runs at its tiny dimensions on the
CPU (the log-prob head, the norms, rotary embedding and SwiGLU compiled, as on a GPU), as a check
of the script only.

    python bench/update_mfu.py --workload gsm8k-1.5b --rows 64 --prompt 512 --response 1024
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from decode_bench import synchronize  # noqa: E402
from device_idle import idle_lines  # noqa: E402
from gpu_workloads import (WORKLOADS, Workload, actor_section, device_specs, flop_params, mfu,  # noqa: E402
                           pass_flops, random_weights)

#: Kinds of device work, by the name of the operator that launched it (``aten::`` left out),
#: matched in this order; what matches none is "elementwise and reductions".
KINDS = (
    ("attention", lambda op: any(w in op for w in ("attention", "flash", "varlen", "fmha"))),
    ("matrix products", lambda op: op in {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv",
                                          "addmv", "dot", "_scaled_mm", "_grouped_mm"}),
    ("optimizer", lambda op: op.startswith("_foreach_") or "adam" in op),
    ("collectives", lambda op: any(w in op for w in ("nccl", "all_gather", "reduce_scatter", "all_reduce", "c10d"))),
    ("copies and casts", lambda op: op in {"copy_", "_to_copy", "to", "cat", "clone", "contiguous", "index",
                                           "index_select", "index_put_", "_index_put_impl_", "gather", "scatter",
                                           "scatter_", "scatter_add_", "nonzero", "masked_select", "fill_",
                                           "zero_", "zeros_like", "split_with_sizes_copy", "_chunk_cat", "stack",
                                           "embedding", "embedding_dense_backward", "new_zeros"}),
)
OTHER = "elementwise and reductions"


def kind_of(op: str) -> str:
    """The kind of work of the operator named ``op`` (``aten::mm``, ``mm``, ...; see :data:`KINDS`)."""
    name = op.split("::", 1)[-1].lower()
    return next((kind for kind, matches in KINDS if matches(name)), OTHER)


def operator_seconds(e, cuda: bool) -> float:
    """Seconds of device time (on a CPU: of its own CPU time) of a profile's operator event; 0 for
    a device event, and for a record_function range (the trainer's phases), which is not an
    operator: its own CPU time is Python."""
    from torch.autograd import DeviceType

    if e.device_type != DeviceType.CPU or getattr(e, "is_user_annotation", False):
        return 0.0
    return (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6


def device_split(events, cuda: bool) -> tuple[dict[str, float], list[tuple[str, float]], float]:
    """From a profile's averaged events: seconds of device time by kind (each operator's own
    kernels, so nothing is counted twice), the longest kernels (seconds), and the device's busy
    seconds (the kernels' sum). On a CPU the "device" is the operators' own CPU time, and the
    "kernels" are the operators."""
    from torch.autograd import DeviceType

    kinds: dict[str, float] = {}
    ops: list[tuple[str, float]] = []
    for e in events:
        own = operator_seconds(e, cuda)
        if own > 0:
            kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0.0) + own
            ops.append((e.key, own))
    if cuda:
        # A record_function range (the optimizer's step, say) also shows on the device's timeline
        # under its own name: only the kernels, never named like a CPU event, are summed.
        cpu_names = {e.key for e in events if e.device_type == DeviceType.CPU}
        ops = [(e.key, e.self_device_time_total / 1e6) for e in events
               if e.device_type == DeviceType.CUDA and e.key not in cpu_names and e.self_device_time_total > 0]
    ops.sort(key=lambda kv: -kv[1])
    return kinds, ops, sum(s for _, s in ops)


def heaviest_by_shape(events, cuda: bool, kinds=("copies and casts", OTHER), top: int = 5) -> list[str]:
    """For each of ``kinds``, the operators (at one set of input shapes each: a profile's
    averages grouped by input shape) that took the most device time, with their calls."""
    rows: dict[str, list] = {}
    for e in events:
        own = operator_seconds(e, cuda)
        if own > 0 and kind_of(e.key) in kinds:
            rows.setdefault(kind_of(e.key), []).append((own, e.key, e.input_shapes, e.count))
    lines = []
    for kind in kinds:
        lines.append(f"  heaviest {kind}, by input shapes:")
        for own, key, shapes, count in sorted(rows.get(kind, []), key=lambda r: -r[0])[:top]:
            shown = ", ".join(str(list(s)) for s in shapes if s) or "-"
            lines.append(f"    {1e3 * own:9.1f} ms  {count:5d} calls  {key.split('::', 1)[-1]} {shown[:90]}")
    return lines


def profile_lines(kinds: dict[str, float], kernels: list[tuple[str, float]], busy: float, wall: float,
                  top: int = 8) -> list[str]:
    """The profile's report: time by kind as a share of the wall time, the idle share, the top kernels."""
    lines = [f"  device time by kind of work, over an update of {1e3 * wall:.0f} ms (median of the timed ones):"]
    for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {kind:<28} {1e3 * seconds:9.1f} ms  {100 * seconds / wall:5.1f} %")
    idle = max(0.0, wall - busy)
    lines.append(f"    {'idle (launches, syncs, Python)':<28} {1e3 * idle:9.1f} ms  {100 * idle / wall:5.1f} %")
    lines.append(f"  longest {min(top, len(kernels))} of {len(kernels)} kernels:")
    lines += [f"    {1e3 * s:9.1f} ms  {name[:100]}" for name, s in kernels[:top]]
    return lines


def ragged_rows(rows: int, prompt: int, response: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` rows as the trainer lays them out: prompts left-padded to ``prompt``, responses
    right-padded to ``response``, each between half its maximum and all of it; random ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, vocab, (rows, prompt + response), generator=g)
    p_len = torch.randint(max(1, prompt // 2), prompt + 1, (rows,), generator=g)
    r_len = torch.randint(max(1, response // 2), response + 1, (rows,), generator=g)
    cols = torch.arange(prompt + response)
    mask = ((cols >= prompt - p_len[:, None]) & (cols < prompt + r_len[:, None])).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt:] * mask[:, prompt:], "response_mask": mask[:, prompt:].clone()}


def update_flops(hf_config: dict, lengths: list[int], convention: str, training: bool = True) -> float:
    """Model FLOPs of one pass over sequences of ``lengths`` tokens (bench/gpu_workloads.py's formula)."""
    n = flop_params(hf_config, convention)
    heads = hf_config["num_attention_heads"]
    dims = (hf_config["num_hidden_layers"], heads, hf_config["hidden_size"] // heads)
    return sum(pass_flops(n, *dims, 1, s, training=training) for s in lengths)


def build_engine(w: Workload, rows: int, seq: int, device: str, overrides: list[str]):
    """The actor's engine of workload ``w`` (its config, with ``overrides``) for ``rows`` rows a mini-batch."""
    import yaml

    from resilient_rl.config.schema import load_config
    from resilient_rl.workers.fsdp import plan_device
    from resilient_rl.workers.policy import PolicyEngine

    section = {"model": {"kind": "hf", "hf_config": w.hf_config, "max_seq_len": seq},
               "actor": {**actor_section(w), "mini_batch_size": rows}, "critic": {"mini_batch_size": rows},
               "trainer": {"device": device},
               "data": {"batch_size": max(w.prompts, -(-rows // w.n))}, "rollout": {"n": w.n}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(section, f)
        f.flush()
        # On a CPU the head's reductions, the norms, rotary embedding and SwiGLU compile as on a GPU
        # (their default there); a variant may say otherwise.
        as_on_gpu = ["actor.compile_head=true", "actor.compile_elementwise=true"] if device == "cpu" else []
        cfg = load_config(f.name, as_on_gpu + overrides)
    plan = plan_device(cfg.trainer.device, cfg.model.dtype)
    # Beside the ref and the rollout's cache, as the workload's colocated actor is planned.
    engine = PolicyEngine(cfg.model, w.tokenizer_vocab, cfg.trainer.seed, plan, actor_cfg=cfg.actor, total_steps=100,
                          colocated=("ref", "rollout"), kv_rows=w.prompts * w.n, empty=True)
    random_weights(engine.model, cfg.trainer.seed)
    return engine


def compiled_state(compiles: bool, failure: dict) -> str:
    """Whether a compiled piece ran compiled: ``compiles`` as set, ``failure`` its process-wide record."""
    if not compiles:
        return "eager"
    return "compiled" if failure["reason"] is None else f"eager after a compiler failure: {failure['reason']}"


def timed(fn, repeats: int) -> tuple[list[float], object]:
    """Seconds of each of ``repeats`` calls of ``fn`` (after one untimed call), and what the last
    call returned."""
    result = fn()
    times = []
    for _ in range(repeats):
        synchronize()
        t0 = time.perf_counter()
        result = fn()
        synchronize()
        times.append(time.perf_counter() - t0)
    return times, result


def measure(w: Workload, args, device: str, overrides: list[str], profile: bool) -> dict:
    """Build the engine, time its log-prob pass and its update; profile one update if asked."""
    from resilient_rl.protocol import DataProto

    engine = build_engine(w, args.rows, args.prompt + args.response, device, overrides)
    if engine.memory_plan is not None:
        print(f"  {engine.memory_plan.line}", flush=True)
    batch = ragged_rows(args.rows, args.prompt, args.response, w.tokenizer_vocab)
    data = DataProto.from_dict(batch)
    logp = engine.compute_log_prob(data).batch["log_probs"]
    data.batch["old_log_probs"] = logp
    data.batch["ref_log_prob"] = logp
    data.batch["advantages"] = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    data.meta_info["seed"] = 0
    step = iter(range(1, 10_000))
    out = {"log_prob": timed(lambda: engine.compute_log_prob(data), args.repeats)[0]}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    out["update"], metrics = timed(lambda: engine.update(data, next(step)), args.repeats)
    out["metrics"] = {k: metrics[k] for k in ("actor/pg_loss", "actor/grad_norm", "actor/nonfinite_skipped")
                      if k in metrics}
    # On a GPU, what the caching allocator reserved and how often it freed its cache to retry.
    out["allocator"] = {k: metrics[k] for k in ("perf/actor_reserved_peak_bytes", "perf/actor_alloc_retries")
                        if k in metrics}
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    out["lengths"] = batch["attention_mask"].sum(-1).tolist()
    from resilient_rl.models.fused_elementwise import ELEMENTWISE_FAILURE
    from resilient_rl.workers.chunked_head import HEAD_FAILURE

    out["head"] = compiled_state(engine.compile_head, HEAD_FAILURE)
    out["elementwise"] = compiled_state(engine.compile_elementwise, ELEMENTWISE_FAILURE)
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        cuda = torch.cuda.is_available()
        with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                           record_shapes=True) as prof:
            engine.update(data, next(step))
            synchronize()
        out["profile"] = device_split(prof.key_averages(), cuda)
        out["idle"] = heaviest_by_shape(prof.key_averages(group_by_input_shape=True), cuda) + \
            idle_lines(prof.events(), cuda)
        if args.trace:  # for chrome://tracing or Perfetto; a name ending in .gz is compressed
            prof.export_chrome_trace(args.trace)
            out["idle"].append(f"  trace of the profiled update: {args.trace}")
    # The next variant is planned for a device this one no longer holds anything of.
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    if not (sep and name and "=" in overrides):
        raise SystemExit(f"--variant {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE]")
    return name, overrides.split(",")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsm8k-1.5b")
    p.add_argument("--rows", type=int, default=64, help="rows of the mini-batch (default: 64)")
    p.add_argument("--prompt", type=int, default=512, help="longest prompt (default: 512)")
    p.add_argument("--response", type=int, default=1024, help="longest response (default: 1024)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variant", action="append", default=[], type=parse_variant,
                   help="NAME=KEY=VALUE[,KEY=VALUE]: also time the update with these config overrides")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--trace", help="write the profiled update's trace here (Chrome JSON; .gz: compressed)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    w = WORKLOADS[args.workload] if cuda else WORKLOADS[args.workload].tiny()
    if not cuda:  # the tiny model's positions: a check of the script, not a figure
        args.prompt, args.response = min(args.prompt, 32), min(args.response, 48)
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    specs = device_specs(name) if cuda else None
    print(f"{w.name} on {name}: update of {args.rows} rows, prompts {args.prompt // 2}-{args.prompt} + responses "
          f"{args.response // 2}-{args.response} tokens, {w.layers} layers", flush=True)
    # Each run's lines are printed as soon as it is measured: a run stopped at its limit keeps them.
    base, lengths = None, None
    for label, overrides in [("workload", [])] + args.variant:
        if label != "workload":
            print(f"== variant {label}: {' '.join(overrides)}", flush=True)
        run = measure(w, args, "cuda" if cuda else "cpu", overrides, label == "workload" and not args.no_profile)
        if base is None:
            base, lengths = statistics.median(run["update"]), run["lengths"]
            print(f"  {sum(lengths)} tokens, {statistics.fmean(lengths):.0f} per row; N = "
                  f"{flop_params(w.hf_config, 'project') / 1e6:.4g} M (project) / "
                  f"{flop_params(w.hf_config, 'verl') / 1e6:.4g} M (verl); FLOPs 6·N·s + 12·L·H·D·s² per sequence "
                  "(training), a third of it forward")
        for pass_name, training in (("log-prob", False), ("update", True)):
            if label != "workload" and not training:
                continue
            secs = statistics.median(run["update" if training else "log_prob"])
            figures = " / ".join(f"{100 * mfu(update_flops(w.hf_config, lengths, c, training), secs, specs[0]):.1f}%"
                                 for c in ("project", "verl")) if specs else "n/a (peak unknown)"
            ratio = f", {secs / base:.2f}x the workload's" if label != "workload" else ""
            peak = f", peak {run['peak_gib']:.1f} GiB allocated" if training and cuda else ""
            if training and run["allocator"]:
                peak += (f", {run['allocator']['perf/actor_reserved_peak_bytes'] / 2**30:.1f} GiB reserved, "
                         f"{run['allocator']['perf/actor_alloc_retries']:.0f} cudaMalloc retries")
            print(f"{label} {pass_name} (head {run['head']}, norms, rotary and SwiGLU {run['elementwise']}): "
                  f"{1e3 * secs:.0f} ms, {sum(lengths) / secs:.0f} tokens/s, "
                  f"MFU (project / verl) {figures}{peak}{ratio}", flush=True)
        # A non-finite gradient skips the optimizer's step: such an update is not the one to time.
        print(f"{label} last update: " + ", ".join(f"{k} {v:.4g}" for k, v in run["metrics"].items()), flush=True)
        if "profile" in run:
            kinds, kernels, busy = run["profile"]
            print("\n".join(profile_lines(kinds, kernels, busy, base) + run["idle"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
