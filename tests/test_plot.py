"""``resilient-rl plot``: the figure of a run folder written the way the trainer writes it."""

from __future__ import annotations

import matplotlib.image
import pytest
from matplotlib.container import BarContainer

from resilient_rl.cli import main
from resilient_rl.errors import RunFolderError
from resilient_rl.plot import build_figure
from resilient_rl.run.info import open_run
from resilient_rl.testing.run_folder import FakeRun, play_two_failures


def _by_gid(ax, gid: str) -> list:
    return [a for a in ax.get_children() if a.get_gid() == gid]


@pytest.fixture
def run_with_failures(tmp_path) -> FakeRun:
    """12 steps, checkpoints every 3; failures at steps 8 (restores 6) and 11 (restores 9)."""
    return play_two_failures(FakeRun(tmp_path, total_steps=12, save_every=3))


def test_figure_has_three_panels_with_failures_recoveries_and_checkpoints(run_with_failures):
    fig = build_figure(open_run(str(run_with_failures.path)))
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == ["reward", "step time (s)", "KL"]
    for ax in axes:
        failures = _by_gid(ax, "failure")
        assert sorted(line.get_xdata()[0] for line in failures) == [8, 11]
        spans = _by_gid(ax, "lost-steps")
        assert len(spans) == 2
        (ticks,) = _by_gid(ax, "checkpoints")
        assert list(ticks.get_xdata()) == [3, 6, 9, 12]
    reward, step_time, kl = axes
    assert list(reward.get_lines()[0].get_xdata()) == list(range(1, 13))
    assert {line.get_label() for line in kl.get_lines()} >= {"PPO KL (new vs old policy)",
                                                             "KL to reference (reward penalty)"}
    # Step time: one bar per step, replayed steps (7-8 and 10-11) in a second colour, and each
    # recovery's wall time stacked on its failed step.
    steps = [c for c in step_time.containers if isinstance(c, BarContainer) and c.patches[0].get_gid() is None]
    bars = steps[0].patches
    assert len(bars) == 12
    colours = {round(b.get_x() + b.get_width() / 2): b.get_facecolor() for b in bars}
    replayed = {s for s in colours if colours[s] != colours[1]}
    assert replayed == {7, 8, 10, 11}
    recovery = [p for p in step_time.patches if p.get_gid() == "recovery"]
    assert sorted((round(p.get_x() + p.get_width() / 2), p.get_height()) for p in recovery) == [(8, 4.0), (11, 9.0)]
    labels = [t.get_text() for t in step_time.texts if t.get_gid() == "recovery-label"]
    assert labels == ["died: main:actor rank 1\nrecovered in 4.0 s\nreplayed 1 step(s)",
                      "timeout: main:critic rank 0\nrecovered in 9.0 s\nreplayed 1 step(s)"]
    assert "2 failures, 2 recovered" in fig.get_suptitle()


def test_aborted_run_is_marked(tmp_path):
    run = FakeRun(tmp_path)
    run.train(4)
    run.abort()
    fig = build_figure(open_run(str(run.path)))
    for ax in fig.get_axes():
        assert [line.get_xdata()[0] for line in _by_gid(ax, "abort")] == [5] and not _by_gid(ax, "failure")
    assert "run aborted" in fig.get_axes()[1].texts[0].get_text()


def test_cli_writes_a_png(run_with_failures, tmp_path, capsys):
    out = tmp_path / "figs" / "run.png"
    code = main(["-q", "plot", "demo", "--output-dir", str(tmp_path / "runs"), "--out", str(out)])
    assert code == 0 and f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(str(out)).shape
    assert (width, height) == (900, 760)
    code = main(["-q", "plot", str(run_with_failures.path)])  # default: plot.png in the run folder
    assert code == 0 and (run_with_failures.path / "plot.png").stat().st_size > 10_000


def test_nothing_to_plot_and_bad_arguments_are_errors(tmp_path, capsys):
    run = FakeRun(tmp_path)
    with pytest.raises(RunFolderError, match="no steps to plot yet"):
        build_figure(open_run(str(run.path)))
    assert main(["-q", "plot", str(run.path)]) == 2
    run.train(2)
    assert main(["-q", "plot", str(run.path), "--out", str(tmp_path / "x.jpg")]) == 2
    assert main(["-q", "plot", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "no steps to plot yet" in err and "x.jpg" in err and str(tmp_path / "absent") in err
    (tmp_path / "a-file").write_text("")
    assert main(["-q", "plot", str(run.path), "--out", str(tmp_path / "a-file" / "x.png")]) == 2  # not a folder
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'a-file' / 'x.png'}: cannot write the plot" in err and "internal error" not in err


def test_long_run_draws_lines_and_marks_replayed_steps(tmp_path):
    run = FakeRun(tmp_path, total_steps=200, save_every=50)
    run.train(120)
    run.fail()
    run.train(200)
    step_time = build_figure(open_run(str(run.path))).get_axes()[1]
    assert not [c for c in step_time.containers if c.patches[0].get_gid() is None]  # no per-step bars
    total, replayed = [line for line in step_time.get_lines() if line.get_gid() is None]
    assert len(total.get_xdata()) == 200 and list(replayed.get_xdata()) == list(range(101, 122))


def test_a_controller_restart_is_in_the_title_as_status_shows_it(tmp_path):
    """A crashed controller leaves no failure event, only the ledger's time lost to ``controller``."""
    from resilient_rl.run_status import gather_status
    from resilient_rl.telemetry.training_time import write_ledger

    run = FakeRun(tmp_path)
    run.train(6)
    assert "no failures" in build_figure(open_run(str(run.path))).get_suptitle()
    write_ledger(run.path, {"wall_s": 20.0, "updated_at": 0.0, "lost_s": {"controller": 7.5},
                            "useful": [[6, 3.0]]})
    title = build_figure(open_run(str(run.path))).get_suptitle()
    assert "7.5 s lost to a controller restart" in title and "no failures" not in title
    assert "lost: controller 7.5 s" in gather_status(str(run.path)).format_text()
