"""``resilient-rl plot RUN``: reward, step time and KL over steps, with where the run lost time.

:func:`build_figure` draws three panels sharing the step axis from a run folder
(:mod:`resilient_rl.run.info`): mean reward (and the validation passes' reward on the held-out
prompts, where the run validated), step duration and KL. Every panel marks each failure
(a red dashed line at the step that failed) and the steps it cost (a shaded span from the
checkpoint it restored to the failed step), each committed checkpoint (a green tick on the step
axis) and an aborted run (a black line). The step-time panel labels each failure with its
cause, the worker, and the time its recovery took; replayed steps are drawn in orange there.

matplotlib is imported here only, and drawn through its Agg canvas (no display, no pyplot
state), so importing the CLI stays cheap and plotting works on a headless machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from resilient_rl.errors import ConfigError, RunFolderError
from resilient_rl.run.info import RunFiles, checkpoint_steps, failure_episodes, goodput, open_run
from resilient_rl.telemetry.training_time import read_ledger

#: (row key, label) of the KL series, drawn when present: the policy's drift within a step, and
#: the divergence from the reference policy (in the reward, or as a loss term).
KL_SERIES = (("actor/ppo_kl", "PPO KL (new vs old policy)"),
             ("actor/reward_kl_penalty", "KL to reference (reward penalty)"),
             ("actor/kl_loss", "KL to reference (loss term)"))
# Step-time panels draw bars up to this many steps, a line beyond (bars would be sub-pixel).
_MAX_BARS = 150
_MAX_LABELS = 12
_BLUE, _ORANGE, _RED, _GREEN, _GREY, _PURPLE = "#1f77b4", "#ff7f0e", "#d62728", "#2ca02c", "#7f7f7f", "#9467bd"


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def _replayed_steps(episodes) -> set[int]:
    """Steps that ran twice: after a recovery, from the restored checkpoint up to the failed step."""
    out: set[int] = set()
    for f in episodes:
        if f.outcome == "recovered" and f.restored_step is not None:
            out.update(range(int(f.restored_step) + 1, f.step + 1))
    return out


def _title(run: RunFiles, episodes, rows) -> str:
    recovered = [f for f in episodes if f.outcome == "recovered"]
    parts = [f"{sum(1 for r in rows if int(r['step']) > 0)} steps"]  # a step 0 row is a validation only
    if episodes:
        lost = sum(float(f.recovery_s or 0.0) for f in recovered)
        parts.append(f"{len(episodes)} failure{'s' if len(episodes) != 1 else ''}, {len(recovered)} recovered "
                     f"({lost:.1f} s recovering, {sum(f.steps_replayed for f in recovered)} step(s) replayed)")
    # A crashed controller and its successor leave no failure event, only the time the run's
    # ledger lost to cause "controller" (what status shows on its ettr line).
    ledger = read_ledger(run.path)
    controller_lost = ledger["lost_s"].get("controller", 0.0) if ledger is not None else 0.0
    if controller_lost > 0:
        parts.append(f"{controller_lost:.1f} s lost to a controller restart")
    if not episodes and controller_lost <= 0:
        parts.append("no failures")
    gp = goodput(run)
    if gp is not None:
        parts.append(f"goodput {gp[0]:.0%}")
    return f"run {run.name}: " + ", ".join(parts)


def build_figure(run: RunFiles) -> Figure:
    """The run's figure: three axes (reward, step time, KL) sharing the step axis.

    Artists that mark events carry a ``gid`` (``failure``, ``lost-steps``, ``checkpoints``,
    ``abort``, ``recovery-label``), so a caller can find them.

    Raises:
        RunFolderError: the run has no metrics rows yet (nothing to draw).
    """
    rows = run.metrics
    if not rows:
        raise RunFolderError(f"{run.path}: no steps to plot yet (metrics.jsonl is empty or missing)")
    episodes = failure_episodes(run.events, run.name)
    replayed = _replayed_steps(episodes)
    ckpts = checkpoint_steps(run.events)

    fig = Figure(figsize=(9.0, 7.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_r, ax_t, ax_k = fig.subplots(3, 1, sharex=True, height_ratios=(1.0, 1.0, 0.9))

    steps, reward = _series(rows, "reward/mean")
    ax_r.plot(steps, reward, color=_BLUE, lw=1.6, label="mean reward")
    ex_steps, exact = _series(rows, "reward/exact_ratio")
    if exact:
        ax_r.plot(ex_steps, exact, color=_BLUE, lw=1.0, ls=":", alpha=0.8, label="exact-match ratio")
    v_steps, v_reward = _series(rows, "val/reward_mean")
    if v_reward:
        ax_r.plot(v_steps, v_reward, color=_PURPLE, lw=1.2, marker="o", ms=4, label="validation reward (mean)",
                  gid="validation")
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="best", fontsize=8, frameon=False)

    t_steps, t = _series(rows, "timing/step_s")
    colors = [_ORANGE if s in replayed else _BLUE for s in t_steps]
    if len(t_steps) <= _MAX_BARS:
        ax_t.bar(t_steps, t, width=0.8, color=colors, alpha=0.85)
    else:
        ax_t.plot(t_steps, t, color=_BLUE, lw=1.0)
        rs = [(s, v) for s, v in zip(t_steps, t) if s in replayed]
        ax_t.plot([p[0] for p in rs], [p[1] for p in rs], ls="", marker=".", color=_ORANGE)
    # The wall time each recovery took, stacked on the failed step's bar: where the run lost time.
    by_step = dict(zip(t_steps, t))
    tops = list(t)
    for f in episodes:
        if f.recovery_s:
            base = by_step.get(f.step, 0.0)
            ax_t.bar([f.step], [float(f.recovery_s)], bottom=[base], width=0.8, color=_RED, alpha=0.35,
                     hatch="///", edgecolor=_RED, lw=0.6, gid="recovery")
            tops.append(base + float(f.recovery_s))
    ax_t.set_ylabel("step time (s)")
    ax_t.set_ylim(0, max(tops) * 1.35 if tops else 1)   # headroom for the failure labels

    drawn = 0
    for key, label in KL_SERIES:
        k_steps, k = _series(rows, key)
        if k:
            ax_k.plot(k_steps, k, lw=1.4, label=label)
            drawn += 1
    if drawn:
        ax_k.legend(loc="upper left", fontsize=8, frameon=False)
    else:
        ax_k.text(0.5, 0.5, "no KL metric in this run", transform=ax_k.transAxes, ha="center", color=_GREY)
    ax_k.set_ylabel("KL")
    ax_k.set_xlabel("step")

    for ax in (ax_r, ax_t, ax_k):
        ax.grid(True, alpha=0.25, lw=0.6)
        for f in episodes:
            if f.outcome == "recovered" and f.restored_step is not None:
                ax.axvspan(f.restored_step + 0.5, f.step + 0.5, color=_RED, alpha=0.08, lw=0, gid="lost-steps")
            ax.axvline(f.step, color=_RED if f.outcome != "aborted" else "black", ls="--", lw=1.2,
                       gid="failure" if f.outcome != "aborted" else "abort")
        if ckpts:
            ax.plot(ckpts, [0.0] * len(ckpts), ls="", marker="^", ms=7, color=_GREEN, clip_on=False, zorder=5,
                    transform=ax.get_xaxis_transform(), gid="checkpoints")
    last = max([int(r["step"]) for r in rows] + [f.step for f in episodes])   # a failed last step too
    ax_k.set_xlim(-0.6 if any(int(r["step"]) == 0 for r in rows) else 0.4, last + 0.6)
    # Past a dozen failures the labels would cover the bars; the title still counts them.
    for i, f in enumerate(episodes if len(episodes) <= _MAX_LABELS else []):
        if f.outcome == "recovered":
            what = f"recovered in {float(f.recovery_s or 0):.1f} s\nreplayed {f.steps_replayed} step(s)"
        elif f.outcome == "aborted":
            what = "run aborted"
        else:
            what = "no recovery recorded"
        colour = "black" if f.outcome == "aborted" else _RED
        right = f.step > 0.7 * last   # near the right edge the label goes left of its line
        ax_t.annotate(f"{f.cause}: {f.who}\n{what}", xy=(f.step, 1.0), xycoords=ax_t.get_xaxis_transform(),
                      xytext=(-10 if right else 10, -4 - 30 * (i % 2)), textcoords="offset points",
                      ha="right" if right else "left", va="top", fontsize=8,
                      color=colour, gid="recovery-label",
                      bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": colour, "lw": 0.6, "alpha": 0.9})

    handles = [Line2D([], [], color=_RED, ls="--", label="failure (step that failed)"),
               Patch(color=_RED, alpha=0.15, label="steps lost, replayed"),
               Patch(color=_ORANGE, alpha=0.85, label="replayed step"),
               Patch(fc=_RED, alpha=0.35, hatch="///", ec=_RED, label="recovery (wall time)"),
               Line2D([], [], color=_GREEN, marker="^", ls="", label="checkpoint committed")]
    if any(f.outcome == "aborted" for f in episodes):
        handles.append(Line2D([], [], color="black", ls="--", label="run aborted"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles) if len(handles) <= 5 else 3,
               fontsize=8, frameon=False)
    fig.suptitle(_title(run, episodes, rows), fontsize=11)
    return fig


def write_plot(target: str, out: str | None = None, output_dir: str | None = None, dpi: int = 100) -> Path:
    """Draw the run named by ``target`` (run name or folder) into a PNG; returns its path
    (default ``{run folder}/plot.png``)."""
    run = open_run(target, output_dir)
    path = Path(out) if out else run.path / "plot.png"
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--out {path}: the plot is a PNG, give a file name ending in .png")
    fig = build_figure(run)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    except OSError as exc:  # a path the user gave: name it, with the reason (exit 2, not "internal error")
        raise ConfigError(f"--out {path}: cannot write the plot: {exc}") from exc
    return path
