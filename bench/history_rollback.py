"""What a rollback (or a resume) costs in reading ``metrics.jsonl`` as the history grows: the cut
of the rows past the restored step and the last rows kept in memory, read from the file's end,
against the same two done by reading the file from its start (as before), in the same run.

Rows are the trainer's own shape (about 1.5 KB each); the rollback drops the last 5 rows and
keeps the last 1,000 (the trainer's history window).

    python bench/history_rollback.py
    python bench/history_rollback.py --rows 10000 100000
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path

from resilient_rl.jsonl import read_jsonl
from resilient_rl.run.folder import RunDir

KEEP = 1000  # trainer.ppo.HISTORY_WINDOW


def _history(folder: Path, rows: int) -> RunDir:
    run_dir = RunDir(str(folder), "bench")
    row = {f"metric/{i}": 0.123456789 * i for i in range(60)}
    with open(run_dir.metrics_path, "w") as f:
        for step in range(1, rows + 1):
            f.write(json.dumps({"step": step, **row}) + "\n")
    return run_dir


def _from_the_start(run_dir: RunDir, step: int) -> int:
    """The earlier reads: every row parsed to find the cut and to keep the last ones."""
    cut, offset = None, 0
    with open(run_dir.metrics_path, "rb") as f:
        for raw in f:
            if json.loads(raw)["step"] > step and cut is None:
                cut = offset
            offset += len(raw)
    kept = deque(read_jsonl(run_dir.metrics_path), maxlen=KEEP)
    return len(kept) if cut is not None else 0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="rrl-history-"))
    try:
        for rows in args.rows:
            run_dir = _history(tmp / str(rows), rows)
            size = run_dir.metrics_path.stat().st_size
            t0 = time.perf_counter()
            _from_the_start(run_dir, rows - 5)
            t1 = time.perf_counter()
            run_dir.truncate_metrics_after(rows - 5)
            kept = run_dir.read_metrics(last=KEEP)
            t2 = time.perf_counter()
            assert kept[-1]["step"] == rows - 5 and len(kept) == KEEP
            print(f"{rows:>8} rows ({size / 2**20:.0f} MiB): from the end {t2 - t1:.3f} s, from the start "
                  f"{t1 - t0:.3f} s ({(t2 - t1) / (t1 - t0):.3f}x)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
