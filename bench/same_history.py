"""Whether two runs trained the same: their metrics histories (``metrics.jsonl`` of each run
folder) compared step by step, every key but the measured times and rates.

Two fault-free runs of one config on two versions of the code must print ``identical``: a change
that reshapes code (no change of behaviour meant) is checked so.

    python bench/same_history.py RUN_A RUN_B
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: Keys that measure time or rate: they differ between any two runs.
MEASURED = ("timing/", "perf/")


def history(run: Path) -> list[dict]:
    with open(run / "metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(MEASURED)} for line in f]


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
    print(f"{len(a)} steps, {keys} keys compared (measured times and rates left out): "
          + ("identical" if not diff else f"{len(diff)} differences"))
    for line in diff[:20]:
        print(line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
