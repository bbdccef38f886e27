"""A pass that runs out of device memory stops the run at once with the config keys that make it
need less (resilient_rl.workers.out_of_memory): no GPU here, so torch's error is raised where CUDA
would raise it, with CUDA's message."""

from __future__ import annotations

import re
import types

import pytest
import torch

from resilient_rl.config.schema import load_config
from resilient_rl.errors import DeviceMemoryError, RecoveryError
from resilient_rl.recovery.causes import classify
from resilient_rl.recovery.policy import Decision, FailurePolicy
from resilient_rl.testing.clock import FakeClock
from resilient_rl.testing.out_of_memory import CUDA_MESSAGE
from resilient_rl.workers.out_of_memory import keys_for, names_memory_keys


def _worker(role: str, *overrides: str, tokens=None, planned=False, engine=True):
    cfg = load_config(None, list(overrides))
    plan = object() if planned else None
    engine = types.SimpleNamespace(micro_batch_tokens=tokens, memory_plan=plan,
                                   plan=types.SimpleNamespace(device=torch.device("cpu"))) if engine else None

    class Worker:
        def __init__(self):
            self.role, self.cfg, self.engine = role, cfg, engine

        @names_memory_keys
        def update_actor(self, data):
            raise torch.OutOfMemoryError(CUDA_MESSAGE)

    return Worker()


def test_each_role_names_the_keys_of_its_pass():
    actor = _worker("actor", tokens=11776, planned=True)
    assert keys_for("actor", "update_actor", actor.cfg, actor.engine) == (
        "actor.micro_batch_tokens below 11776 (micro_batch_tokens=auto chose it), actor.activation_checkpointing=true, "
        "trainer.placement=split (every role now shares this GPU)")
    critic = _worker("critic", "critic.activation_checkpointing=true", "trainer.placement=split", tokens=4096)
    assert keys_for("critic", "update_critic", critic.cfg, critic.engine) == "critic.micro_batch_tokens below 4096"
    whole = _worker("actor", "trainer.placement=split")
    assert keys_for("actor", "compute_log_prob", whole.cfg, whole.engine) == (
        "actor.micro_batch_tokens (now unset: a whole mini-batch in one pass)")
    rollout = _worker("rollout", "data.batch_size=64", "rollout.n=8", "rollout.max_new_tokens=512",
                      "trainer.placement=split")
    assert keys_for("rollout", "generate_sequences", rollout.cfg, rollout.engine) == (
        "rollout.world_size (its ranks share the 64 x 8 rows of the KV cache); in a new run, data.batch_size, "
        "rollout.n, rollout.max_new_tokens (512)")
    colocated = _worker("rollout")
    assert keys_for("rollout", "generate_sequences", colocated.cfg, colocated.engine).startswith(
        "trainer.placement=split (every role now shares this GPU); in a new run, data.batch_size")
    ref = _worker("ref", "trainer.placement=split")
    assert keys_for("ref", "compute_ref_log_prob", ref.cfg, ref.engine).startswith(
        "ref.reshard_after_forward=true, ref.world_size (its ranks share the ")


def test_a_model_that_does_not_fit_names_more_ranks_or_sharding():
    colocated = _worker("actor", "actor.world_size=2", engine=False)
    assert keys_for("actor", "init_model", colocated.cfg, None) == (
        "actor.world_size (now 2; every role's ranks), trainer.placement=split (every role now shares this GPU)")
    split = _worker("critic", "trainer.placement=split", "critic.strategy=ddp", engine=False)
    assert keys_for("critic", "init_model", split.cfg, None) == (
        "critic.world_size (now 1), critic.strategy=fsdp (ddp keeps the whole state on every rank)")
    rollout = _worker("rollout", "trainer.placement=split", engine=False)
    assert keys_for("rollout", "init_model", rollout.cfg, None) == (  # whole weights on every rank
        "a GPU with more memory (no key of the run changes this pass's)")


def test_the_device_memory_torch_held_is_in_the_message(monkeypatch):
    from resilient_rl.workers import out_of_memory

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"allocated_bytes.all.current": 70 * gib,
                                                                    "reserved_bytes.all.current": 77 * gib})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        total_memory=int(79.2 * gib)))
    worker = _worker("actor", tokens=4096)
    error = out_of_memory.device_memory_error(torch.OutOfMemoryError(CUDA_MESSAGE), "update_actor", "actor",
                                              worker.cfg, worker.engine, torch.device("cuda", 0))
    assert str(error).startswith("ran out of GPU memory in update_actor; torch held 70.0 GiB allocated, 77.0 GiB "
                                 "reserved of the device's 79.2 GiB. To need less: actor.micro_batch_tokens below 4096")
    assert out_of_memory._held(torch.device("cpu")) == "" and out_of_memory._held(None) == ""


def test_the_keys_named_first_are_ones_a_resume_may_change():
    from resilient_rl.config.resume import may_change_on_resume

    for role, call, overrides in [("actor", "update_actor", ()), ("critic", "update_critic", ()),
                                  ("actor", "init_model", ()), ("ref", "init_model", ("trainer.placement=split",)),
                                  ("critic", "init_model", ("trainer.placement=split", "critic.strategy=ddp")),
                                  ("ref", "compute_ref_log_prob", ("trainer.placement=split",)),
                                  ("rollout", "generate_sequences", ("trainer.placement=split",))]:
        worker = _worker(role, *overrides, tokens=1024)
        resumable = keys_for(role, call, worker.cfg, worker.engine).split("; in a new run")[0]
        for key in resumable.split(", "):
            assert may_change_on_resume(key.split()[0].split("=")[0]), (role, key)


def test_the_error_reaches_the_controller_typed_and_stops_the_run_with_the_keys_first():
    worker = _worker("actor", tokens=11776, planned=True)
    with pytest.raises(DeviceMemoryError) as raised:
        worker.update_actor(None)
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    text = str(raised.value)
    assert text.startswith("ran out of GPU memory in update_actor. To need less: actor.micro_batch_tokens below 11776")
    assert text.endswith(f"torch: {CUDA_MESSAGE}")
    failure = classify(DeviceMemoryError(f"actor rank 0 {raised.value}", role="actor", rank=0))
    verdict = FailurePolicy(max_restarts=3, max_failures=10, failure_window_s=60, clock=FakeClock()).decide(failure)
    assert verdict.decision is Decision.RAISE  # the same pass needs the same memory again: not retried
    assert "actor.activation_checkpointing=true" in verdict.reason  # the keys come before torch's long message


@pytest.fixture
def cluster_out_of_memory():
    """A local cluster whose worker processes' policy updates run out of memory."""
    import ray

    ray.init(address="local", num_cpus=16, include_dashboard=False, namespace="rrl-oom",
             object_store_memory=256 * 1024**2, log_to_driver=False, configure_logging=False,
             runtime_env={"worker_process_setup_hook":
                          "resilient_rl.testing.out_of_memory.actor_updates_run_out_of_memory"})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_an_actor_update_out_of_device_memory_stops_the_run_naming_its_keys(cluster_out_of_memory, tmp_path):
    from resilient_rl.faults.harness import run_training

    result = run_training(["trainer.total_steps=2", "trainer.progress_bar=false", "data.batch_size=8",
                           "data.num_prompts=16", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
                           "ray.cpus_per_worker=0.05", f"trainer.output_dir={tmp_path}/runs",
                           f"checkpoint.root={tmp_path}/ckpt"], "oom")
    assert isinstance(result.error, RecoveryError), result.error
    text = str(result.error)  # either rank may fail first
    assert re.search(r"actor rank [01] ran out of GPU memory in update_actor\. To need less: "
                     r"actor\.micro_batch_tokens .*trainer\.placement=split .* torch: CUDA out of memory", text), text
    assert text.endswith("; no checkpoint was committed")
    assert result.history == []
    failures = result.events_of("failure")
    assert [(e["role"], e["cause"]) for e in failures] == [("actor", "exception")]
    assert result.events_of("restart") == []  # stopped, not retried
