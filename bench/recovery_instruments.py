"""What bench/recovery.py (and bench/snapshots.py) measure a recovery with: trainer hooks that mark
each step's start and end the job, a watcher of ``metrics.jsonl`` that notes when each step's row
appears, and a Ray cluster of its own per measurement."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import ray

from resilient_rl.env import fail_fast_on_dead_actors
from resilient_rl.events import read_events
from resilient_rl.runtime.cluster import local_cluster_options
from resilient_rl.trainer.hooks import TrainerHook
from resilient_rl.trainer.ppo import PPOTrainer


def process_start_time(pid: int) -> float:
    """Wall-clock time ``pid`` was created, to the clock tick (psutil's rounds the boot time to 1 s)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


class StepClock(TrainerHook):
    """Trainer hook: a ``bench_step_start`` event at the start of every step.

    It also notes when the process of every restarted worker was created (``spawned``: pid ->
    time), which splits a restart into Ray respawning the process and the process getting ready
    (imports, constructor). A pid created before the fault is a pre-started idle Ray worker."""

    def __init__(self):
        self.spawned: dict[int, float] = {}

    def on_step_start(self, trainer, step: int) -> None:
        trainer.run_dir.event("bench_step_start", step=step)
        for e in read_events(trainer.run_dir.path):
            if e["event"] == "worker_restarted" and e["pid"] not in self.spawned:
                try:
                    self.spawned[e["pid"]] = process_start_time(e["pid"])
                except (OSError, IndexError, ValueError):
                    pass


class JobKill(TrainerHook):
    """Trainer hook: at ``step``, wait ``delay_s`` (the job runs into the step) and end the job."""

    class Killed(Exception):
        pass

    def __init__(self, step: int, delay_s: float):
        self.step, self.delay_s, self.fired_at = step, delay_s, None

    def on_step_start(self, trainer, step: int) -> None:
        if step == self.step and self.fired_at is None:
            time.sleep(self.delay_s)
            self.fired_at = time.time()
            raise JobKill.Killed(f"job killed during step {step}")


class MetricsWatcher:
    """Polls ``metrics.jsonl`` and records (time first seen, step) of every new row, truncations included."""

    def __init__(self, path: Path, interval_s: float = 0.01):
        self.path, self.interval_s = path, interval_s
        self.seen: list[tuple[float, int]] = []
        self._lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.interval_s)
        self._poll()

    def _poll(self) -> None:
        try:
            lines = [ln for ln in self.path.read_text().splitlines() if ln.endswith("}")]
        except FileNotFoundError:
            return
        now = time.time()
        same = 0
        while same < min(len(lines), len(self._lines)) and lines[same] == self._lines[same]:
            same += 1
        self.seen += [(now, json.loads(ln)["step"]) for ln in lines[same:]]
        self._lines = lines

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def completed(self, step: int, after: float) -> float:
        """When the row of ``step`` first appeared after ``after``."""
        return min(t for t, s in self.seen if s == step and t > after)


def first(events, kind: str, after: float = 0.0) -> dict:
    return next(e for e in events if e["event"] == kind and e["time"] > after)


def start_cluster(cfg) -> None:
    """A new local Ray cluster with ``cfg.ray``'s resources, as ``cluster.connect`` starts one.

    ``address="local"`` because every measurement needs a cluster of its own: a bare ``ray.init()``
    would join whatever ``/tmp/ray/ray_current_cluster`` names (another ``ray start`` on the machine)."""
    fail_fast_on_dead_actors()
    ray.init(**local_cluster_options(cfg.ray, log_to_driver=False))


def ray_session(cfg, fn, on_started=None):
    """Run ``fn()`` inside a Ray cluster of its own (``on_started()`` once it is up)."""
    if ray.is_initialized():
        ray.shutdown()
    start_cluster(cfg)
    try:
        if on_started is not None:
            on_started()
        return fn()
    finally:
        ray.shutdown()


def run_trainer(cfg, hooks: list) -> None:
    trainer = PPOTrainer(cfg, hooks=hooks)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
