"""The Ray Train v2 baseline of ``bench/recovery.py`` (its part 3): ``TorchTrainer`` with 2 CPU
workers training a small MLP with DDP on gloo, a checkpoint reported every step,
``FailureConfig(max_failures=2)``. Worker rank 1 is SIGKILLed ``--delay`` s after its
``--rt-kill-after``-th step; the time to the next completed step is split into detect (kill -> the
controller's ``after_exception`` callback), restart (-> every new worker entered the training
function), restore and first step. The workers and the controller note their times in JSON lines.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Callable


def _rt_note(path: str, kind: str, **fields) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), "kind": kind, "pid": os.getpid(), **fields}) + "\n")


def _rt_train_loop(config: dict) -> None:
    """Training function of every Ray Train worker: DDP on a small MLP, a checkpoint every step."""
    import torch
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    log = config["log"]
    _rt_note(log, "start", rank=rank)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        step = int(state["step"])
    _rt_note(log, "restored", rank=rank, step=step)
    gen = torch.Generator().manual_seed(1000 * rank + step)
    while step < config["steps"]:
        step += 1
        x = torch.randn(64, 64, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        optim.zero_grad()
        loss.backward()
        optim.step()
        time.sleep(config["pause_s"])
        with tempfile.TemporaryDirectory() as d:
            ckpt = None
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(), "step": step},
                           os.path.join(d, "state.pt"))
                ckpt = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"step": step, "loss": loss.item()}, checkpoint=ckpt)
        _rt_note(log, "step", rank=rank, step=step)


def _rt_records(log: str) -> list[dict]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line) for line in f if line.endswith("}\n")]


def measure_ray_train(args, root: str, session: Callable[[Callable[[], None]], None]) -> dict:
    """The time from a SIGKILL of worker rank 1 to the next completed step, split as described
    above; ``session(run)`` runs ``run()`` inside a Ray cluster of its own."""
    # Ray Train v2 is chosen when ray.train is first imported (2.60 defaults to it; be explicit).
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    try:
        import ray.train
        from ray.train.torch import TorchTrainer
    except ImportError as exc:
        raise SystemExit(f"Ray Train is not importable ({exc}): pip install -e '.[bench]', or pass --skip-ray-train")

    # Ray's workers cannot import this module (bench/ is not a package on their path): ship its
    # functions by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    log, cb_log = f"{root}/workers.jsonl", f"{root}/controller.jsonl"

    class FailureClock(ray.train.UserCallback):
        """Runs in the Ray Train controller: notes when it saw the worker failure."""

        def after_exception(self, run_context, worker_exceptions):
            _rt_note(cb_log, "exception", ranks=sorted(worker_exceptions))

    killed: dict = {}

    def killer():
        while "time" not in killed:
            recs = _rt_records(log)
            if any(r["kind"] == "step" and r["rank"] == 1 and r["step"] >= args.rt_kill_after for r in recs):
                time.sleep(args.delay)
                pid = [r["pid"] for r in recs if r["kind"] == "start" and r["rank"] == 1][-1]
                os.kill(pid, signal.SIGKILL)
                killed.update(time=time.time(), pid=pid)
                return
            time.sleep(0.01)

    steps = args.rt_kill_after + 5

    def run():
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        trainer = TorchTrainer(
            _rt_train_loop, train_loop_config={"log": log, "steps": steps, "pause_s": args.rt_pause},
            scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
            run_config=ray.train.RunConfig(
                name="bench", storage_path=f"{root}/ray_train", callbacks=[FailureClock()],
                failure_config=ray.train.FailureConfig(max_failures=2),
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2)))
        trainer.fit()
        killed.setdefault("time", None)  # stops the killer if the run ended first
        thread.join()
    session(run)
    t_kill = killed["time"]
    if t_kill is None:
        raise RuntimeError("Ray Train finished before the kill; raise --rt-kill-after's margin")
    recs = _rt_records(log)
    starts = [r["time"] for r in recs if r["kind"] == "start" and r["time"] > t_kill]
    t_up = max(starts)
    t_restored = max(r["time"] for r in recs if r["kind"] == "restored" and r["time"] > t_kill)
    done = min((r for r in recs if r["kind"] == "step" and r["time"] > t_restored), key=lambda r: r["time"])
    exc = [r["time"] for r in _rt_records(cb_log) if r["time"] > t_kill]
    t_detect = min(exc) if exc else min(starts)
    restored_step = [r["step"] for r in recs if r["kind"] == "restored" and r["time"] > t_kill][0]
    killed_at = max(r["step"] for r in recs if r["kind"] == "step" and r["time"] < t_kill)
    return {"detect": t_detect - t_kill, "restart": t_up - t_detect, "restore": t_restored - t_up,
            "first_step": done["time"] - t_restored, "total": done["time"] - t_kill,
            "from_step": restored_step, "replayed": max(0, killed_at - restored_step)}
