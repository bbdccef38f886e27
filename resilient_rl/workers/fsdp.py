"""FSDP2 wrapping, device and precision choice, gradient reduction and clipping.

The optimizer and its learning-rate schedule are :mod:`resilient_rl.workers.optimizer`'s.

On CUDA, ``fully_shard`` is applied to every transformer block, then to the root, as the FSDP2 docs
recommend: each block's parameters are gathered (and prefetched by NCCL while the previous block
computes) just before it runs and freed after. On CPU the model is one FSDP unit: gloo overlaps
nothing with compute and every collective costs a round of latency, so one all-gather and one
reduce-scatter per mini-batch beat one per block (measured: about 2x less CPU per update for the
tiny model on 2 ranks). ``model.dtype`` sets the compute dtype (:func:`plan_device`): by default
bf16 on CUDA with fp32 master weights, optimizer state and gradient reduction (FSDP2's
``MixedPrecisionPolicy``; autocast for a replica), and fp32 on CPU (gloo has no bf16 reductions
worth having, and fp32 keeps CPU runs bit-reproducible).

A role whose ranks span nodes is sharded over all of them (``trainer.sharding=full``) or, with
``hybrid`` (HSDP), within each node and replicated across nodes: a 2-D ``(replicate, shard)``
device mesh whose rows are the nodes (ranks are numbered node by node, ``LOCAL_WORLD_SIZE`` per
node), so parameters are gathered over the node's fast links and only gradients cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from resilient_rl import env
from resilient_rl.config.sections import MODEL_DTYPES, STRATEGIES
from resilient_rl.errors import ConfigError, GradientError
from resilient_rl.runtime import leave_collective
from resilient_rl.workers.allocator import grow_segments_in_place
from resilient_rl.models.factory import transformer_blocks
from resilient_rl.workers.shm_reduce import ReducerCache

#: The shared-memory reducers of this process's group (see :func:`all_reduce_gradients`).
_REDUCERS = ReducerCache()


@dataclass(frozen=True)
class DevicePlan:
    """Where a worker computes and in which precision."""

    device: torch.device
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    #: ``trainer.sharding``: ``full`` (FSDP over every rank) or ``hybrid`` (HSDP, see the module docstring).
    sharding: str = "full"

    @property
    def mixed_precision(self) -> bool:
        return self.param_dtype != self.reduce_dtype

    def autocast_enabled(self, model: nn.Module) -> bool:
        """Whether forwards of ``model`` run under autocast to ``param_dtype``: FSDP2 applies the
        mixed precision of a sharded model itself (its policy casts the gathered parameters); a
        replica keeps fp32 weights and computes in ``param_dtype`` under autocast."""
        return self.mixed_precision and not is_fsdp(model)


def _check_device(device: str) -> None:
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.device must be auto, cpu or cuda, got {device!r}")


def uses_cuda(device: str = "auto") -> bool:
    """Whether a worker with ``trainer.device=device`` computes on CUDA, decided without
    initialising CUDA (until it is, torch counts the visible devices through NVML), so that a
    process can still choose its devices afterwards (:mod:`resilient_rl.runtime.devices`)."""
    _check_device(device)
    return device == "cuda" or (device == "auto" and torch.cuda.device_count() > 0)


def plan_device(device: str = "auto", dtype: str = "auto", sharding: str = "full") -> DevicePlan:
    """Where and in which precision a worker computes: CUDA when there is a GPU (``auto`` or
    ``cuda``), else CPU; ``dtype`` (``model.dtype``) is the compute dtype: ``auto`` is bfloat16 on
    CUDA when the GPU supports it and float32 otherwise (CPU runs stay bit-reproducible).
    Gradients are reduced in float32 and the master weights stay float32 in every case.
    ``sharding`` (``trainer.sharding``): ``full`` or ``hybrid`` (HSDP across nodes).
    On CUDA it initialises CUDA on the current device, turns off cuDNN's attention kernels
    (:func:`exclude_cudnn_attention`) and lets the caching allocator grow its segments in place
    (:func:`resilient_rl.workers.allocator.grow_segments_in_place`)."""
    _check_device(device)
    if dtype not in MODEL_DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(MODEL_DTYPES)}, got {dtype!r}")
    if sharding not in ("full", "hybrid"):
        raise ConfigError(f"trainer.sharding must be full or hybrid, got {sharding!r}")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but torch sees no CUDA device")
        dev = torch.device("cuda", torch.cuda.current_device())
        exclude_cudnn_attention()
        grow_segments_in_place()
        bf16 = torch.cuda.is_bf16_supported()
        if dtype == "bfloat16" and not bf16:
            raise ConfigError(f"model.dtype=bfloat16 but {torch.cuda.get_device_name(dev)} has no bf16 support; "
                              "use model.dtype=float32")
        return DevicePlan(dev, torch.bfloat16 if dtype != "float32" and bf16 else torch.float32, torch.float32,
                          sharding)
    return DevicePlan(torch.device("cpu"), torch.bfloat16 if dtype == "bfloat16" else torch.float32, torch.float32,
                      sharding)


def exclude_cudnn_attention() -> None:
    """Keep ``scaled_dot_product_attention`` off cuDNN's fused kernels in this process: flash,
    memory-efficient and math remain. On an H200 (torch 2.11+cu130, cuDNN 9) the cuDNN backward
    failed inside a 1.5 B update (``mha_graph.execute(...).is_good()``); pytorch/pytorch#190321
    and #134001 report the same failure, and this setting as the way out of it."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def has_meta_parameters(model: nn.Module) -> bool:
    """Whether ``model`` was built empty (:func:`~resilient_rl.models.factory.parameters_on_meta`)."""
    return any(p.is_meta for p in model.parameters())


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Allocate the meta parameters of ``model`` (sharded ones as local shards) on ``device``,
    uninitialised, for a restore to fill; buffers keep their values (``to_empty`` alone would
    leave them uninitialised too)."""
    buffers = {name: b.detach().to(device) for name, b in model.named_buffers()}
    shared: dict[int, list[tuple[nn.Module, str]]] = {}  # tied parameters (an embedding and its LM head)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                shared.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for (owner, name), *others in (sites for sites in shared.values() if len(sites) > 1):
        for module, other in others:  # to_empty gives each site its own tensor: tie them again
            setattr(module, other, getattr(owner, name))
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    return model


def to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device``; an empty model gets its parameters allocated there, uninitialised."""
    return materialize(model, device) if has_meta_parameters(model) else model.to(device)


def wrap_fsdp2(model: nn.Module, plan: DevicePlan, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` over the default process group with FSDP2 (blocks first, then the root).

    Without an initialised process group (a single-process run) the model is returned unsharded on
    the device: FSDP over one rank only adds overhead. A model built empty is sharded on the meta
    device and each rank then allocates only its shard on the device, uninitialised: no rank
    ever holds or initialises the full model.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return to_device(model, plan.device)
    empty = has_meta_parameters(model)
    if not empty:
        model = model.to(plan.device)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = fsdp_mesh(plan)
    mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    if plan.device.type == "cuda":
        # Per block, so that NCCL gathers the next block's parameters while this one computes.
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return materialize(model, plan.device) if empty else model


def mesh_shape(sharding: str, world_size: int, local_world_size: int) -> tuple[int, ...]:
    """The FSDP device mesh's shape: ``(world,)`` for full sharding, or for ``hybrid``
    ``(nodes, ranks per node)``, one row per node (full sharding where the ranks are on one node)."""
    if sharding == "full" or local_world_size >= world_size:
        return (world_size,)
    if local_world_size < 1 or world_size % local_world_size:
        raise ConfigError(f"trainer.sharding=hybrid needs the same number of ranks on every node; world size "
                          f"{world_size} does not divide into nodes of {local_world_size}")
    return (world_size // local_world_size, local_world_size)


def fsdp_mesh(plan: DevicePlan):
    """The device mesh FSDP2 shards over in the default group (see :func:`mesh_shape`); a 2-D mesh
    makes ``fully_shard`` replicate over its first dimension and shard over its second (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    shape = mesh_shape(plan.sharding, world, int(env.get("LOCAL_WORLD_SIZE") or world))
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    with leave_collective.recording():  # a 2-D mesh opens subgroups' connections
        return init_device_mesh(plan.device.type, shape, mesh_dim_names=names)


def resolve_strategy(strategy: str, device: torch.device) -> str:
    """A role's data-parallel strategy on ``device``: ``auto`` is ``ddp`` on CPU, ``fsdp`` on CUDA."""
    if strategy == "auto":
        return "fsdp" if device.type == "cuda" else "ddp"
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    return strategy


def wrap_model(model: nn.Module, plan: DevicePlan, strategy: str = "fsdp",
               reshard_after_forward: bool = True) -> nn.Module:
    """``model`` on the device for data parallelism with ``strategy`` (see :func:`resolve_strategy`).

    ``fsdp``: sharded by :func:`wrap_fsdp2`. ``ddp``: a full replica on every rank, in the
    parameters' dtype; the caller averages its gradients with :func:`all_reduce_gradients` after
    each backward. It holds no process group, so it outlives a new generation's rendezvous.
    """
    if resolve_strategy(strategy, plan.device) == "ddp":
        return to_device(model, plan.device)
    return wrap_fsdp2(model, plan, reshard_after_forward=reshard_after_forward)


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (its registered parameters may be the gathered ones
    between a forward and the next reshard, so their type does not tell)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def all_reduce_gradients(model: nn.Module) -> None:
    """Average the gradients of a replicated model over the default group: one all-reduce of one
    flat buffer. A no-op for an FSDP2 model (it reduces its own) or without a group of 2 or more.

    A parameter without a gradient on this rank contributes zeros, so that every rank flattens the
    same list. Every rank then holds the same averaged bits (each element is reduced once and sent
    to all), so the replicas stay identical. CPU ranks that are all on one node average through
    shared memory (:mod:`resilient_rl.workers.shm_reduce`: one barrier instead of a ring of socket
    round trips); a group whose ranks span nodes (``LOCAL_WORLD_SIZE < WORLD_SIZE``: on different
    hosts no segment reaches every rank), and CUDA tensors, use one all-reduce of one flat buffer.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    if not params or isinstance(params[0], DTensor):
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if grads[0].device.type == "cpu" and spans_one_node():
        reducer = _REDUCERS.get(sum(g.numel() for g in grads), grads[0].dtype)
        if reducer is not None:
            reducer.average_(grads)
            return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))


def spans_one_node() -> bool:
    """Whether every rank of the default group runs on this rank's node (its ``LOCAL_WORLD_SIZE``,
    set by the worker group from the resource pool, is the whole world)."""
    world = dist.get_world_size()
    return int(env.get("LOCAL_WORLD_SIZE") or world) >= world


def reshard(model: nn.Module) -> nn.Module:
    """Put the parameters of an FSDP2 model back in their sharded form: FSDP2 keeps the root's
    parameters unsharded after a forward with no backward (log-probs), so until the next update
    ``named_parameters`` gives the gathered tensors, not the shards. A no-op when already sharded
    or not FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip gradients across all shards; returns the total norm before clipping (a 0-dim tensor, so
    that reading it does not force a device sync per mini-batch)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def check_gradients_reach(model: nn.Module, optimizer: torch.optim.Optimizer, role: str) -> None:
    """Raise :class:`~resilient_rl.errors.GradientError` where the backward gave ``model``'s
    registered parameters gradients and none to the ones ``optimizer`` steps.

    FSDP2 registers the gathered parameters for the forward and moves their gradients to the
    shards in its backward hooks; where those hooks do not run (torch 2.11's FSDP2 finds a root's
    output tensors by pytree, and missed those of an unregistered output class), the shards get no
    gradient and every optimizer step changes nothing, silently. Cheap: the first stepped
    parameter with a gradient ends the search."""
    if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
        return
    reached = sum(1 for p in model.parameters() if p.grad is not None)
    if reached:
        raise GradientError(f"{role} update: the backward gave {reached} parameters of {type(model).__name__} "
                            "gradients, but none reached the parameters the optimizer steps: the update would "
                            f"change nothing (torch {torch.__version__}; a model output the sharding wrapper "
                            "cannot see into keeps its backward hooks from running)")


def update_is_finite(grad_norm: torch.Tensor) -> bool:
    """Whether an update may be applied: its global gradient norm is finite.

    The norm from :func:`clip_grad_norm` is reduced over the group, so every rank reads the same
    value and all step or all skip together, without a collective of their own. A rank whose loss
    is not finite poisons the gradients it reduces into every shard, hence the norm; a non-finite
    loss with finite gradients (``inf * 0`` in a masked term) changes no weight and is flagged from
    the step's metrics by the controller."""
    return bool(torch.isfinite(grad_norm))


def full_state_dict(model: nn.Module, all_ranks: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded parameters on CPU (a collective when the model is sharded).

    ``all_ranks`` gives every rank the full tensors (colocated weight sync); otherwise only rank 0
    gets them and the others an empty dict.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    opts = StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)
    sd = get_model_state_dict(model, options=opts)
    return {k: v.detach().to("cpu") for k, v in sd.items()}


def global_token_counts(masks: list[torch.Tensor]) -> torch.Tensor:
    """For each mini-batch mask, its valid tokens and its sequences with at least one valid token,
    summed over the data-parallel group: a ``[len(masks), 2]`` float64 tensor from one all-reduce
    for all of them (instead of one per mini-batch)."""
    counts = torch.stack([torch.stack([m.sum().to(torch.float64), m.bool().any(dim=-1).sum().to(torch.float64)])
                          for m in masks])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    return counts


def agreed_counts(counts: list[int], model: nn.Module, device: torch.device) -> list[int]:
    """The number of micro-batches every rank runs for each mini-batch: the largest over the
    group, in one all-reduce, where ``model`` is sharded by FSDP2 (each forward and backward is a
    collective there: see :func:`resilient_rl.workers.micro_batch.cut_to`); ``counts`` unchanged
    for a replica (it reduces once per mini-batch, whatever each rank ran before)."""
    if not counts or not is_fsdp(model) or not (dist.is_available() and dist.is_initialized()) \
            or dist.get_world_size() == 1:
        return list(counts)
    agreed = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return [int(n) for n in agreed.tolist()]
