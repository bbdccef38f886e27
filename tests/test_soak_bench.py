"""bench/soak.py: its schedules, growth fit, table and NaN wrapper without Ray, and (slow) a short
soak with one fault on a local Ray cluster. Nothing here asserts a timing."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from resilient_rl.data.tasks import CopyTask

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def soak(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import soak

    return soak


def test_fault_plan_is_seeded_periodic_and_names_real_workers(soak):
    plan = soak.fault_plan(200, 50, seed=3, world_size=2)
    assert [f["step"] for f in plan] == [50, 100, 150]
    assert all(f["role"] in soak.ROLES and 0 <= f["rank"] < 2 and 0 <= f["delay_s"] <= 0.3 for f in plan)
    assert plan == soak.fault_plan(200, 50, seed=3, world_size=2)
    assert plan != soak.fault_plan(2000, 50, seed=4, world_size=2)[:3]
    assert soak.fault_plan(200, 0, 0, 2) == []
    assert [f["step"] for f in soak.fault_plan(100, 50, 0, 2)] == [50]  # never on the last step
    schedule = soak.build_schedule(plan, seed=3)
    assert [(f.step, f.kind, f.role, f.rank) for f in schedule.faults] == [
        (f["step"], "sigkill", f["role"], f["rank"]) for f in plan]


def test_nan_steps_one_per_block_within_the_run(soak):
    steps = soak.nan_steps(100, 20, seed=1)
    assert len(steps) == 5 and steps == sorted(steps)
    for i, s in enumerate(steps):
        assert 2 + 20 * i <= s < 22 + 20 * i and s <= 100
    assert steps == soak.nan_steps(100, 20, seed=1)
    assert soak.nan_steps(100, 0, 1) == []


def test_nan_rewards_poison_one_sample_of_the_chosen_steps_only(soak):
    nan = soak.NanRewards([3])
    nan.task = CopyTask()
    assert nan.name == "copy" and len(nan.make_prompts(4, np.random.default_rng(0))) == 4
    nan.on_step_start(None, 2)
    assert not any(math.isnan(nan.reward("12", "12")) for _ in range(3))
    nan.on_step_start(None, 3)
    scores = [nan.reward("12", "12") for _ in range(3)]
    assert math.isnan(scores[0]) and scores[1:] == [1.0, 1.0]
    nan.on_step_start(None, 3)  # a replayed step gets the same NaN
    assert math.isnan(nan.reward("12", "12")) and nan.injected == 2


def _samples(soak, rss_by_step, label="controller", pid_of=lambda x: 1, fds=10, threads=5):
    return [soak.Sample(x, x, float(x), {label: (pid_of(x), rss, fds, threads)}) for x, rss in rss_by_step]


def test_growth_fits_a_line_after_warmup_and_per_process_lifetime(soak):
    assert soak.slope_per_10k([(0, 0), (1, 2), (2, 4)]) == pytest.approx(20_000)
    assert soak.slope_per_10k([(0, 0), (1, 2)]) is None
    # 1 kB per step after a warm-up whose big first jump must not count
    pts = [(0, 0)] + [(x, 100_000_000 + 1000 * x) for x in range(10, 1001, 10)]
    slope, n, span = soak.growth(_samples(soak, pts), "controller", warmup=10)
    assert slope == pytest.approx(1000 * 10_000) and n == 1 and span == 990
    # a restart at 500 starts afresh: two flat lifetimes are flat, not a saw-tooth fit
    restart = [(x, 300e6 if x < 500 else 200e6) for x in range(0, 1000, 10)]
    slope, n, _ = soak.growth(_samples(soak, restart, "worker0", pid_of=lambda x: 1 if x < 500 else 2), "worker0", 0)
    assert slope == pytest.approx(0, abs=1.0) and n == 2  # < 1 byte per 10k steps
    assert soak.growth(_samples(soak, pts[:3]), "controller", warmup=10) == (None, 0, 0)


def test_settled_delta_is_the_largest_growth_of_any_lifetime(soak):
    # pid 1 survives recoveries and keeps their fds (10 -> 50), then is killed; pid 2 stays flat
    samples = [soak.Sample(x, x, 0.0, {"w": (1 if x < 50 else 2, 0, 10 + x if x < 50 else 60, 5)})
               for x in range(0, 100, 10)]
    assert soak.settled_delta(samples, "w", warmup=0, metric=2) == 40
    assert soak.settled_delta(samples, "w", warmup=20, metric=2) == 20  # 30 -> 50 after pid 1's warm-up
    assert soak.settled_delta(samples, "w", warmup=0, metric=3) == 0
    assert soak.settled_delta(samples, "nobody", 0, 2) is None


def test_table_has_a_row_per_sample_and_a_column_per_process(soak):
    samples = [soak.Sample(1, 1, 100.0, {"controller": (7, 300 * 2**20, 30, 20), "worker0": (8, 2**30, 50, 31)}),
               soak.Sample(11, 10, 105.0, {"controller": (7, 301 * 2**20, 30, 20)})]
    lines = soak.format_table(samples).splitlines()
    assert len(lines) == 3 and "controller" in lines[0] and "worker0" in lines[0]
    assert "300.0MB" in lines[1] and "1024.0MB" in lines[1] and lines[2].split()[:3] == ["10", "11", "5"]
    assert lines[2].rstrip().endswith("-")  # worker0 not sampled (between kill and restart)


def test_arguments_are_checked(soak):
    for bad in (["--steps", "1"], ["--fault-every", "-1"], ["--sample-every", "0"], ["--warmup", "-2"]):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)
    args = soak.parse_args(["--steps", "1000", "model.num_layers=2"])
    assert args.warmup == 200 and args.nan_every == 40 and args.overrides == ["model.num_layers=2"]


@pytest.mark.slow
def test_short_soak_recovers_its_fault_and_matches_the_fault_free_run(soak, ray_cluster, capsys):
    out = soak.main(["--steps", "30", "--fault-every", "15", "--sample-every", "5", "--warmup", "5",
                     "--nan-every", "10"])
    assert out["injected"] == 1 and out["recovered"] >= 1 and not out["aborted"]
    assert out["weights_match"] and out["history_match"] and out["finite"]
    assert {"controller", "worker0", "worker1"} <= set(out["processes"])
    assert "MATCH" in capsys.readouterr().out
