"""Whether two runs trained the same: their metrics histories (``metrics.jsonl`` of each run
folder) compared step by step, every key but the measured times and counts (``timing/*``,
``perf/*``: :func:`resilient_rl.run.folder.deterministic_view`).

Two fault-free runs of one config on two versions of the code must print ``identical``: a change
that reshapes code (no change of behaviour meant) is checked so.

    python bench/same_history.py RUN_A RUN_B
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

def history(run: Path) -> list[dict]:
    """The run's metrics history as it must match bit for bit (``deterministic_view``)."""
    from resilient_rl.jsonl import read_jsonl
    from resilient_rl.run.folder import deterministic_view

    return deterministic_view(read_jsonl(run / "metrics.jsonl"))


def differences(a: list[dict], b: list[dict]) -> list[str]:
    """One line per step whose compared keys differ (or per step only one run has)."""
    out = [f"steps: {len(a)} against {len(b)}"] if len(a) != len(b) else []
    for x, y in zip(a, b):
        keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        if keys:
            out.append(f"step {x.get('step')}: {', '.join(keys)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args(argv)
    a, b = history(args.run_a), history(args.run_b)
    diff = differences(a, b)
    keys = len(a[0]) if a else 0
    print(f"{len(a)} steps, {keys} keys compared (timing/* and perf/* left out): "
          + ("identical" if not diff else f"{len(diff)} differences"))
    for line in diff[:20]:
        print(line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
