"""bench/recovery_memory.py: its growth fit and its readings of this process, without Ray."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import recovery_memory

    return recovery_memory


def test_growth_per_recovery_is_fitted_after_the_warmup(bench):
    rows = [{"recoveries": k, "rss": 100 + (50 if k < 2 else 3 * k)} for k in range(8)]
    assert bench.per_recovery(rows, "rss", warmup=2) == pytest.approx(3.0)
    assert bench.per_recovery(rows[:4], "rss", warmup=2) is None  # fewer than 3 points
    assert bench.per_recovery([{**r, "rss": None} for r in rows], "rss", warmup=0) is None


def test_grown_mappings_are_ranked_and_new_ones_count_whole(bench):
    first = {"by_map": {"a": 10, "b": 5, "c": 7}}
    last = {"by_map": {"a": 30, "b": 5, "c": 6, "d": 12}}
    assert bench.grown_maps(first, last) == ["+20 a", "+12 d", "-1 c"]


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/smaps")
def test_this_process_resident_memory_is_read_by_mapping_kind(bench):
    got = bench.smaps()
    assert got["maps"] == len(got["by_map"]) > 0
    assert got["file_kb"] > 0 and got["anon_kb"] + got["heap_kb"] > 0
    info = bench.mallinfo()  # {} where the C library is not glibc >= 2.33
    assert not info or info["malloc_used"] > 0 <= info["malloc_free"]
