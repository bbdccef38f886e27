"""Soak: a long run of a small config under a fault every N steps (and NaN rewards now and then).

A tiny PPO config trains for ``--steps`` steps on a local Ray cluster while

- a seeded schedule SIGKILLs one worker process every ``--fault-every`` steps (a random role and
  rank, a random delay so it lands inside the step; colocated placement hosts every role in
  ``actor.world_size`` processes, so any role's kill takes one of them down);
- with ``--nan-every K > 0``, the reward of one sample is NaN on one seeded step of every block of
  K steps (a wrapper round the task's reward; replayed steps get the same NaN), which the trainer's
  non-finite handling (``trainer.nonfinite``) must absorb; ``--nan-every 0`` turns it off.

Every ``--sample-every`` steps a hook samples RSS, open file descriptors and threads of the
controller and of every worker process (pids re-read after each restart). Printed: a table over
time; the RSS growth per 10k steps (a least-squares line after ``--warmup`` steps; for workers per
process lifetime, since a restarted process starts afresh); fd and thread growth; faults injected
against failures seen and recoveries; steps lost (replayed); goodput (seconds of kept steps / wall).
Then the same run without process faults (same seed, same NaN schedule) and its final actor
weights digest against the faulted run's: MATCH or DIFFER (and the same for the metric history).

Targets: RSS growth <= 50 MB per 10k steps, no fd or thread growth, every fault recovered, MATCH.
The RSS verdict needs >= 500 steps of fitted samples; a shorter run prints the slope, no verdict.

    python bench/soak.py                                   # 200 steps, a fault every 50 (~4 minutes here)
    python bench/soak.py --steps 150 --fault-every 50
    python bench/soak.py --steps 10000 --fault-every 100 --sample-every 100   # the real soak
    python bench/soak.py --nan-every 0                     # process faults only
    python bench/soak.py --skip-reference model.num_layers=2   # any config override

Timing here (2 shared cores): about 0.25 s per step of the small config, 10-15 s per recovery
plus its replayed steps, ~15 s to start the workers. ``--steps 150 --fault-every 50`` took 108 s
(faulted) + 91 s (reference); ``--steps 10000 --fault-every 100`` comes to about an hour for the
faulted run and 45 minutes for the reference.

The final weights must be finite: a NaN that reached them would end the run at the next rollout
("probability tensor contains ... nan"), which the bench reports as a failed run.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import psutil

from resilient_rl.faults.injectors import FaultSchedule, role_pids
from resilient_rl.runtime import cluster
from resilient_rl.config.schema import load_config
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.run.folder import RunDir, deterministic_view
from resilient_rl.trainer.hooks import TrainerHook  # noqa: E402

RSS_TARGET_MB = 50.0
MIN_FIT_SPAN = 500  # steps of samples a growth verdict needs
ROLES = ("actor", "critic", "rollout")
SMALL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
         "data.batch_size=8", "data.num_prompts=64", "actor.mini_batch_size=8", "critic.mini_batch_size=8",
         "actor.ppo_epochs=1", "critic.ppo_epochs=1", "checkpoint.save_every=10", "checkpoint.keep_last=2",
         "trainer.progress_bar=false", "trainer.loggers=[jsonl]", "recovery.call_timeout_s=60"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    p.add_argument("--fault-every", type=int, default=50, help="a SIGKILL every N steps (0: none; default: 50)")
    p.add_argument("--nan-every", type=int, default=40,
                   help="a NaN reward once in every K steps (0: none; default: 40)")
    p.add_argument("--sample-every", type=int, default=10, help="resource samples every K steps (default: 10)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the growth fit (default: 20%% of --steps, at least 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault and NaN schedules (default: 0)")
    p.add_argument("--skip-reference", action="store_true", help="no fault-free run, no weights comparison")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.num_layers=2")
    args = p.parse_args(argv)
    if args.steps < 2 or args.fault_every < 0 or args.nan_every < 0 or args.sample_every < 1:
        p.error("need --steps >= 2, --fault-every >= 0, --nan-every >= 0, --sample-every >= 1")
    if args.warmup is None:
        args.warmup = max(10, args.steps // 5)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


# ---------------------------------------------------------------------------- schedules (pure)
def fault_plan(steps: int, every: int, seed: int, world_size: int) -> list[dict]:
    """One SIGKILL at steps every, 2*every, ... (< ``steps``): a seeded role, rank and delay into the step."""
    if every <= 0:
        return []
    rng = random.Random(f"soak-faults:{seed}")
    return [{"step": s, "role": rng.choice(ROLES), "rank": rng.randrange(world_size),
             "delay_s": round(rng.uniform(0.0, 0.3), 3)} for s in range(every, steps, every)]


def nan_steps(steps: int, every: int, seed: int) -> list[int]:
    """One seeded step in every block of ``every`` steps (the first block starts at step 2)."""
    if every <= 0:
        return []
    rng = random.Random(f"soak-nan:{seed}")
    out = []
    for lo in range(2, steps + 1, every):
        out.append(rng.randrange(lo, min(lo + every, steps + 1)))
    return out


def build_schedule(plan: list[dict], seed: int) -> FaultSchedule:
    schedule = FaultSchedule(seed=seed)
    for f in plan:
        schedule.at_step(f["step"]).kill(f["role"], f["rank"], delay_s=f["delay_s"])
    return schedule


# ---------------------------------------------------------------------------- NaN injection
class NanRewards(TrainerHook):
    """Wraps the trainer's task: the first sample of each step in ``steps`` is scored NaN.

    Sits on the task's public ``reward(response, answer)``, so it does not depend on how the
    trainer handles non-finite values; the step comes from the ``on_step_start`` hook."""

    def __init__(self, steps):
        self.steps, self.step, self.calls, self.injected = set(steps), 0, 0, 0
        self.task = None

    def attach(self, trainer) -> None:
        self.task, trainer.task = trainer.task, self

    def __getattr__(self, name):  # name, make_prompts, ... of the wrapped task
        return getattr(self.__dict__["task"], name)

    def on_step_start(self, trainer, step: int) -> None:
        self.step, self.calls = step, 0

    def reward(self, response: str, answer: str) -> float:
        self.calls += 1
        if self.step in self.steps and self.calls == 1:
            self.injected += 1
            return math.nan
        return self.task.reward(response, answer)


# ---------------------------------------------------------------------------- sampling
@dataclass
class Sample:
    executed: int  # step starts so far, replays included
    step: int
    time: float
    proc: dict = field(default_factory=dict)  # label -> (pid, rss bytes, fds, threads)


def probe(pid: int) -> tuple[int, int, int, int] | None:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return pid, p.memory_info().rss, p.num_fds(), p.num_threads()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


class ResourceSampler(TrainerHook):
    """Trainer hook: every ``every`` step starts, RSS/fds/threads of the controller and each worker."""

    def __init__(self, every: int):
        self.every, self.executed, self.samples = every, 0, []
        self.me = os.getpid()

    def on_step_start(self, trainer, step: int) -> None:
        self.executed += 1
        if self.executed == 1 or step % self.every == 0:
            self.take(trainer, step)

    def take(self, trainer, step: int) -> None:
        s = Sample(self.executed, step, time.time())
        s.proc["controller"] = probe(self.me)
        seen = set()
        for (role, rank), pid in sorted(role_pids(trainer.roles).items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if pid not in seen:  # colocated roles share a process: name it by its rank
                seen.add(pid)
                label = f"worker{rank}" if trainer.cfg.trainer.placement == "colocated" else f"{role}{rank}"
                s.proc[label] = probe(pid)
        s.proc = {k: v for k, v in s.proc.items() if v is not None}
        self.samples.append(s)


# ---------------------------------------------------------------------------- analysis (pure)
def slope_per_10k(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y against x, times 10 000 (None with < 3 points or no spread in x)."""
    if len(points) < 3:
        return None
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if np.ptp(x) == 0:
        return None
    return float(np.polyfit(x, y, 1)[0] * 10_000)


def growth(samples: list[Sample], label: str, warmup: int, metric: int = 1) -> tuple[float | None, int, int]:
    """Growth per 10k executed steps of ``label``'s metric (1 rss, 2 fds, 3 threads) after ``warmup``.

    Each process lifetime (a pid) is fitted apart, after its own warm-up (a restarted worker
    starts small); returns the span-weighted mean of the lifetimes' slopes (None when no lifetime
    has 3 samples after its warm-up), the number of lifetimes fitted and their total span in steps."""
    lives: dict[int, list[tuple[float, float]]] = {}
    for s in samples:
        if label in s.proc:
            lives.setdefault(s.proc[label][0], []).append((s.executed, s.proc[label][metric]))
    slopes, spans = [], []
    for pts in lives.values():
        start = pts[0][0]
        kept = [p for p in pts if p[0] >= start + warmup]
        k = slope_per_10k(kept)
        if k is not None:
            slopes.append(k)
            spans.append(kept[-1][0] - kept[0][0])
    if not slopes:
        return None, 0, 0
    return float(np.average(slopes, weights=spans)), len(slopes), int(sum(spans))


def settled_delta(samples: list[Sample], label: str, warmup: int, metric: int) -> int | None:
    """Largest growth of ``label``'s metric (2 fds, 3 threads) within one process lifetime, from its
    first sample after the lifetime's warm-up to its last: a worker that survives recoveries and
    keeps what each one opened shows here even when it is later killed and restarted afresh."""
    lives: dict[int, list[tuple[int, int]]] = {}
    for s in samples:
        if label in s.proc:
            lives.setdefault(s.proc[label][0], []).append((s.executed, s.proc[label][metric]))
    if not lives:
        return None
    deltas = []
    for pts in lives.values():
        kept = [v for x, v in pts if x >= pts[0][0] + warmup] or [pts[-1][1]]
        deltas.append(kept[-1] - kept[0])
    return max(deltas)


def format_table(samples: list[Sample]) -> str:
    """RSS (MB) / fds / threads per process over time, one row per sample."""
    labels = sorted({k for s in samples for k in s.proc}, key=lambda k: (k != "controller", k))
    head = f"{'step':>6} {'exec':>6} {'t_s':>7}  " + "  ".join(f"{k + ' pid rss/fd/thr':>33}" for k in labels)
    rows = [head]
    t0 = samples[0].time if samples else 0.0
    for s in samples:
        cells = []
        for k in labels:
            v = s.proc.get(k)
            cells.append(f"{v[0]:>7d}{v[1] / 2**20:>12.1f}MB {v[2]:>5d} {v[3]:>5d}" if v else f"{'-':>33}")
        rows.append(f"{s.step:>6} {s.executed:>6} {s.time - t0:>7.0f}  " + "  ".join(cells))
    return "\n".join(rows)


# ---------------------------------------------------------------------------- runs
def build_config(args, root: str, name: str, plan_len: int):
    budget = plan_len + 5  # the soak's faults are planned: the failure budget must not end the run
    return load_config(None, [*SMALL, f"trainer.total_steps={args.steps}", f"trainer.output_dir={root}/runs",
                              f"checkpoint.root={root}/ckpt", f"trainer.run_name={name}",
                              f"trainer.seed={args.seed + 1}", f"recovery.max_restarts={budget}",
                              f"recovery.max_failures={budget}", *args.overrides])


def run(cfg, schedule: FaultSchedule | None, nan: NanRewards, sample_every: int) -> dict:
    """Train ``cfg`` with the hooks; returns samples, wall time, final weights digest and finiteness."""
    sampler = ResourceSampler(sample_every)
    trainer = PPOTrainer(cfg, hooks=[sampler, nan] + ([schedule] if schedule else []))
    nan.attach(trainer)
    t0 = time.time()
    digest, finite, error = None, None, None
    try:
        try:
            trainer.fit()
        except Exception as exc:  # e.g. aborted past the failure budget: report what the run did until then
            error = exc
        wall = time.time() - t0
        if error is None:
            sampler.take(trainer, trainer.step)
            actor = trainer.roles.groups["actor"]
            digest = next(d for d in actor.weights_digest() if d is not None)
            weights = next(w for w in actor.full_weights() if w is not None)
            finite = all(bool(t.float().isfinite().all()) for t in weights.values())
    finally:
        trainer.shutdown()
    rd = RunDir(cfg.trainer.output_dir, cfg.trainer.run_name)
    return {"samples": sampler.samples, "wall": wall, "digest": digest, "finite": finite, "error": error,
            "events": rd.read_events(), "metrics": rd.read_metrics(), "nan_injected": nan.injected}


def report(args, res: dict, plan: list[dict], schedule: FaultSchedule | None, ref: dict | None) -> dict:
    """Print the figures; returns them (and the verdicts) as a dict."""
    samples, ev = res["samples"], res["events"]
    for name, r in (("faulted run", res), ("reference run", ref)):
        if r is not None and r["error"] is not None:
            print(f"\n{name} FAILED after step {r['metrics'][-1]['step'] if r['metrics'] else 0} "
                  f"(the last one completed): {r['error']!r}")
    print("\nresources over time (RSS MB / open fds / threads; exec = step starts incl. replays)")
    print(format_table(samples))
    labels = sorted({k for s in samples for k in s.proc}, key=lambda k: (k != "controller", k))
    print(f"\ngrowth per 10k steps after a warm-up of {args.warmup} steps (per process lifetime; "
          f"target RSS <= {RSS_TARGET_MB:g} MB, fds and threads flat;\n"
          "fds/threads: the largest growth within one process lifetime after its warm-up)")
    verdicts: dict = {"processes": {}}
    for k in labels:
        rss, n, span = growth(samples, k, args.warmup, 1)
        fds, thr = settled_delta(samples, k, args.warmup, 2), settled_delta(samples, k, args.warmup, 3)
        flat = (fds or 0) <= 0 and (thr or 0) <= 0
        if rss is None or span < MIN_FIT_SPAN:  # a slope over a few steps says nothing about 10k
            verdict = f"{'ok' if flat else 'GREW'} (fds/threads); RSS n/a: fitted span {span} < {MIN_FIT_SPAN} steps"
        else:
            verdict = "ok" if rss / 2**20 <= RSS_TARGET_MB and flat else "MISSED"
        rss_s = "n/a" if rss is None else f"{rss / 2**20:+.1f} MB"
        print(f"  {k:<12} RSS {rss_s:>12} ({n} lifetime(s), {span} steps fitted)   fds {fds:+d}   "
              f"threads {thr:+d}   -> {verdict}")
        verdicts["processes"][k] = {"rss_per_10k": rss, "fds": fds, "threads": thr, "span": span}
    kinds = {e["event"] for e in ev}
    failures = [e for e in ev if e["event"] == "failure"]
    recovered = [e for e in ev if e["event"] == "recovered"]
    fired = [f for f in (schedule.faults if schedule else []) if f.pid is not None]
    lost = sum(e.get("steps_replayed", 0) for e in recovered)
    kept = sum(r["timing/step_s"] for r in res["metrics"])
    print(f"\nfaults planned {len(plan)}, injected {len(fired)}, failures seen {len(failures)}, recovered "
          f"{len(recovered)}{', ABORTED' if 'aborted' in kinds else ''} -> "
          f"{'ok' if len(recovered) >= len(fired) and 'aborted' not in kinds and res['error'] is None else 'MISSED'}")
    for f in fired:
        print(f"  step {f.step}: SIGKILL {f.target[0]} rank {f.target[1]} (pid {f.pid}) {f.delay_s:g} s into the step")
    print(f"steps lost (replayed) {lost}; recovery time {sum(e['duration_s'] for e in recovered):.1f} s; "
          f"goodput {kept:.0f} s of kept steps / {res['wall']:.0f} s wall = {kept / res['wall']:.2f}")
    if args.nan_every:
        print(f"NaN rewards injected {res['nan_injected']} (steps {nan_steps(args.steps, args.nan_every, args.seed)});"
              f" final actor weights finite: {res['finite']}")
    verdicts.update(injected=len(fired), failures=len(failures), recovered=len(recovered),
                    aborted="aborted" in kinds, steps_lost=lost, goodput=kept / res["wall"],
                    finite=res["finite"], nan_injected=res["nan_injected"],
                    error=None if res["error"] is None else repr(res["error"]))
    if ref is not None and res["digest"] is not None and ref["digest"] is not None:
        same = res["digest"] == ref["digest"]
        hist = deterministic_view(res["metrics"]) == deterministic_view(ref["metrics"])
        print(f"\nfinal actor weights vs the same run without process faults ({ref['wall']:.0f} s): "
              f"{'MATCH' if same else 'DIFFER'} ({res['digest'][:12]} / {ref['digest'][:12]}); "
              f"metric history {'MATCH' if hist else 'DIFFER'}")
        verdicts.update(weights_match=same, history_match=hist)
    return verdicts


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    root = tempfile.mkdtemp(prefix="rrl-bench-soak-")
    nans = nan_steps(args.steps, args.nan_every, args.seed)
    probe_cfg = build_config(args, root, "soak", 0)
    plan = fault_plan(args.steps, args.fault_every, args.seed, probe_cfg.actor.world_size)
    owned = cluster.connect(probe_cfg.ray)
    try:
        print(f"soak: {args.steps} steps, {len(plan)} SIGKILL(s) (every {args.fault_every}), "
              f"{len(nans)} NaN reward(s), samples every {args.sample_every} steps", flush=True)
        schedule = build_schedule(plan, args.seed)
        res = run(build_config(args, root, "soak", len(plan)), schedule, NanRewards(nans), args.sample_every)
        ref = None
        if not args.skip_reference:
            print(f"faulted run done in {res['wall']:.0f} s; reference run without process faults ...", flush=True)
            ref = run(build_config(args, root, "reference", len(plan)), None, NanRewards(nans), args.sample_every)
        return report(args, res, plan, schedule, ref)
    finally:
        cluster.disconnect(owned)  # a cluster this call did not start (a test's) stays up
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
