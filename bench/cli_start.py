"""How long ``resilient-rl status RUN`` (and ``checkpoints list``, ``plot``) takes from start to
exit, as a ratio against ``python -c pass`` measured in the same run.

Each command runs as a fresh process, as a user types it, alternated with the baseline
``--repeats`` times; medians. RUN is a run folder made for the purpose (a few steps, checkpoints
and a recovered failure, written by :class:`~resilient_rl.testing.run_folder.FakeRun`) unless
``--output-dir`` and ``--root`` name a real run's folders.

    python bench/cli_start.py
    python bench/cli_start.py --repeats 9 --run ppo-copy --output-dir runs --root checkpoints
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="alternated rounds; medians (default 5)")
    p.add_argument("--run", default="bench", help="run name (default: a made-up run)")
    p.add_argument("--output-dir", default=None, help="the run's trainer.output_dir (default: a made-up run)")
    p.add_argument("--root", default=None, help="the run's checkpoint.root (default: a made-up run)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if (args.output_dir is None) != (args.root is None):
        p.error("--output-dir and --root go together")
    return args


def made_up_run(base: Path, name: str) -> tuple[str, str]:
    """A run folder and its checkpoints under ``base``; returns (output_dir, root)."""
    from resilient_rl.testing.run_folder import FakeRun  # only here: the bench times other processes

    run = FakeRun(base, name, total_steps=20, save_every=5)
    run.train(12)
    run.fail()
    run.train(20)
    return run.cfg.trainer.output_dir, run.cfg.checkpoint.root


def seconds(argv: list[str]) -> float:
    """Wall-clock seconds of one process from spawn to exit; it must succeed."""
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        output_dir, root = ((args.output_dir, args.root) if args.output_dir
                            else made_up_run(Path(tmp), args.run))
        cli = [sys.executable, "-m", "resilient_rl.cli"]
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "resilient-rl status RUN": [*cli, "status", args.run, "--output-dir", output_dir, "--root", root],
            "resilient-rl checkpoints list RUN": [*cli, "checkpoints", "list", args.run, "--root", root],
            "resilient-rl plot RUN": [*cli, "plot", args.run, "--output-dir", output_dir,
                                      "--out", str(Path(tmp) / "plot.png")],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, command in commands.items():
                times[name].append(seconds(command))
    base = statistics.median(times["python -c pass"])
    print(f"bench/cli_start.py: median of {args.repeats}, wall-clock from spawn to exit")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:36s} {median:6.3f} s  x{median / base:5.1f} of python -c pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
