"""Role backend that runs every engine in the calling process (no Ray, no process group).

It is the single-process baseline the benchmarks compare the Ray trainer against, and the
reference a distributed step is tested against.
"""

from __future__ import annotations

import logging
import os
import time

from resilient_rl.runtime.worker import WorkerInfo, compute_cuda_device
from resilient_rl.workers.determinism import apply_deterministic
from resilient_rl.protocol import DataProto
from resilient_rl.runtime.pool import step_role
from resilient_rl.runtime.devices import device_report
from resilient_rl.workers import memory_plan
from resilient_rl.workers.fsdp import plan_device
from resilient_rl.workers.policy import PolicyEngine
from resilient_rl.workers.rollout import RolloutEngine
from resilient_rl.workers.value import ValueEngine
from resilient_rl.workers.weight_sync import write_into

logger = logging.getLogger(__name__)


def _controller_node_id() -> str | None:
    """The Ray node id of this process where Ray runs (what telemetry calls the controller's node)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class LocalRoles:
    """Actor, critic, ref and rollout engines in this process: the step's part of a pool
    (:class:`~resilient_rl.runtime.pool.StepRoles`) and telemetry's
    (:class:`~resilient_rl.runtime.pool.TelemetrySource`), one process group, ``local``, of one rank.

    It saves no checkpoints (so the trainer takes no lease on the run for it), and its only
    process is the controller's: a failure here is the controller's own and is not recovered.
    """

    writes_checkpoints = False
    GROUP = "local"
    GENERATION = 1  # no process group: nothing ever rejoins

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        apply_deterministic(cfg.trainer.deterministic)  # the engines run in this process
        self.init_models()

    def init_models(self, groups: list[str] | None = None, empty: bool = False) -> None:
        cfg, tokenizer = self.cfg, self.tokenizer
        plan = plan_device(cfg.trainer.device, cfg.model.dtype)
        vocab, seed, steps = tokenizer.vocab_size, cfg.trainer.seed, cfg.trainer.total_steps
        self.critic_enabled = cfg.critic.enabled
        # Every role shares this process's device: each trained one plans around the others.
        kv_rows = cfg.data.batch_size * cfg.rollout.n
        shared = ("ref", "rollout")
        self.actor = PolicyEngine(cfg.model, vocab, seed, plan, actor_cfg=cfg.actor, total_steps=steps,
                                  colocated=shared + (("critic",) if self.critic_enabled else ()), kv_rows=kv_rows,
                                  temperature=cfg.rollout.temperature)
        self.ref = PolicyEngine(cfg.model, vocab, seed, plan, trainable=False, packing=cfg.actor.packing,
                                compile_head=cfg.actor.compile_head, compile_elementwise=cfg.actor.compile_elementwise,
                                temperature=cfg.rollout.temperature)
        self.rollout = RolloutEngine(cfg.model, cfg.rollout, vocab, seed, plan, list(tokenizer.eos_token_ids),
                                     tokenizer.pad_token_id)
        self.critic = ValueEngine(cfg.model, cfg.critic, vocab, seed + 1, plan, total_steps=steps,
                                  colocated=shared + ("actor",), kv_rows=kv_rows) if self.critic_enabled else None
        if not getattr(self, "_plan_printed", False):  # once, at start
            self._plan_printed = True
            memory_plan.announce(logger, [e.memory_plan and e.memory_plan.line
                                          for e in (self.actor, self.critic) if e is not None])

    def generate(self, prompts: DataProto) -> DataProto:
        return self.rollout.generate_sequences(prompts, rank=0)

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"ref_log_prob": self.ref.compute_log_prob(data).batch["log_probs"]})

    def compute_log_prob(self, data: DataProto) -> DataProto:
        out = self.actor.compute_log_prob(data)
        return DataProto.from_dict({"old_log_probs": out.batch["log_probs"], "entropys": out.batch["entropys"]})

    def compute_values(self, data: DataProto) -> DataProto:
        return self.critic.compute_values(data)

    def update_critic(self, data: DataProto) -> list[dict]:
        return [self.critic.update(data, int(data.meta_info["step"]))]

    def update_actor(self, data: DataProto) -> list[dict]:
        return [self.actor.update(data, int(data.meta_info["step"]))]

    def concurrently(self, calls: list[tuple[str, DataProto]]):
        """One engine at a time in this process: each call runs when its result is asked for."""
        for method, _ in calls:
            step_role(method)  # every name checked before anything runs
        return (getattr(self, method)(data) for method, data in calls)

    def sync_weights(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        nbytes = write_into(self.actor.model, dict(self.rollout.model.named_parameters()))
        self.rollout.version = int(version)
        return {"perf/weight_sync_bytes": float(nbytes), "perf/weight_sync_worker_s": time.perf_counter() - t0}

    # ------------------------------------------------------------------ processes
    def _info(self) -> WorkerInfo:
        """This process's health reply: its GPU and torch's memory there, on the controller's node."""
        report = device_report(compute_cuda_device())
        return WorkerInfo(0, 1, self.GENERATION, os.getpid(), _controller_node_id(),
                          report.gpu_uuids, report.torch_allocated_bytes, report.torch_reserved_bytes)

    def poll_device_reports(self, poller) -> bool:
        poller.reset(self.workers())  # this process answers at once: no calls to wait for
        return True

    def process_groups(self) -> list[str]:
        return [self.GROUP]

    def workers(self) -> dict[tuple[str, int], WorkerInfo]:
        return {(self.GROUP, 0): self._info()}

    def roles_of(self, group: str) -> tuple[str, ...]:
        return ("actor", "rollout", "ref") + (("critic",) if self.critic_enabled else ())

    def role_processes(self) -> dict[tuple[str, int], tuple[int, str | None]]:
        return {(role, 0): (os.getpid(), None) for role in self.roles_of(self.GROUP)}

    def shutdown(self) -> None:
        """Nothing to stop: the engines live in this process and go with it."""
