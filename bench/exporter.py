"""Overhead of telemetry on a training step.

Two modes. ``--trainer`` measures the real trainer step (PPO, single-process roles, the tiny
model on CPU): two trainers with the same config, one with ``telemetry.enabled=true`` and one
with ``false``, train the same steps in interleaved blocks, and while the telemetry trainer runs
its exporter is scraped every ``--scrape-s`` seconds (2s, as ``monitoring/prometheus.yml``) by
another thread. Both trainers compute identical steps (same seed, same data), so block ``k`` of
one is the same work as block ``k`` of the other. Prints the mean step time of each, the overhead
in percent (median of per-block ratios), and the directly timed cost of the hook's
``observe_step`` as a share of a step.

Without ``--trainer``, a synthetic step (single-threaded torch matmuls, about ``--step-ms`` long) runs in two modes,
interleaved round by round so that drift in machine load hits both alike:

- baseline: the step alone;
- telemetry: the step, then ``TrainerMetrics.observe_step`` with every phase, while a live
  ``MetricsServer`` (trainer + device metrics of this process) is scraped over HTTP every
  ``--scrape-s`` seconds by another thread, as Prometheus would.

Prints the mean step time of each mode, their ratio and the overhead in percent (median over
rounds), plus the cost of one ``observe_step`` call and of one scrape.

    python bench/exporter.py            # ~1 minute
    python bench/exporter.py --quick    # a few seconds
    python bench/exporter.py --trainer  # the real trainer step, ~1 minute (--quick: seconds)
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import threading
import time

import torch

from resilient_rl.telemetry import (PHASES, DeviceMetrics, MetricsServer, ProcessSampler,
                                    TrainerMetrics, scrape)


def calibrate(step_ms: float) -> tuple[torch.Tensor, int]:
    """A matrix and a repeat count whose matmuls take about ``step_ms`` milliseconds."""
    a = torch.randn(256, 256)
    reps = 4
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            a @ a
        elapsed = (time.perf_counter() - start) * 1e3
        reps = max(1, round(reps * step_ms / elapsed))
    return a, reps


def synthetic_step(a: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        a @ a


class Scraper(threading.Thread):
    """Scrapes ``url`` every ``interval`` seconds while ``active`` is set."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.active = threading.Event()
        self.stopped = threading.Event()
        self.durations: list[float] = []

    def run(self) -> None:
        while not self.stopped.is_set():
            if self.active.wait(0.05):
                start = time.perf_counter()
                scrape(self.url)
                self.durations.append(time.perf_counter() - start)
                self.stopped.wait(self.interval)


def run_mode(a: torch.Tensor, reps: int, steps: int, metrics: TrainerMetrics | None,
             step_counter: list[int]) -> float:
    """Mean seconds per step over ``steps`` steps; with ``metrics``, each step is recorded."""
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        synthetic_step(a, reps)
        if metrics is not None:
            duration = time.perf_counter() - t0
            step_counter[0] += 1
            metrics.observe_step(step_counter[0], duration,
                                 {phase: duration / len(PHASES) for phase in PHASES},
                                 tokens=4096, reward_mean=0.5, losses={"actor": 1.0, "critic": 0.5},
                                 kl=0.01, lr={"actor": 1e-6, "critic": 1e-5})
    return (time.perf_counter() - start) / steps


# The real-step benchmark's config: the tiny model, a small batch, everything in this process.
TRAINER_OVERRIDES = ["trainer.progress_bar=false", "data.batch_size=16",
                     "data.num_prompts=64", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
                     "actor.ppo_epochs=2", "critic.ppo_epochs=2", "checkpoint.save_every=0"]


def run_block(trainer, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``train_step`` (the telemetry hook included)."""
    durations = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step()
        durations.append(time.perf_counter() - t0)
    return durations


def main_trainer(args: argparse.Namespace) -> None:
    """Telemetry on vs off on the real trainer step, interleaved in one process."""
    from resilient_rl.config.schema import load_config
    from resilient_rl.trainer.local_roles import LocalRoles
    from resilient_rl.trainer.ppo import PPOTrainer

    steps, rounds = (args.steps or 5), (args.rounds or 12)
    out = tempfile.mkdtemp(prefix="rrl-bench-exporter-")
    trainers = {}
    for mode in ("baseline", "telemetry"):
        cfg = load_config(None, TRAINER_OVERRIDES + [
            f"trainer.total_steps={steps * rounds + 2}", f"trainer.output_dir={out}", f"trainer.run_name={mode}",
            f"telemetry.enabled={'true' if mode == 'telemetry' else 'false'}"])
        trainers[mode] = PPOTrainer(cfg, roles_factory=LocalRoles)
        trainers[mode].start_roles()
        run_block(trainers[mode], 2)  # warm-up, identical for both
    hook = trainers["telemetry"].telemetry
    scraper = Scraper(hook.url, args.scrape_s)
    scraper.start()
    times: dict[str, list[float]] = {"baseline": [], "telemetry": []}
    ratios = []
    try:
        for round_index in range(rounds):
            order = ("baseline", "telemetry") if round_index % 2 == 0 else ("telemetry", "baseline")
            block = {}
            for mode in order:
                if mode == "telemetry":
                    scraper.active.set()
                block[mode] = run_block(trainers[mode], steps)
                scraper.active.clear()
                times[mode] += block[mode]
            ratios.append(statistics.mean(block["telemetry"]) / statistics.mean(block["baseline"]))
        # The hook's own cost, timed directly on a real row (no step around it to add noise).
        row = dict(trainers["telemetry"].history[-1])
        calls = 2000
        t0 = time.perf_counter()
        for _ in range(calls):
            hook.observe_step(row)
        observe_s = (time.perf_counter() - t0) / calls
    finally:
        scraper.stopped.set()
        scraper.join()
        for trainer in trainers.values():
            trainer.shutdown()

    ratio = statistics.median(ratios)
    base_ms = statistics.mean(times["baseline"]) * 1e3
    print(f"real trainer step (PPO, single-process roles, CPU): {rounds} rounds x {steps} steps per mode, "
          f"scrape every {args.scrape_s}s while telemetry runs")
    print(f"baseline  (telemetry.enabled=false) mean step: {base_ms:8.2f} ms")
    print(f"telemetry (telemetry.enabled=true)  mean step: {statistics.mean(times['telemetry']) * 1e3:8.2f} ms")
    print(f"ratio telemetry/baseline (median of per-block ratios): {ratio:.4f} -> overhead "
          f"{(ratio - 1) * 100:+.2f}% (per-block spread {min(ratios):.3f}..{max(ratios):.3f})")
    print(f"hook observe_step: {observe_s * 1e6:.1f} us per step = {observe_s * 1e3 / base_ms * 100:.3f}% of a "
          f"step; scrape: {statistics.median(scraper.durations) * 1e3:.2f} ms median over "
          f"{len(scraper.durations)} scrapes ({statistics.median(scraper.durations) / args.scrape_s * 100:.3f}% "
          f"of one core at this interval)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", action="store_true", help="measure the real trainer step")
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--steps", type=int, default=None, help="steps per mode per round "
                        "(default 20, --trainer 5)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 24, --trainer 12)")
    parser.add_argument("--scrape-s", type=float, default=None, help="scrape interval "
                        "(default 0.5s, --trainer 2s)")
    parser.add_argument("--quick", action="store_true", help="4 rounds of a few steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.trainer:
        logging.basicConfig(level=logging.WARNING)
        args.scrape_s = args.scrape_s or 2.0
        if args.quick:
            args.steps, args.rounds = args.steps or 3, args.rounds or 4
        main_trainer(args)
        return
    args.steps, args.rounds, args.scrape_s = args.steps or 20, args.rounds or 24, args.scrape_s or 0.5
    if args.quick:
        args.steps, args.rounds = 10, 4

    metrics = TrainerMetrics(run="bench")
    devices = DeviceMetrics(registry=metrics.registry, node="bench",
                            process_sampler=ProcessSampler({("actor", 0): os.getpid()}))
    for rank in range(8):
        metrics.set_workers_up("actor", rank, "bench", True)
    a, reps = calibrate(args.step_ms)
    counter = [0]

    with MetricsServer(metrics.registry) as server:
        scraper = Scraper(server.url, args.scrape_s)
        scraper.start()
        run_mode(a, reps, 3, None, counter)  # warm-up
        baseline, telemetry = [], []
        for round_index in range(args.rounds):
            # Alternate which mode goes first so neither always runs on a warmer machine.
            order = ("baseline", "telemetry") if round_index % 2 == 0 else ("telemetry", "baseline")
            for mode in order:
                if mode == "telemetry":
                    scraper.active.set()
                    telemetry.append(run_mode(a, reps, args.steps, metrics, counter))
                    scraper.active.clear()
                else:
                    baseline.append(run_mode(a, reps, args.steps, None, counter))
        scraper.stopped.set()
        scraper.join()

    # Cost of the call itself, away from the step.
    calls = 2000
    start = time.perf_counter()
    for i in range(calls):
        metrics.observe_step(i, 0.05, {phase: 0.005 for phase in PHASES}, tokens=1,
                             reward_mean=0.1, losses={"actor": 1.0}, kl=0.0, lr=1e-6)
    observe_us = (time.perf_counter() - start) / calls * 1e6
    devices.close()

    ratios = [t / b for t, b in zip(telemetry, baseline)]
    ratio = statistics.median(ratios)
    print(f"synthetic step: {reps} x matmul 256x256, target {args.step_ms:.0f} ms; "
          f"{args.rounds} rounds x {args.steps} steps per mode, scrape every {args.scrape_s}s")
    print(f"baseline  mean step: {statistics.mean(baseline) * 1e3:8.2f} ms "
          f"(median of rounds {statistics.median(baseline) * 1e3:.2f} ms)")
    print(f"telemetry mean step: {statistics.mean(telemetry) * 1e3:8.2f} ms "
          f"(median of rounds {statistics.median(telemetry) * 1e3:.2f} ms)")
    print(f"ratio telemetry/baseline (median of per-round ratios): {ratio:.4f} "
          f"-> overhead {(ratio - 1) * 100:+.2f}% "
          f"(per-round spread {min(ratios):.3f}..{max(ratios):.3f})")
    print(f"observe_step: {observe_us:.1f} us per call; scrape: "
          f"{statistics.median(scraper.durations) * 1e3:.2f} ms median over "
          f"{len(scraper.durations)} scrapes")


if __name__ == "__main__":
    main()
