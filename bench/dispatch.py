"""Single-controller overhead: a worker group against bare Ray actors, measured in one run.

Two figures, each as a ratio of our runtime over plain Ray on the same cluster, with repetitions of
the two sides interleaved so that load from other processes hits both alike:

1. **startup**: a 4-worker :class:`~resilient_rl.RayWorkerGroup` (placement group of 4 bundles of
   ``--cpus-per-bundle`` CPU, a :class:`~resilient_rl.Worker` subclass that imports torch) until
   every rank answered a ping, against 4 bare ``@ray.remote`` actors (``num_cpus=0.025``) that
   import torch, until each answered a trivial call. Both are torn down between repetitions.
   Printed beside it, without a target: the first round trip (as in 2.) on those fresh workers,
   where ours also import tensordict, which a worker defers until its first DataProto.
2. **round trip**: a ``Dispatch.DP_COMPUTE_PROTO`` method on a DataProto of ``--rows`` x
   ``--cols`` float32 (1 MiB by default) over 4 ranks, returning a DataProto of the same size
   (``x * 2``), against raw Ray calls on the same 4 pre-chunked tensors followed by ``torch.cat``.

Medians are printed with the ratios and their targets (startup within 1.3x, round trip within 1.1x)::

    python bench/dispatch.py --start-reps 5 --iters 200

With ``--verl``, verl's own worker group starts in the same interleaved loop (4 ranks of a verl
``Worker`` subclass that imports torch, CPU bundles, until every rank answered a ``ONE_TO_ALL``
call), and the startup of ours is also printed as a ratio of verl's (target 0.6x). verl must be
importable beside the project, e.g. in a separate virtual environment that sees this checkout::

    PYTHONPATH=$PWD python bench/dispatch.py --verl --start-reps 7 --skip-round-trip
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# Run from a checkout: the package next to this script wins over whatever else is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cloudpickle  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from resilient_rl import (DataProto, Dispatch, RayClassWithInitArgs, RayResourcePool,  # noqa: E402
                          RayWorkerGroup, Worker, register)

# The worker classes below travel to the actors by value (this script is not importable there).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORLD = 4
START_TARGET = 1.3
CALL_TARGET = 1.1
#: Our startup over verl's, both measured here.
VERL_START_TARGET = 0.6


@ray.remote
class BenchWorker(Worker):
    """A worker group rank: imports torch, doubles its chunk of the batch."""

    def __init__(self) -> None:
        super().__init__()
        import torch  # noqa: F401 - part of what is measured (already imported by Worker's module)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] * 2})


@ray.remote(num_cpus=0.025)
class BareActor:
    """The baseline: a plain actor that imports torch and doubles a tensor."""

    def __init__(self) -> None:
        import torch  # noqa: F401

    def ping(self) -> int:
        return 0

    def double(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _start_ours(cpus_per_bundle: float) -> tuple[float, RayWorkerGroup]:
    t0 = time.perf_counter()
    pool = RayResourcePool([WORLD], use_gpu=False, max_colocate_count=1, cpus_per_bundle=cpus_per_bundle)
    # The constructor returns once every rank has answered a ping.
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=BenchWorker))
    return time.perf_counter() - t0, wg


def _start_bare() -> tuple[float, list]:
    t0 = time.perf_counter()
    actors = [BareActor.remote() for _ in range(WORLD)]
    ray.get([a.ping.remote() for a in actors])
    return time.perf_counter() - t0, actors


def _kill_bare(actors: list) -> None:
    for a in actors:
        ray.kill(a, no_restart=True)


def _verl_starter():
    """A function starting verl's worker group of ``WORLD`` ranks (seconds, stop function), or None
    where verl cannot be imported."""
    try:
        from verl.single_controller.base import Worker as VerlWorker
        from verl.single_controller.base.decorator import Dispatch as VerlDispatch
        from verl.single_controller.base.decorator import register as verl_register
        from verl.single_controller.ray import RayClassWithInitArgs as VerlClass
        from verl.single_controller.ray import RayResourcePool as VerlPool
        from verl.single_controller.ray import RayWorkerGroup as VerlGroup
    except ImportError:
        return None

    @ray.remote
    class VerlBenchWorker(VerlWorker):
        def __init__(self) -> None:
            super().__init__()
            import torch  # noqa: F401 - as our worker and the bare actor do

        @verl_register(dispatch_mode=VerlDispatch.ONE_TO_ALL)
        def ping(self) -> int:
            return 0

    def start() -> tuple[float, callable]:
        t0 = time.perf_counter()
        # One CPU per bundle (verl asks max_colocate_count CPUs per bundle), no GPU.
        pool = VerlPool([WORLD], use_gpu=False, max_colocate_count=1)
        wg = VerlGroup(pool, VerlClass(cls=VerlBenchWorker), device_name="cpu")
        wg.ping()  # every rank has started and answers
        dt = time.perf_counter() - t0

        def stop() -> None:
            for w in wg.workers:
                ray.kill(w, no_restart=True)
            for name in (f"{wg.name_prefix}_register_center",):
                try:
                    ray.kill(ray.get_actor(name), no_restart=True)
                except ValueError:
                    pass
            for pg in pool.pgs or []:
                ray.util.remove_placement_group(pg)
        return dt, stop

    return start


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_startup(reps: int, cpus_per_bundle: float, x: torch.Tensor, verl=None) -> dict[str, list[float]]:
    """Interleaved start times (seconds) of our group, of bare actors and (``verl``: its starter)
    of verl's group; who goes first rotates.

    Also the first round trip of ``x`` on the fresh workers (``first_*``): a worker imports what
    handling a batch needs (tensordict, for a DataProto) when the first one arrives, not at start.
    """
    data = DataProto.from_dict({"x": x})
    chunks = list(x.chunk(WORLD))
    out: dict[str, list[float]] = {"ours": [], "bare": [], "verl": [], "first_ours": [], "first_bare": []}
    sides = ["ours", "bare"] + (["verl"] if verl is not None else [])
    for rep in range(reps):
        for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
            if side == "verl":
                dt, stop = verl()
                stop()
            elif side == "ours":
                dt, wg = _start_ours(cpus_per_bundle)
                out["first_ours"].append(_timed(lambda: wg.double(data)))
                wg.shutdown()
            else:
                dt, actors = _start_bare()
                out["first_bare"].append(
                    _timed(lambda: torch.cat(ray.get([a.double.remote(c) for a, c in zip(actors, chunks)]))))
                _kill_bare(actors)
            out[side].append(dt)
            # Let the killed processes exit before the next start, so neither side pays for the other.
            time.sleep(0.5)
    return out


def bench_round_trip(iters: int, warmup: int, rows: int, cols: int,
                     cpus_per_bundle: float) -> tuple[list[float], list[float]]:
    """Interleaved round-trip times (seconds) of a DP_COMPUTE_PROTO call and of raw Ray calls."""
    x = torch.randn(rows, cols, dtype=torch.float32)
    data = DataProto.from_dict({"x": x})
    chunks = list(x.chunk(WORLD))
    expected = x * 2
    pool = RayResourcePool([WORLD], use_gpu=False, max_colocate_count=1, cpus_per_bundle=cpus_per_bundle)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=BenchWorker))
    actors = [BareActor.remote() for _ in range(WORLD)]
    ray.get([a.ping.remote() for a in actors])

    def ours() -> torch.Tensor:
        return wg.double(data).batch["x"]

    def bare() -> torch.Tensor:
        return torch.cat(ray.get([a.double.remote(c) for a, c in zip(actors, chunks)]))

    try:
        # Both must compute the same thing, or the comparison means nothing.
        if not (torch.equal(ours(), expected) and torch.equal(bare(), expected)):
            raise SystemExit("round-trip results differ from x * 2")
        for _ in range(warmup):
            ours()
            bare()
        ours_t, bare_t = [], []
        for i in range(iters):
            for side in ((ours, ours_t), (bare, bare_t)) if i % 2 == 0 else ((bare, bare_t), (ours, ours_t)):
                fn, out = side
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return ours_t, bare_t
    finally:
        wg.shutdown()
        _kill_bare(actors)


def _row(name: str, ours: list[float], bare: list[float], unit: float, unit_name: str,
         target: float | None) -> str:
    mo, mb = statistics.median(ours), statistics.median(bare)
    ratio = mo / mb
    goal = f"<= {target:.1f}x  {'met' if ratio <= target else 'MISSED'}" if target is not None else f"{'-':<14}"
    return (f"{name:<28} {mo * unit:>10.2f} {mb * unit:>10.2f} {unit_name:<4} {ratio:>7.3f}x   {goal}   "
            f"(n={len(ours)}, ours min {min(ours) * unit:.2f}, bare min {min(bare) * unit:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start-reps", type=int, default=5, help="startup repetitions of each side")
    parser.add_argument("--iters", type=int, default=200, help="timed round trips of each side")
    parser.add_argument("--warmup", type=int, default=20, help="untimed round trips of each side first")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=64)
    parser.add_argument("--cpus-per-bundle", type=float, default=0.1)
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--skip-round-trip", action="store_true")
    parser.add_argument("--verl", action="store_true", help="also start verl's worker group (verl must import)")
    args = parser.parse_args()
    verl = _verl_starter() if args.verl else None
    if args.verl and verl is None:
        parser.error("--verl: verl cannot be imported here (see the module docstring)")

    ray.init(address="local", num_cpus=16, include_dashboard=False)
    try:
        lines = []
        if not args.skip_startup:
            x = torch.randn(args.rows, args.cols, dtype=torch.float32)
            st = bench_startup(args.start_reps, args.cpus_per_bundle, x, verl)
            lines.append(_row(f"startup ({WORLD} workers)", st["ours"], st["bare"], 1.0, "s", START_TARGET))
            if verl is not None:
                lines.append(_row("startup, verl as the base", st["ours"], st["verl"], 1.0, "s", VERL_START_TARGET)
                             .replace(" bare ", " verl "))
                print(f"startup samples (s): verl {[round(t, 2) for t in st['verl']]}")
            lines.append(_row("  then first call (info)", st["first_ours"], st["first_bare"], 1.0, "s", None))
            print(f"startup samples (s): ours {[round(t, 2) for t in st['ours']]}, "
                  f"bare {[round(t, 2) for t in st['bare']]}")
        if not args.skip_round_trip:
            mib = args.rows * args.cols * 4 / 2**20
            ours, bare = bench_round_trip(args.iters, args.warmup, args.rows, args.cols, args.cpus_per_bundle)
            lines.append(_row(f"DP_COMPUTE_PROTO {mib:g} MiB", ours, bare, 1e3, "ms", CALL_TARGET))
    finally:
        ray.shutdown()
    print()
    print(f"{'figure (median)':<28} {'ours':>10} {'bare Ray':>10} {'':<4} {'ratio':>8}   target")
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
