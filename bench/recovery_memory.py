"""Recovery memory: how much a SURVIVING worker's resident memory grows per recovery.

The small PPO config of ``bench/soak.py`` (colocated, 2 worker processes) trains while the same
rank is SIGKILLed every ``--fault-every`` steps (``--faults`` times), so the other process survives
every recovery. At the first step start after each recovery the survivor is sampled: its RSS
(psutil, read first), and from inside it (``__ray_call__``) its resident memory by mapping (brk
heap, anonymous mappings such as glibc's thread arenas, file-backed), glibc's heap figures
(``mallinfo2``: bytes in use by live allocations against bytes free inside the heaps: growth in
the second with the first flat is fragmentation, not a leak) and the objects the cycle collector
tracks and has frozen (``gc.freeze``).

Printed: one row per recovery; the growth per recovery of each figure (a least-squares line after
``--warmup`` recoveries); the mappings that grew. Diagnostics: ``--trim`` (RSS after
``malloc_trim(0)``, which then runs at every sample), ``--trace K`` (tracemalloc from recovery K:
where Python allocations grew), ``--garbage`` (after the last recovery, the garbage among the frozen
objects), ``--baseline`` (no faults, samples at the same steps: the steps' own growth).

    python bench/recovery_memory.py                       # 12 recoveries (~1.5 minutes here)
    python bench/recovery_memory.py --faults 20 --trim
    python bench/recovery_memory.py --faults 6 model.num_layers=2   # any config override

Measured here (2 shared cores, 12 recoveries): with glibc's default arenas (8 per core) +0.3 to
0.4 MB RSS per recovery, all of it in anonymous mappings (thread arenas), malloc in-use bytes flat
(+0.03 MB) and free bytes inside the heaps +0.2 MB per recovery; tracemalloc and the collector's
object counts flat. With ``MALLOC_ARENA_MAX=2`` (set by :func:`resilient_rl.env.limit_malloc_arenas`
for a local cluster) +0.07 MB, free bytes +0.01 MB: the steps' own growth (``--baseline``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import psutil
import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from soak import SMALL  # noqa: E402

from resilient_rl.config.schema import load_config  # noqa: E402
from resilient_rl.faults.injectors import FaultSchedule  # noqa: E402
from resilient_rl.recovery.states import RecoveryState  # noqa: E402
from resilient_rl.runtime import cluster  # noqa: E402
from resilient_rl.trainer.hooks import TrainerHook  # noqa: E402
from resilient_rl.trainer.ppo import PPOTrainer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=12, help="SIGKILLs, one per recovery (default: 12)")
    p.add_argument("--fault-every", type=int, default=3, help="a SIGKILL every N steps (default: 3)")
    p.add_argument("--killed-rank", type=int, default=1, help="the rank killed every time (default: 1)")
    p.add_argument("--warmup", type=int, default=2, help="recoveries left out of the fit (default: 2)")
    p.add_argument("--trim", action="store_true", help="also read the survivor's RSS after malloc_trim(0)")
    p.add_argument("--trace", type=int, default=None, metavar="K",
                   help="tracemalloc in the survivor from recovery K on; print where it grew since")
    p.add_argument("--garbage", action="store_true",
                   help="after the last recovery, unfreeze the survivor's objects and count the garbage")
    p.add_argument("--baseline", action="store_true",
                   help="no faults: sample at the same steps (the growth of the steps alone)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_args(argv)
    if args.faults < 1 or args.fault_every < 2 or args.warmup < 0:
        p.error("need --faults >= 1, --fault-every >= 2, --warmup >= 0")
    return args


def inside(worker, trim: bool, trace: str | None = None, garbage: bool = False) -> dict:
    """Figures read inside the worker process (run there by ``__ray_call__``): objects the cycle
    collector tracks and has frozen, resident memory by mapping kind, glibc's heap. ``trace``:
    "start" tracemalloc, or "diff" the Python allocations since (the top lines, as text);
    ``garbage``: unfreeze and count the garbage among the frozen objects (changes the process:
    the last sample only); ``trim``: ``malloc_trim(0)`` after reading."""
    import ctypes
    import gc
    import tracemalloc

    out = {"gc_tracked": len(gc.get_objects()), "gc_frozen": gc.get_freeze_count(), "trimmed": False,
           "trace": None, **smaps(), **mallinfo()}
    if garbage:
        out["garbage"] = frozen_garbage()
    if trace == "start":
        tracemalloc.start(25)
        worker._rrl_trace_start = tracemalloc.take_snapshot()
    elif trace == "diff" and tracemalloc.is_tracing():
        stats = tracemalloc.take_snapshot().compare_to(worker._rrl_trace_start, "traceback")
        out["trace"] = "\n".join(line for st in stats[:6] if st.size_diff > 0
                                 for line in [f"{st.size_diff / 1024:+.1f} KiB in {st.count_diff:+d} blocks"]
                                 + st.traceback.format(limit=12))
    if trim:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            out["trimmed"] = True
        except (OSError, AttributeError):  # not glibc
            pass
    return out


def frozen_garbage() -> str:
    """Unfreeze every object (``gc.freeze``), collect into ``gc.garbage`` and say what was garbage."""
    import collections
    import gc

    import torch

    gc.unfreeze()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found = gc.collect()
    gc.set_debug(0)
    kinds = collections.Counter(type(o).__qualname__ for o in gc.garbage)
    tensors = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    funcs = collections.Counter(f"{o.__qualname__}@{o.__code__.co_filename[-50:]}" for o in gc.garbage
                                if hasattr(o, "__code__") and hasattr(o, "__qualname__"))
    text = (f"{found} unreachable: " + " ".join(f"{t}:{n}" for t, n in kinds.most_common(20))
            + f"\n  tensors {sum(t.untyped_storage().nbytes() for t in tensors) / 2**20:.2f} MB: "
            + " ".join(str(tuple(t.shape)) for t in tensors[:20])
            + "\n  functions: " + "; ".join(f"{k} x{n}" for k, n in funcs.most_common(8)))
    gc.garbage.clear()
    gc.collect()
    return text


def mallinfo() -> dict:
    """glibc's heap figures (all arenas, bytes): in use by live allocations, and free inside the heap
    (fragmentation). Empty where the C library has no ``mallinfo2`` (not glibc, or glibc < 2.33)."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = Info
    i = fn()
    return {"malloc_used": i.uordblks + i.hblkhd, "malloc_free": i.fordblks}


def smaps() -> dict:
    """Resident kB of this process's mappings: the brk heap, anonymous mappings, file-backed ones; and
    the anonymous mappings by size, to see which grow (glibc arenas are 64 MB reservations)."""
    out = {"heap_kb": 0, "anon_kb": 0, "file_kb": 0, "maps": 0, "by_map": {}}
    name = key = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and len(head) >= 5:
                    name = "heap" if line.rstrip().endswith("[heap]") else "anon" if len(head) == 5 else "file"
                    out["maps"] += 1
                    # keyed by the start: a brk heap that grows keeps it
                    key = f"{head[0].split('-')[0]} {head[1]} {' '.join(head[5:])[-40:]}"
                elif head[0] == "Rss:":
                    out[f"{name}_kb"] += int(head[1])
                    out["by_map"][key] = int(head[1])
    except OSError:
        pass
    return out


class SurvivorSampler(TrainerHook):
    """Samples the survivor at the first step start after each recovery (and once before any)."""

    def __init__(self, survivor: int, trim: bool, trace: int | None = None):
        self.survivor, self.trim, self.trace, self.last_trace = survivor, trim, trace, None
        self.garbage_at, self.garbage = None, None
        self.every = 0  # > 0: sample every ``every`` steps instead of after recoveries
        self.recoveries, self.pending, self.rows = 0, True, []

    def on_recovery_state(self, trainer, state) -> None:
        if state is RecoveryState.RESTORING:  # the last state before RUNNING (which is not announced)
            self.recoveries += 1
            self.pending = True

    def on_step_start(self, trainer, step: int) -> None:
        if self.every and step > 1 and step % self.every == 0:  # the baseline: no faults, same steps
            self.recoveries += 1
            self.pending = True
        if not self.pending:
            return
        self.pending = False
        handle = trainer.roles.groups["actor"].workers[self.survivor]
        pid = next(pid for (role, rank), pid in _pids(trainer).items() if rank == self.survivor)
        rss = psutil.Process(pid).memory_info().rss  # before anything runs inside it
        trace = None if self.trace is None else ("start" if self.recoveries == self.trace else
                                                 "diff" if self.recoveries > self.trace else None)
        last = self.garbage_at is not None and self.recoveries >= self.garbage_at
        info = ray.get(handle.__ray_call__.remote(inside, self.trim, trace, last), timeout=120)
        if last:
            self.garbage_at, self.garbage = None, info.pop("garbage")
        trimmed = psutil.Process(pid).memory_info().rss if info.pop("trimmed") else None
        self.last_trace = info.pop("trace") or self.last_trace
        self.rows.append({"recoveries": self.recoveries, "step": step, "pid": pid, "rss": rss,
                          "rss_trimmed": trimmed, **info})


def _pids(trainer) -> dict:
    from resilient_rl.faults.injectors import role_pids

    return role_pids(trainer.roles)


def per_recovery(rows: list[dict], key: str, warmup: int) -> float | None:
    """Least-squares growth of ``key`` per recovery over the rows after ``warmup`` recoveries."""
    pts = [(r["recoveries"], r[key]) for r in rows if r["recoveries"] >= warmup and r.get(key) is not None]
    if len(pts) < 3:
        return None
    x, y = np.array(pts, dtype=float).T
    return float(np.polyfit(x, y, 1)[0])


def run(args) -> tuple[SurvivorSampler, FaultSchedule, float]:
    """Train with the kills and the sampler; the sampler, the schedule and the wall time."""
    root = tempfile.mkdtemp(prefix="rrl-bench-recmem-")
    budget = args.faults + 5
    cfg = load_config(None, [*SMALL, f"trainer.total_steps={args.fault_every * (args.faults + 1)}",
                             f"trainer.output_dir={root}/runs", f"checkpoint.root={root}/ckpt",
                             "trainer.run_name=recmem", f"recovery.max_restarts={budget}",
                             f"recovery.max_failures={budget}", *args.overrides])
    schedule = FaultSchedule(seed=0)
    for k in range(1, 0 if args.baseline else args.faults + 1):
        schedule.at_step(k * args.fault_every).kill("actor", args.killed_rank, delay_s=0.05)
    sampler = SurvivorSampler(1 - args.killed_rank, args.trim, args.trace)
    sampler.every = args.fault_every if args.baseline else 0
    sampler.garbage_at = args.faults if args.garbage else None
    owned = cluster.connect(cfg.ray)
    t0 = time.time()
    try:
        trainer = PPOTrainer(cfg, hooks=[sampler, schedule])
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
    finally:
        cluster.disconnect(owned)
        shutil.rmtree(root, ignore_errors=True)
    return sampler, schedule, time.time() - t0


FIGURES = ("rss", "rss_trimmed", "heap_kb", "anon_kb", "file_kb", "malloc_used", "malloc_free", "gc_tracked",
           "gc_frozen")


def report(args, sampler: SurvivorSampler, schedule: FaultSchedule, wall: float) -> dict:
    """Print the rows and the growth per recovery; returns them."""
    rows = sampler.rows
    fired = [f for f in schedule.faults if f.pid is not None]
    print(f"\nsurvivor rank {sampler.survivor}: {len(fired)} of {len(schedule.faults)} SIGKILLs of rank "
          f"{args.killed_rank} fired, {sampler.recoveries} {'samples' if args.baseline else 'recoveries'} "
          f"in {wall:.0f} s")
    print(f"{'recov':>5} {'step':>5} {'pid':>8} {'RSS MB':>9} {'trimmed':>8} {'heap MB':>8} {'anon MB':>8} "
          f"{'file MB':>8} {'maps':>5} {'malloc used':>11} {'free':>6} {'gc tracked':>11} {'frozen':>8}")
    for r in rows:
        trimmed = "-" if r["rss_trimmed"] is None else f"{r['rss_trimmed'] / 2**20:.1f}"
        print(f"{r['recoveries']:>5} {r['step']:>5} {r['pid']:>8} {r['rss'] / 2**20:>9.1f} {trimmed:>8} "
              f"{r['heap_kb'] / 1024:>8.1f} {r['anon_kb'] / 1024:>8.1f} {r['file_kb'] / 1024:>8.1f} "
              f"{r['maps']:>5} {r.get('malloc_used', 0) / 2**20:>11.1f} {r.get('malloc_free', 0) / 2**20:>6.1f} "
              f"{r['gc_tracked']:>11} {r['gc_frozen']:>8}")
    figures = {k: per_recovery(rows, k, args.warmup) for k in FIGURES}
    fmt = {k: "n/a" if v is None else f"{v / 2**20:+.2f} MB" if k.startswith(("rss", "malloc"))
           else f"{v / 1024:+.2f} MB" if k.endswith("_kb") else f"{v:+.0f}" for k, v in figures.items()}
    print(f"\nper recovery (fit after {args.warmup}): RSS {fmt['rss']}, after malloc_trim {fmt['rss_trimmed']}\n"
          f"  resident: brk heap {fmt['heap_kb']}, anonymous mappings {fmt['anon_kb']}, file-backed "
          f"{fmt['file_kb']}\n  glibc malloc: in use {fmt['malloc_used']}, free inside its heaps "
          f"{fmt['malloc_free']}\n  objects: gc-tracked {fmt['gc_tracked']}, frozen {fmt['gc_frozen']}")
    if len(rows) > 2:
        print("\nmappings grown since sample 1 (resident kB):\n  " + "\n  ".join(grown_maps(rows[1], rows[-1])))
    if sampler.garbage:
        print(f"\nsurvivor's frozen objects after the last recovery: {sampler.garbage}")
    if sampler.last_trace:
        print(f"\nsurvivor's Python allocations grown since recovery {args.trace} (tracemalloc):\n"
              f"{sampler.last_trace}")
    if len({r["pid"] for r in rows}) > 1:
        print("WARNING: the survivor's pid changed: it did not survive every recovery")
    return {"rows": rows, "per_recovery": figures}


def grown_maps(first: dict, last: dict, top: int = 12) -> list[str]:
    """The mappings whose resident kB grew most from ``first`` to ``last`` (new ones count whole)."""
    a, b = first["by_map"], last["by_map"]
    grown = sorted(((b[k] - a.get(k, 0), k) for k in b if b[k] != a.get(k, 0)), reverse=True)
    return [f"{d:+d} {k}" for d, k in grown[:top]]


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    return report(args, *run(args))


if __name__ == "__main__":
    main()
