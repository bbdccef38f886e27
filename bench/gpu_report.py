"""The figures bench/gpu.py prints, from its measured steps: model FLOPs per phase, MFU against the
device's dense bf16 peak, NVML utilization, the weight sync against a plain copy, checkpoint stalls.

Pure functions (tested on CPU); the FLOP count is bench/gpu.py's docstring's.
"""

from __future__ import annotations

import statistics

from torch import nn

#: Dense bf16 tensor-core peak per device, matched in order against the CUDA device name.
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                   ("A100", 312e12))



def matmul_params(model: nn.Module) -> int:
    """Parameters used in matrix products: every parameter except those of embedding tables.

    A tied LM head is counted through the head (it multiplies), an untied input embedding is not
    (a lookup costs no FLOPs).
    """
    total = 0
    for module in model.modules():
        if not isinstance(module, nn.Embedding):
            total += sum(p.numel() for p in module.parameters(recurse=False))
    return total


def step_flops(n_params: int, tokens: float, *, ppo_epochs: int, need_ref: bool,
               critic_epochs: int | None = None, gen_tokens: float | None = None) -> dict[str, float]:
    """Model FLOPs of one step per phase (see the module docstring); ``critic_epochs`` None: no
    critic; ``gen_tokens``: the tokens the generation computes (default ``tokens``)."""
    fwd = 2.0 * n_params * tokens
    gen = 2.0 * n_params * (tokens if gen_tokens is None else gen_tokens)
    flops = {"gen": gen, "old_log_prob": fwd, "update_actor": 3.0 * fwd * ppo_epochs}
    if need_ref:
        flops["ref"] = fwd
    if critic_epochs is not None:
        flops["values"] = fwd
        flops["update_critic"] = 3.0 * fwd * critic_epochs
    return flops


def generated_tokens(rows: list[dict], tokens: float, prompts: int | None, samples: int) -> float | None:
    """Tokens the generation computes per step of ``prompts`` x ``samples`` rows: every response
    token, and each prompt's tokens once (a prompt's samples share its prefill), from the rows'
    mean response length; None where that is not known (then every row's prompt is counted)."""
    lengths = [r["response_length/mean"] for r in rows if "response_length/mean" in r]
    if not prompts or samples <= 1 or len(lengths) != len(rows):
        return None
    response = prompts * samples * statistics.fmean(lengths)
    return response + (tokens - response) / samples


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a device by its CUDA name; None when the table does not know it."""
    for key, peak in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def si(value: float, unit: str) -> str:
    """``value`` with an SI prefix: ``si(3.2e13, "FLOP/s")`` is ``'32.0 TFLOP/s'``."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.1f} {unit}"


def utilization_summary(readings: list[list]) -> dict[int, dict]:
    """Per CUDA index: mean and max utilization ratio and most memory used over NVML readings
    (lists of :class:`~resilient_rl.telemetry.device.GpuSample`); unreadable fields are skipped."""
    per: dict[int, dict] = {}
    for reading in readings:
        for s in reading:
            d = per.setdefault(s.index, {"uuid": s.uuid, "util": [], "memory": []})
            if s.utilization_ratio is not None:
                d["util"].append(s.utilization_ratio)
            if s.memory_used_bytes is not None:
                d["memory"].append(s.memory_used_bytes)
    return {i: {"uuid": d["uuid"], "samples": len(d["util"]),
                "mean_util": statistics.fmean(d["util"]) if d["util"] else None,
                "max_util": max(d["util"]) if d["util"] else None,
                "max_memory_bytes": max(d["memory"]) if d["memory"] else None}
            for i, d in sorted(per.items())}


def format_report(rows: list[dict], *, n_params: int, ppo_epochs: int, need_ref: bool,
                  critic_epochs: int | None, device_name: str, peak: float | None, n_gpus: int,
                  util: dict[int, dict], copy_s: float | None, stalls: list[tuple[int, float]],
                  prompts: int | None = None, samples: int = 1) -> list[str]:
    """The printed figures, as lines, from the measured steps' metrics rows and the side measurements.
    ``prompts`` (``data.batch_size``) x ``samples`` (``rollout.n``) rows a step: a prompt's samples
    share its one prefill."""
    from train import summarize  # bench/train.py (an importer puts bench/ on sys.path)

    s = summarize(rows)
    tokens = s["tokens_per_step"]
    gen_tokens = generated_tokens(rows, tokens, prompts, samples)
    flops = step_flops(n_params, tokens, ppo_epochs=ppo_epochs, need_ref=need_ref, critic_epochs=critic_epochs,
                       gen_tokens=gen_tokens)
    total_flops = sum(flops.values())
    lines = [f"{len(rows)} measured steps on {n_gpus} x {device_name}; model {n_params / 1e6:.1f} M matmul params; "
             f"{tokens:.0f} tokens/step",
             f"tokens/s: {s['tokens_per_s']:.0f}   mean step: {1e3 * s['step_s']:.1f} ms   "
             f"median step: {1e3 * s['median_step_s']:.1f} ms",
             "phase share of step time, % (mean ms, achieved model FLOP/s):"]
    for phase, share in s["share"].items():
        if share == 0 and phase not in flops:
            continue
        secs = s["phase_s"][phase]
        rate = si(flops[phase] / secs, "FLOP/s") if phase in flops and secs > 0 else ""
        lines.append(f"  {phase:<14}{share:6.1f}% ({1e3 * secs:9.1f} ms)  {rate:>14}".rstrip())
    lines.append("model FLOPs/step = 2NT x (old_log_prob" + (" + ref" if need_ref else "")
                 + (" + values" if critic_epochs is not None else "") + ") + 2NT_gen"
                 + f" + 6NT x {ppo_epochs} epochs"
                 + (f" + 6NT x {critic_epochs} critic epochs" if critic_epochs is not None else "")
                 + f" = {si(total_flops, 'FLOP')}"
                 + ("" if gen_tokens is None else f" (T_gen = {gen_tokens:.0f}: every response token and each "
                    f"prompt once, its {samples} samples sharing its prefill)"))
    achieved = total_flops / s["step_s"]
    if peak:
        lines.append(f"MFU: {100 * achieved / (peak * n_gpus):.2f}% ({si(achieved, 'FLOP/s')} over "
                     f"{n_gpus} x {si(peak, 'FLOP/s')} dense bf16 peak)")
    else:
        lines.append(f"MFU: n/a (no peak known for {device_name!r}; pass --peak-tflops); "
                     f"achieved {si(achieved, 'FLOP/s')}")
    for index, u in util.items():
        if u["mean_util"] is None:
            lines.append(f"GPU {index} ({u['uuid']}): utilization not readable")
            continue
        mem = f", memory used max {u['max_memory_bytes'] / 2**30:.1f} GiB" if u["max_memory_bytes"] else ""
        lines.append(f"GPU {index} ({u['uuid']}): utilization mean {100 * u['mean_util']:.0f}% "
                     f"max {100 * u['max_util']:.0f}% over {u['samples']} NVML samples{mem}")
    if not util:
        lines.append("GPU utilization: no NVML readings (pynvml missing or NVML unavailable)")
    lines.append(f"weight sync: {s['share']['weight_sync']:.1f}% of the step "
                 f"({1e3 * s['phase_s']['weight_sync']:.2f} ms as the controller times it)")
    if s["weight_sync_worker_s"] is None:
        lines.append("weight sync vs plain copy: n/a (the workers report no weight-sync bytes)")
    elif copy_s:
        ws, phase_s = s["weight_sync_worker_s"], s["phase_s"]["weight_sync"]
        lines.append(f"weight sync / plain device copy of {s['weight_sync_bytes'] / 2**20:.1f} MiB "
                     f"({1e3 * copy_s:.3f} ms): worker-timed {ws / copy_s:.1f}x ({1e3 * ws:.3f} ms), "
                     f"controller-timed {phase_s / copy_s:.1f}x")
    if stalls:
        later = [stall for _, stall in stalls[1:]]
        first = f"first checkpoint save (step {stalls[0][0]}) stalled {1e3 * stalls[0][1]:.1f} ms"
        lines.append(first + (f"; later saves median {1e3 * statistics.median(later):.1f} ms ({len(later)} saves)"
                              if later else "; no later save measured"))
    return lines
