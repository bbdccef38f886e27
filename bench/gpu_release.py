"""How long a killed process's GPU memory stays held, against the same process freeing it itself.

A warm spare takes a dead rank's GPU as soon as the controller hears of the death, and its first
model build can find the dead process's memory still held (``resilient_rl/workers/held_memory.py``
then waits for it). This measures that window. A child process allocates ``--gib`` GiB on the
device and is SIGKILLed; this process (its own context on the same device) reads the memory in use
every millisecond and prints when the child was reaped (its exit status readable: by then Ray has
seen its sockets close) and when its memory came free. The baseline, in the same run: a child that
frees the same memory itself (``torch.cuda.empty_cache``) when asked.

    python bench/gpu_release.py --gib 32 --repeats 3
    python bench/gpu_release.py --device cpu --gib 2   # host memory: the child's resident set

On a GPU the reading is the device's memory in use, which is the child's alone where the bench has
the device to itself. On a CPU (``--device cpu``, the default where there is no GPU) the same path
runs on host memory, and the reading is the child's own resident set: the host's free memory moves
with every other process on the machine, by more than the child holds.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

GIB = 2**30

#: The share of the child's memory that must be free again to count as released (on a GPU, other
#: processes on the device move the reading a little meanwhile).
RELEASED = 0.9


def used_bytes(device: str, pid: int) -> int:
    """Memory in use that the child ``pid`` holds: ``cuda``, the device's in use by the driver's count
    (all of it, the child's where the bench has the device to itself); ``cpu``, the child's resident
    set, 0 once it has exited (the kernel drops an exiting process's memory before it can be reaped,
    and a zombie's status has no ``VmRSS``)."""
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(total - free)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:  # reaped
        pass
    return 0


def child(device: str, gib: float) -> None:
    """Say ``started`` (its imports and, on CUDA, its context are in place), then at the next line
    on stdin allocate and touch ``gib`` GiB on ``device`` and say ``ready``; free it when another
    line arrives (saying ``freed``), or wait to be killed."""
    import torch

    if device == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    print("started", flush=True)
    sys.stdin.readline()
    held = torch.ones(int(gib * GIB), dtype=torch.uint8, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    del held
    if device == "cuda":
        torch.cuda.empty_cache()
    print("freed", flush=True)
    sys.stdin.readline()


def _start(device: str, gib: float) -> tuple[subprocess.Popen, int, int]:
    """A child holding ``gib`` GiB on ``device``, with the memory in use before and after its
    allocation (its interpreter, imports and context are in both)."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--device", device, "--gib", str(gib)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() == "started":
        before = used_bytes(device, proc.pid)
        proc.stdin.write("allocate\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() == "ready":
            return proc, before, used_bytes(device, proc.pid)
    proc.kill()
    raise RuntimeError("the child process did not allocate its memory")


def _until_free(device: str, pid: int, target: int, started: float, timeout_s: float) -> float:
    """Seconds from ``started`` until the memory in use falls to ``target``."""
    while time.perf_counter() - started < timeout_s:
        if used_bytes(device, pid) <= target:
            return time.perf_counter() - started
        time.sleep(0.001)
    raise TimeoutError(f"the memory did not come free within {timeout_s:g} s")


def killed(device: str, gib: float, timeout_s: float) -> dict[str, float]:
    """One child SIGKILLed while it holds ``gib`` GiB: when it was reaped, when its memory was free,
    and how much of it was still held at the reap."""
    proc, before, at_ready = _start(device, gib)
    held = at_ready - before
    started = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    reaped = time.perf_counter() - started
    in_use_at_reap = used_bytes(device, proc.pid)
    freed = _until_free(device, proc.pid, at_ready - int(RELEASED * held), started, timeout_s)
    return {"reaped": reaped, "freed": freed, "held": held, "still_held_at_reap": max(0, in_use_at_reap - before)}


def freed_itself(device: str, gib: float, timeout_s: float) -> dict[str, float]:
    """One child asked to free its ``gib`` GiB itself: when the memory was free."""
    proc, before, at_ready = _start(device, gib)
    started = time.perf_counter()
    proc.stdin.write("free\n")
    proc.stdin.flush()
    freed = _until_free(device, proc.pid, at_ready - int(RELEASED * (at_ready - before)), started, timeout_s)
    proc.stdin.write("done\n")
    proc.stdin.flush()
    proc.wait()
    return {"freed": freed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where there is one")
    parser.add_argument("--gib", type=float, default=32.0, help="memory the child holds (default 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the memory each time")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1:
        parser.error("--gib must be > 0 and --repeats >= 1")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.child:
        child(device, args.gib)
        return 0
    if device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
        torch.cuda.init()
        name = torch.cuda.get_device_name()
    else:
        name = "host memory"
    kills, selves = [], []
    for i in range(args.repeats):  # alternated: a drift of the machine falls on both
        kills.append(killed(device, args.gib, args.timeout))
        selves.append(freed_itself(device, args.gib, args.timeout))
        k = kills[-1]
        # The child allocates --gib; what the reading moved by is a measurement (on a GPU, other
        # processes on the device move it too).
        print(f"repeat {i + 1}: killed holding {args.gib:g} GiB ({k['held'] / GIB:.1f} GiB measured): reaped after "
              f"{k['reaped'] * 1e3:.1f} ms "
              f"({k['still_held_at_reap'] / GIB:.1f} GiB still held then), free after {k['freed'] * 1e3:.1f} ms; "
              f"freed by itself after {selves[-1]['freed'] * 1e3:.1f} ms", flush=True)
    kill_s = statistics.median(k["freed"] for k in kills)
    self_s = statistics.median(s["freed"] for s in selves)
    reap_s = statistics.median(k["reaped"] for k in kills)
    still = statistics.median(k["still_held_at_reap"] for k in kills)
    print(f"{name}, {args.gib:g} GiB, medians of {args.repeats}: a killed process's memory free after "
          f"{kill_s * 1e3:.1f} ms ({reap_s * 1e3:.1f} ms to its reap, {still / GIB:.1f} GiB still held then); "
          f"freed by the process itself after {self_s * 1e3:.1f} ms: {kill_s / self_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
