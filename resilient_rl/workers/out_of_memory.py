"""A role's pass that runs out of device memory stops the run with what to change.

``torch.OutOfMemoryError`` says how much the allocator asked for and held, not which setting of
the run made the pass that large. A pass of a role worker decorated with :func:`names_memory_keys`
raises :class:`~resilient_rl.errors.DeviceMemoryError` instead: the pass, the device's memory at
the failure as torch's allocator counts it, the config keys that make that pass need less
(:func:`keys_for`, with the value the run used; for a model build, ``init_model``, the ranks and
sharding that let the model and its training state fit), then torch's own message. The error is not
retried, since the same pass needs the same memory again (a model build or a restore that finds the
GPU held by another process waits for that memory first: :mod:`resilient_rl.workers.held_memory`);
the run stops with its last checkpoint, which a resume with the keys changed continues (each key named
first is one a resume may change, :data:`resilient_rl.config.resume.RESUME_MAY_CHANGE`).
"""

from __future__ import annotations

import functools

import torch

from resilient_rl.errors import DeviceMemoryError
from resilient_rl.workers import held_memory
from resilient_rl.workers.held_memory import GIB


def names_memory_keys(method):
    """Decorate a role worker's pass (``self.cfg``, ``self.role``, ``self.engine``): running out of
    device memory raises :class:`DeviceMemoryError` (see the module's docs) from torch's error."""

    @functools.wraps(method)
    def pass_(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except torch.OutOfMemoryError as exc:
            plan = getattr(self, "_plan", None)  # the worker's device plan, which its engines are built with
            raise device_memory_error(exc, method.__name__, self.role, self.cfg, getattr(self, "engine", None),
                                      getattr(plan, "device", None)) from exc

    return pass_


def device_memory_error(exc: BaseException, call: str, role: str, cfg, engine,
                        device: torch.device | None = None) -> DeviceMemoryError:
    """The error of ``role``'s pass ``call`` that ran out of memory on ``device`` with ``exc``."""
    message = str(exc).strip()
    return DeviceMemoryError(f"ran out of GPU memory in {call}{_held(device)}. To need less: "
                             f"{keys_for(role, call, cfg, engine)}. torch: {message}", role=role)


def keys_for(role: str, call: str, cfg, engine) -> str:
    """The config keys that lower the memory of ``role``'s pass ``call``, with the values the run
    used: first those a resume may change, then those only a new run may (they shape the data)."""
    colocated = cfg.trainer.placement == "colocated"
    rows = f"{cfg.data.batch_size} x {cfg.rollout.n} rows"
    new_run: list[str] = []
    if call == "init_model":  # the model, and a trained role's optimizer state, do not fit
        keys = _build_keys(role, cfg, colocated)
    elif role in ("actor", "critic"):
        section = getattr(cfg, role)
        tokens = getattr(engine, "micro_batch_tokens", None)
        planned = getattr(engine, "memory_plan", None) is not None
        if tokens is None:
            keys = [f"{role}.micro_batch_tokens (now unset: a whole mini-batch in one pass)"]
        else:
            keys = [f"{role}.micro_batch_tokens below {tokens}" + (" (micro_batch_tokens=auto chose it)" if planned
                                                                     else "")]
        if call.startswith("update") and not section.activation_checkpointing:
            keys.append(f"{role}.activation_checkpointing=true")
    elif role == "ref":  # a rank's share of the batch in one pass, with the model's full weights
        keys = [] if cfg.ref.reshard_after_forward else ["ref.reshard_after_forward=true"]
        if not colocated:
            keys.append(f"ref.world_size (its ranks share the {rows})")
        new_run = ["data.batch_size", "rollout.n"]
    else:  # the rollout: its KV cache holds a rank's rows to the longest prompt and response
        keys = [] if colocated else [f"rollout.world_size (its ranks share the {rows} of the KV cache)"]
        new_run = ["data.batch_size", "rollout.n", f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens})"]
    if colocated:
        keys.append("trainer.placement=split (every role now shares this GPU)")
    text = ", ".join(keys) or ("" if new_run else "a GPU with more memory (no key of the run changes this pass's)")
    if new_run:
        text += ("; " if keys else "") + f"in a new run, {', '.join(new_run)}"
    return text


def _build_keys(role: str, cfg, colocated: bool) -> list[str]:
    """What lets ``role``'s model (and training state) fit: more ranks to shard it over (FSDP2; in
    the colocated placement the actor's world size is every role's), sharded rather than replicated.
    The rollout holds whole weights on every rank: only the placement helps it."""
    keys = []
    if colocated:
        keys.append(f"actor.world_size (now {cfg.actor.world_size}; every role's ranks)")
    elif role != "rollout":
        ranks = getattr(cfg, role).world_size
        keys.append(f"{role}.world_size (now {1 if ranks is None else ranks})")  # unset: 1 when split
    if role in ("actor", "critic") and getattr(cfg, role).strategy == "ddp":
        keys.append(f"{role}.strategy=fsdp (ddp keeps the whole state on every rank)")
    return keys


def _held(device: torch.device | None) -> str:
    """``; torch held A GiB allocated, R GiB reserved of the device's T GiB`` on a CUDA
    ``device``, with what other processes held where that is more than a CUDA context
    (:mod:`resilient_rl.workers.held_memory`); empty elsewhere, or where CUDA cannot say."""
    if device is None or device.type != "cuda":
        return ""
    try:
        stats = torch.cuda.memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
    except (RuntimeError, AssertionError):
        return ""
    memory = held_memory.device_memory(device)  # looked up at each call: a test fakes the device
    outside = "" if memory is None or memory.outside < held_memory.OUTSIDE_FLOOR else \
        f", and {memory.outside / GIB:.1f} GiB was held outside this process (another process on this GPU)"
    return (f"; torch held {stats.get('allocated_bytes.all.current', 0) / GIB:.1f} GiB allocated, "
            f"{stats.get('reserved_bytes.all.current', 0) / GIB:.1f} GiB reserved of the device's "
            f"{total / GIB:.1f} GiB{outside}")
