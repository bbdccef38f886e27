"""The four roles as Ray workers: actor, critic, ref and rollout.

Each role is a :class:`~resilient_rl.Worker` whose ``@register``-ed methods the controller calls
through a worker group. A role builds its model in ``init_model`` (after the controller's
rendezvous, because FSDP2 needs the process group). In the colocated placement every role shares
one process per device (``create_colocated_worker_cls``) and the actor writes its weights into the
rollout's parameters on the device (:mod:`~resilient_rl.workers.weight_sync`); in the split
placement actor rank 0 broadcasts them over a weight channel
(:mod:`~resilient_rl.workers.weight_channel`) or returns them for Ray's object store.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import time
from types import MappingProxyType
from typing import Any

import ray
import torch

from resilient_rl.workers.determinism import apply_deterministic
from resilient_rl.runtime.rank_host import host_of
from resilient_rl.runtime.dispatch import Dispatch, register
from resilient_rl.runtime.worker import RankWorker, wait_warm_up
from resilient_rl.workers.compile_cache import CompileCache
from resilient_rl.runtime.health import HEALTH_GROUPS
from resilient_rl.protocol import DataProto
from resilient_rl.config.schema import config_from_dict
from resilient_rl.workers.weight_parts import WeightReceiver, WeightSender
from resilient_rl.workers.checkpointing import RankCheckpointer
from resilient_rl.workers.rank_state import states_of
from resilient_rl.workers.snapshots.parts import SNAPSHOT_PARTS, attach_snapshot_parts
from resilient_rl.workers.fsdp import DevicePlan, plan_device, resolve_strategy, uses_cuda
from resilient_rl.workers.logprob import compiles_head
from resilient_rl.models.fused_elementwise import compiles_elementwise
from resilient_rl.workers.held_memory import builds_when_memory_frees
from resilient_rl.workers.out_of_memory import names_memory_keys
from resilient_rl.workers.policy import PolicyEngine
from resilient_rl.workers.rollout import RolloutEngine
from resilient_rl.workers.value import ValueEngine
from resilient_rl.models.engine import compiles_decode, import_compiler_code
from resilient_rl.models.factory import import_model_code

logger = logging.getLogger(__name__)


#: The run config this process built last: (its plain mapping as JSON, the Config).
_CONFIG: dict = {}


def _run_config(config: dict):
    """The run's Config from its plain mapping, validated once per process (it costs ~0.25 s:
    colocated roles, and a warm spare taking a rank, would pay it once per role); each role gets
    its own copy."""
    key = json.dumps(config, sort_keys=True, default=str)
    if _CONFIG.get("key") != key:
        _CONFIG.update(key=key, cfg=config_from_dict(config))
    return copy.deepcopy(_CONFIG["cfg"])


class RoleWorker(RankWorker):
    """Common setup of a role: the run config, vocabulary, device plan, CPU threads."""

    role = "worker"
    answers_during_calls = True  # remote classes below declare HEALTH_GROUPS
    engine: Any = None  # the role's engine once built (init_model), None after drop_engine
    engine_dropped = False  # an engine was dropped whose reference cycles are not collected yet

    @ray.method(concurrency_group="health")
    def health(self):
        """Answers while a training call is running (or blocked in a collective)."""
        return self.ping()

    @ray.method(concurrency_group="health")
    def call_off_rendezvous(self, generation: int) -> None:
        """Heard while the rendezvous call runs (see :meth:`RankWorker.call_off_rendezvous`)."""
        super().call_off_rendezvous(generation)

    @ray.method(concurrency_group="health")
    def leave_collectives(self, reason: str = "") -> int:
        """Heard while a call is blocked in a collective (see :meth:`RankWorker.leave_collectives`)."""
        return super().leave_collectives(reason)

    def __init__(self, config: dict, vocab_size: int, eos_token_id: int, pad_token_id: int):
        super().__init__()
        self.cfg = _run_config(config)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self._plan: DevicePlan | None = None
        # One intra-op thread per CPU worker: workers share the host's cores, and a fixed thread
        # count keeps CPU reductions in the same order run after run (bit-identical results).
        if not uses_cuda(self.cfg.trainer.device):
            torch.set_num_threads(1)
        apply_deterministic(self.cfg.trainer.deterministic)  # before anything here initialises CUDA
        torch.manual_seed(self.cfg.trainer.seed)

    def warm_imports(self) -> None:
        """Import what this role's first model build and first passes will (a Hugging Face model's
        family code, and the compiler's where the role compiles code on its device), ahead of
        them: run in the background once the constructor returns
        (:mod:`resilient_rl.runtime.worker_class`), so a warm spare is ready only once it is done."""
        import_model_code(self.cfg.model)
        device = "cuda" if uses_cuda(self.cfg.trainer.device) else "cpu"
        if self.compiles(device):
            import_compiler_code(device)

    def compiles(self, device: str) -> bool:
        """Whether this role's passes on ``device`` compile code, as its config says (no model is
        built yet when the warm-up asks)."""
        return False

    @property
    def plan(self) -> DevicePlan:
        """Where this worker computes, decided at first use (a model build, after the rendezvous
        made the rank's GPU current): the constructor never initialises CUDA, so a warm spare
        built like a rank can still take a dead rank's GPUs (:mod:`resilient_rl.runtime.devices`)."""
        if self._plan is None:
            self._plan = plan_device(self.cfg.trainer.device, self.cfg.model.dtype, self.cfg.trainer.sharding)
        return self._plan

    def colocated_roles(self) -> tuple[tuple[str, ...], int]:
        """The other roles sharing this process's device through an update pass, and the rows of
        their rollout's KV cache (for ``micro_batch_tokens=auto``); none in the split placement."""
        c = self.cfg
        if c.trainer.placement != "colocated":
            return (), 0
        trained = {"actor": "critic", "critic": "actor"}
        others = ("ref", "rollout") + ((trained[self.role],) if c.critic.enabled else ())
        rows = c.data.batch_size * c.rollout.n // max(1, c.rollout.world_size or c.actor.world_size)
        return others, rows

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def memory_plan_line(self) -> str | None:
        """The engine's ``micro_batch_tokens=auto`` decision in one line; None when set by hand."""
        plan = getattr(getattr(self, "engine", None), "memory_plan", None)
        return None if plan is None else plan.line

    def release_engine(self) -> None:
        """Drop the engine of an earlier generation before building the next one.

        FSDP modules hold reference cycles, so an old engine (with its optimizer, device mesh and,
        through them, the destroyed process group's sockets and threads) is freed only by the
        cycle collector: collect now, or every recovery leaves a survivor a few more open files
        and threads (found by bench/soak.py). The build then waits for the process's warm-up
        imports (:meth:`warm_imports`), which are its own: it imports nothing concurrently."""
        started = time.perf_counter()
        self.drop_engine(collect=True)
        waiting = time.perf_counter()
        wait_warm_up()
        self._build_times = (started, time.perf_counter() - waiting)

    def built(self, empty: bool) -> bool:
        """Log how long this build took since :meth:`release_engine` (and how much of it waited for
        the process's start-up imports): a restarted or adopted rank's rebuild is most of a
        recovery's rejoin. True, the answer of ``init_model``."""
        started, imports_s = getattr(self, "_build_times", (time.perf_counter(), 0.0))
        logger.info("%s rank %d built %sin %.2f s (%.2f s of it waiting for the start-up imports)", self.role,
                    self.rank, "empty " if empty else "", time.perf_counter() - started, imports_s)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def drop_engine(self, collect: bool = True) -> bool:
        """Drop the engine ahead of a rebuild; with ``collect``, run the cycle collector (it frees
        the engines every role of the process dropped: colocated roles drop theirs first and
        collect once). Whether there was one.

        Once no role of the process holds an engine, everything still alive (torch, the imported
        modules, the config: objects that live as long as the process) is moved out of the
        collector's sight (``gc.freeze``). A full collection then scans only what was made since,
        the engines: about 1 ms instead of 0.2 s with torch loaded, in the rejoin of a survivor
        and in every automatic collection during a step."""
        had = self.engine is not None
        self.engine = None
        self.engine_dropped = had or self.engine_dropped
        process = [w for w in host_of(self).workers() if isinstance(w, RoleWorker)]
        if collect and any(w.engine_dropped for w in process):
            gc.collect()
            for w in process:
                w.engine_dropped = False
        if collect and all(w.engine is None for w in process):
            gc.freeze()
        return had


class TrainableRole(RoleWorker):
    """A role whose rank state is checkpointed and snapshotted (actor, critic). Its parts
    (:mod:`resilient_rl.runtime.parts`), each handed the rank's state registry
    (:class:`~resilient_rl.workers.rank_state.RankState`) rather than inherited, are its
    checkpointer, its own snapshot copies, their loader, and the copies it holds for ring peers:
    their registered methods are this worker's calls."""

    parts = MappingProxyType({"checkpointer": RankCheckpointer, **SNAPSHOT_PARTS})

    def __init__(self, config: dict, vocab_size: int, eos_token_id: int, pad_token_id: int):
        super().__init__(config, vocab_size, eos_token_id, pad_token_id)
        c = self.cfg.checkpoint
        self.engine = None
        states = lambda: None if self.engine is None else states_of(self.engine)  # noqa: E731
        self.checkpointer = RankCheckpointer(states, lambda: (self.rank, self.world_size, self.generation),
                                             self.role, staging=c.async_save and c.save_every > 0,
                                             held_wait_s=self.cfg.recovery.restart_timeout_s)
        attach_snapshot_parts(self, states, lambda: (self.rank, self.world_size), self.checkpointer)


@ray.remote(concurrency_groups=HEALTH_GROUPS)
class ActorWorker(TrainableRole):
    """The policy being trained (FSDP2, AdamW, PPO clipped loss); its weights go to the rollout
    through its :class:`~resilient_rl.workers.weight_parts.WeightSender` part."""

    role = "actor"
    parts = MappingProxyType({**TrainableRole.parts, "weights": WeightSender})

    def compiles(self, device: str) -> bool:
        a = self.cfg.actor
        return a.compile or compiles_head(a.compile_head, device) or compiles_elementwise(a.compile_elementwise, device)

    def __init__(self, config: dict, vocab_size: int, eos_token_id: int, pad_token_id: int):
        super().__init__(config, vocab_size, eos_token_id, pad_token_id)
        self.weights = WeightSender(lambda: self.engine, lambda: self.plan, lambda: self.rank,
                                    lambda: getattr(host_of(self).parts("weights").get("rollout"), "sink", None))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @names_memory_keys
    @builds_when_memory_frees
    def init_model(self, empty: bool = False) -> bool:
        """Build the model with its initial weights, or ``empty`` (allocated on the device, not
        initialised) when a restore of the whole state follows."""
        c = self.cfg
        self.release_engine()
        self.checkpointer.reset()
        colocated, kv_rows = self.colocated_roles()
        self.engine = PolicyEngine(c.model, self.vocab_size, c.trainer.seed, self.plan, actor_cfg=c.actor,
                                   total_steps=c.trainer.total_steps, trainable=True,
                                   reshard_after_forward=c.actor.reshard_after_forward, empty=empty,
                                   colocated=colocated, kv_rows=kv_rows, temperature=c.rollout.temperature)
        self.checkpointer.prepare_staging()  # the first save then stalls no longer than later ones
        return self.built(empty)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @names_memory_keys
    def compute_log_prob(self, data: DataProto) -> DataProto:
        out = self.engine.compute_log_prob(data)
        return DataProto.from_dict({"old_log_probs": out.batch["log_probs"], "entropys": out.batch["entropys"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    @names_memory_keys
    def update_actor(self, data: DataProto) -> dict:
        metrics = self.engine.update(data, int(data.meta_info["step"]))
        self.checkpointer.prepare_staging()  # the optimizer's buffers, once it has state
        return metrics


@ray.remote(concurrency_groups=HEALTH_GROUPS)
class CriticWorker(TrainableRole):
    """The value model (FSDP2, clipped value loss)."""

    role = "critic"

    def compiles(self, device: str) -> bool:
        return self.cfg.critic.compile or compiles_elementwise(self.cfg.critic.compile_elementwise, device)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @names_memory_keys
    @builds_when_memory_frees
    def init_model(self, empty: bool = False) -> bool:
        """As the actor's: ``empty`` when a restore of the whole state follows."""
        c = self.cfg
        self.release_engine()
        self.checkpointer.reset()
        # A different seed from the actor's: the critic's backbone is its own model.
        colocated, kv_rows = self.colocated_roles()
        self.engine = ValueEngine(c.model, c.critic, self.vocab_size, c.trainer.seed + 1, self.plan,
                                  total_steps=c.trainer.total_steps, empty=empty, colocated=colocated,
                                  kv_rows=kv_rows)
        self.checkpointer.prepare_staging()
        return self.built(empty)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @names_memory_keys
    def compute_values(self, data: DataProto) -> DataProto:
        return self.engine.compute_values(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    @names_memory_keys
    def update_critic(self, data: DataProto) -> dict:
        metrics = self.engine.update(data, int(data.meta_info["step"]))
        self.checkpointer.prepare_staging()
        return metrics


@ray.remote(concurrency_groups=HEALTH_GROUPS)
class RefWorker(RoleWorker):
    """The frozen initial policy: reference log-probs for the KL terms."""

    role = "ref"

    def compiles(self, device: str) -> bool:
        a = self.cfg.actor
        return compiles_head(a.compile_head, device) or compiles_elementwise(a.compile_elementwise, device)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @names_memory_keys
    @builds_when_memory_frees
    def init_model(self, empty: bool = False) -> bool:
        """Always the initial weights (no checkpoint or snapshot holds them): ``empty`` is ignored."""
        c = self.cfg
        self.release_engine()
        self.engine = PolicyEngine(c.model, self.vocab_size, c.trainer.seed, self.plan, trainable=False,
                                   reshard_after_forward=c.ref.reshard_after_forward, packing=c.actor.packing,
                                   compile_head=c.actor.compile_head, compile_elementwise=c.actor.compile_elementwise,
                                   temperature=c.rollout.temperature)
        return self.built(False)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @names_memory_keys
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        out = self.engine.compute_log_prob(data)
        return DataProto.from_dict({"ref_log_prob": out.batch["log_probs"]})


@ray.remote(concurrency_groups=HEALTH_GROUPS)
class RolloutWorker(RoleWorker):
    """Sampling with a KV cache from an unsharded copy of the policy; the actor's weights arrive
    through its :class:`~resilient_rl.workers.weight_parts.WeightReceiver` part."""

    role = "rollout"
    parts = MappingProxyType({"weights": WeightReceiver})

    def __init__(self, config: dict, vocab_size: int, eos_token_id: int, pad_token_id: int):
        super().__init__(config, vocab_size, eos_token_id, pad_token_id)
        self.engine = None
        # A replicated (ddp) actor sends its full weights: they arrive as from one rank.
        self.weights = WeightReceiver(lambda: self.engine, lambda: self.rank,
                                      lambda: resolve_strategy(self.cfg.actor.strategy, self.plan.device) == "ddp")

    def compiles(self, device: str) -> bool:
        """Where generations compile the decode step."""
        c = self.cfg.rollout
        return getattr(c, "engine", "auto") != "plain" and compiles_decode(getattr(c, "compile", None), device)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @names_memory_keys
    @builds_when_memory_frees
    def init_model(self, empty: bool = True) -> bool:
        """Built empty unless asked otherwise: its weights are always the actor's, which the
        controller syncs after every (re)build before the next generation (it refuses to
        generate until then)."""
        c = self.cfg
        self.release_engine()
        self.engine = RolloutEngine(c.model, c.rollout, self.vocab_size, c.trainer.seed, self.plan,
                                    self.eos_token_id, self.pad_token_id, empty=empty,
                                    compile_cache=CompileCache(c.checkpoint.root, c.trainer.run_name,
                                                               c.checkpoint.storage_options))
        # A colocated actor writes its weights straight into these parameters (workers/weight_sync.py).
        self.weights.receive_into(self.engine.model)
        return self.built(empty)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @names_memory_keys
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        return self.engine.generate_sequences(prompts, self.rank)


#: The worker class of each role, as the trainer hands it to the Ray pool (RayRoles.running).
ROLE_CLASSES = MappingProxyType({"actor": ActorWorker, "critic": CriticWorker, "ref": RefWorker,
                                 "rollout": RolloutWorker})
