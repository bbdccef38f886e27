"""Overhead of telemetry on a training step.

A synthetic step (single-threaded torch matmuls, about ``--step-ms`` long) runs in two modes,
interleaved round by round so that drift in machine load hits both alike:

- baseline: the step alone;
- telemetry: the step, then ``TrainerMetrics.observe_step`` with every phase, while a live
  ``MetricsServer`` (trainer + device metrics of this process) is scraped over HTTP every
  ``--scrape-s`` seconds by another thread, as Prometheus would.

Prints the mean step time of each mode, their ratio and the overhead in percent (median over
rounds), plus the cost of one ``observe_step`` call and of one scrape.

    python bench/exporter.py            # ~1 minute
    python bench/exporter.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--steps", type=int, default=20, help="steps per mode per round")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--scrape-s", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true", help="4 rounds of 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 10, 4
    torch.set_num_threads(1)

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
