"""A preemption signal to a controller stuck in a read from Ray's control plane once it is gone:
seconds from the SIGTERM to the process's exit, and its exit code, with the signal watch
(``trainer.preemption``'s defaults) against the handlers alone, in the same run.

Each case starts ``resilient_rl/testing/stuck_controller.py`` (a local Ray cluster whose GCS it
kills, then ``ray.nodes()``), sends SIGTERM once it is about to read, and waits for it to end.
``sent``: the signal lands as the read starts; ``acted on``: the controller handled it, then read.

    python bench/stuck_controller.py [--no-baseline]
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from resilient_rl.testing.stuck_controller import start, stop, until_reading  # noqa: E402


def exit_after_signal(mode: str, answer_within: str | None) -> tuple[float, int]:
    """(seconds from the SIGTERM to the exit, exit code) of one stuck controller."""
    proc = start(mode, answer_within)
    try:
        until_reading(proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=180)
        return time.monotonic() - sent, proc.returncode
    finally:
        stop(proc)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the handlers-alone runs (each waits for Ray to end the process, about 60 s)")
    args = p.parse_args(argv)
    print("case                        watch                 handlers alone        ratio")
    for mode in ("sent", "acted on"):
        watched, code = exit_after_signal(mode, None)
        line = f"{mode:<27} {watched:6.2f} s, exit {code:<3}"
        if not args.no_baseline:
            alone, alone_code = exit_after_signal(mode, "none")
            line += f"     {alone:6.2f} s, exit {alone_code:<3}     {watched / alone:.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
