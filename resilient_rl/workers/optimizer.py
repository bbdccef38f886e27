"""A trained role's optimizer (AdamW) and its learning-rate schedule.

AdamW runs fused where torch has its fused kernel for the parameters' device (CUDA and the CPU
among them): one pass over each parameter's weight, gradient and two moments, where the
multi-tensor (``foreach``) form makes a dozen passes (``python bench/optimizer.py``: 0.23x the
step's time on a 2-core CPU). Elsewhere it runs in the ``foreach`` form. Both forms compute the
same update within fp32 rounding.

The form is the optimizer's own, not its state's: a checkpoint carries the form it was written
with in its parameter groups (``fused``, ``foreach``), and a fused optimizer keeps each ``step``
count on the parameter's device where the other form keeps it on the host. After a load,
:func:`keep_built_form` puts back the form the optimizer was built with and moves the counts where
that form reads them, so a run resumed from a checkpoint of the other form (an older release's)
steps as a new one does.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

__all__ = ["build_optimizer", "build_scheduler", "keep_built_form", "lr_lambda", "step_scheduler"]


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, from an OptimConfig: fused where the parameters'
    device has the fused kernel, else in the ``foreach`` form."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay)
    if params and params[0].device.type in _fused_devices():
        return torch.optim.AdamW(params, fused=True, **kwargs)
    return torch.optim.AdamW(params, foreach=True, **kwargs)


def _fused_devices() -> tuple[str, ...]:
    """The device types for which this torch has AdamW's fused kernel."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return tuple(_get_fused_kernels_supported_devices())


def keep_built_form(optimizer: torch.optim.Optimizer) -> None:
    """After a load of ``optimizer``'s state: the form it was built with (``fused`` or
    ``foreach``, from its defaults) in every parameter group, and each parameter's ``step`` count
    where that form reads it (fused: a float32 tensor on the parameter's device; else on the host,
    where reading it costs no device synchronisation). No copy where both already hold."""
    fused = bool(optimizer.defaults.get("fused"))
    for group in optimizer.param_groups:
        for key in ("fused", "foreach"):
            if key in optimizer.defaults:
                group[key] = optimizer.defaults[key]
        if group.get("capturable"):
            continue  # a capturable optimizer keeps its counts on the device in either form
        for p in group["params"]:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            if torch.is_tensor(step):
                state["step"] = step.to(device=p.device if fused else "cpu", dtype=torch.float32)


def lr_lambda(optim_cfg, total_steps: int):
    """Linear warm-up, then constant, cosine or linear decay to ``min_lr_ratio`` of the peak."""
    warmup = optim_cfg.warmup_steps
    floor = optim_cfg.min_lr_ratio
    schedule = optim_cfg.schedule

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return f


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int):
    """A LambdaLR stepped once per training step (its state is just the step count)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim_cfg, total_steps))


def step_scheduler(scheduler, applied: int) -> None:
    """One LR-schedule step per training step, even when every update of the step was skipped
    (the schedule stays a function of the step; torch's order warning does not apply then)."""
    if applied:
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        scheduler.step()
