"""The one mini-batch loop of the trained roles: PPO epochs of the policy and of the value model.

Both engines (:mod:`resilient_rl.workers.policy`, :mod:`resilient_rl.workers.value`) run the
same loop and differ only in the loss of a mini-batch (their ``accumulate``): the rank's share of
each mini-batch in an order that is a pure function of (seed, step), so a replay after a recovery
shuffles identically; token counts agreed over the group; gradients averaged, clipped, and the
update skipped where the gradient norm is not finite; one scheduler step per training step.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from resilient_rl.errors import CollectiveError
from resilient_rl.protocol import DataProto
from resilient_rl.runtime import progress
from resilient_rl.workers.allocator import AllocatorWindow
from resilient_rl.workers.fsdp import (all_reduce_gradients, check_gradients_reach, clip_grad_norm, global_token_counts,
                                       update_is_finite)
from resilient_rl.workers.host_to_device import to_device
from resilient_rl.workers.optimizer import step_scheduler

#: ``accumulate(mini_batch, response_mask, tokens, sequences, world, n_parts)``: forward and
#: backward of one mini-batch; its loss terms as ``(metric name, value)``.
Accumulate = Callable[[DataProto, torch.Tensor, torch.Tensor, torch.Tensor, int, int], list]


def dp_world_size() -> int:
    """The ranks this rank's update averages over: its process group's size.

    A rank of a group of several (``WORLD_SIZE``) whose process has no process group is a new
    process that has not joined its group yet (Ray restarted it without the controller knowing):
    its update raises a :class:`~resilient_rl.errors.CollectiveError`, so that the recovery rejoins
    its group, instead of training its replica alone on its share of the batch."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    expected = int(os.environ.get("WORLD_SIZE") or 1)
    if expected > 1:
        rank = int(os.environ.get("RANK") or 0)
        raise CollectiveError(f"rank {rank} of a group of {expected} has no process group: its process is new "
                              "and has not joined the group", rank=rank)
    return 1


def run_epochs(engine, data: DataProto, keys: list[str], seed: int, prefix: str,
               accumulate: Accumulate) -> dict[str, float]:
    """``engine.cfg.ppo_epochs`` epochs over mini-batches of ``data`` (this rank's share of
    ``cfg.mini_batch_size`` each, ``keys`` of it), shuffled by ``seed`` (unless ``cfg.shuffle`` is
    false: in order); one scheduler step.

    A mini-batch whose loss or gradient norm is NaN or Inf (on any rank) is not applied: its
    gradients are dropped, the optimizer does not step, and ``<prefix>/nonfinite_skipped`` counts
    it (its losses stay out of the reported means). Returns the mean of each loss term over the
    applied mini-batches, with ``<prefix>/grad_norm``, ``<prefix>/lr``, and on a GPU the
    allocator's account of the pass (:mod:`resilient_rl.workers.allocator`)."""
    cfg, model, optimizer = engine.cfg, engine.model, engine.optimizer
    # The phases are record_function ranges: a profile of the pass shows them (bench/device_idle.py).
    with record_function(f"{prefix}.prepare"):
        allocator = AllocatorWindow(engine.plan.device)
        world = dp_world_size()
        local_mb = max(1, cfg.mini_batch_size // world)
        model.train(True)
        mini_batches = list(data.select(batch_keys=keys).make_iterator(local_mb, cfg.ppo_epochs, seed=seed,
                                                                       dataloader_kwargs={"shuffle": cfg.shuffle}))
        masks = [to_device(mb.batch["response_mask"], engine.plan.device).float() for mb in mini_batches]
        counts = global_token_counts(masks).clamp(min=1.0)
        parts = engine._agreed_counts([mb.batch for mb in mini_batches])
    sums: dict[str, float] = {}
    n_updates = skipped = 0
    for mb, mask, (tokens, seqs), n_parts in zip(mini_batches, masks, counts, parts):
        progress.advance("mini-batch")
        terms = accumulate(mb, mask, tokens, seqs, world, n_parts)
        with record_function(f"{prefix}.clip"):
            check_gradients_reach(model, optimizer, prefix)
            all_reduce_gradients(model)
            grad_norm = clip_grad_norm(model, cfg.optim.grad_clip)
            finite = update_is_finite(grad_norm)
        with record_function(f"{prefix}.optimizer"):
            if finite:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if not finite:
            skipped += 1
            continue
        n_updates += 1
        for k, v in terms + [(f"{prefix}/grad_norm", grad_norm)]:
            sums[k] = sums.get(k, 0.0) + (v.detach().double() if torch.is_tensor(v) else float(v))
    with record_function(f"{prefix}.metrics"):
        step_scheduler(engine.scheduler, n_updates)
        model.train(False)
        metrics = {k: float(v) / max(1, n_updates) for k, v in sums.items()}
        metrics[f"{prefix}/lr"] = optimizer.param_groups[0]["lr"]
        metrics[f"{prefix}/nonfinite_skipped"] = float(skipped)
        planned = getattr(engine, "memory_plan", None)
        metrics.update(allocator.metrics(prefix, planned.peak_bytes if planned is not None else None))
    return metrics
