"""The Grafana dashboards of resilient-rl, built with grafana-foundation-sdk.

``grafana/dashboards/*.json`` is this module's output: edit the panels here, never the JSON.

    python monitoring/dashboards.py --write    # regenerate grafana/dashboards/*.json
    python monitoring/dashboards.py --check    # exit 1 if a committed file differs

The SDK's typed builders (``grafana_foundation_sdk``, in the ``dev`` extra) are generated
from Grafana's dashboard schema: a misspelt option is an AttributeError here, not a key that
Grafana silently ignores, and the tests decode the committed JSON back through the same types. Every panel queries the provisioned Prometheus datasource
(``grafana/provisioning/datasources/prometheus.yml``, uid ``rrl-prometheus``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

DASHBOARDS_DIR = Path(__file__).resolve().parent / "grafana" / "dashboards"
DATASOURCE_UID = "rrl-prometheus"
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
TAG = "resilient-rl"
WIDTH = 24  # Grafana's grid is 24 columns wide

#: Fields Grafana's Prometheus datasource reads from an annotation query that the SDK's
#: AnnotationQuery type does not model; added to the JSON after the SDK has encoded it.
PROMETHEUS_ANNOTATION_EXTRAS = ("step", "titleFormat", "textFormat")

RUN = 'run=~"$run"'
RUN_NODE = 'run=~"$run", node=~"$node"'
# GPU series name the worker process computing on the GPU; a colocated process joins its
# roles with "+" (role="actor+critic+ref+rollout"), an unused GPU has role="" and rank="".
GPU_LEGEND = "{{node}} gpu{{gpu}} {{role}} r{{rank}}"
TORCH_LEGEND = "{{role}} r{{rank}} {{node}}"
PROCESS_LEGEND = "{{role}}/{{rank}} on {{node}}"


# -- PromQL helpers ------------------------------------------------------------------------

def sel(metric: str, matchers: str = RUN) -> str:
    """``metric`` restricted to the dashboard's selected runs (and nodes)."""
    return f"{metric}{{{matchers}}}"


def increments(metric: str, window: str, by: str = "", matchers: str = RUN) -> str:
    """How much a counter grew over ``window``, counting series born inside the window.

    A labelled counter (restarts per worker and cause, failures per cause) is first exported
    at 1, when its first event happens, so increase() sees a single sample and counts 0.
    Subtracting the value ``window`` ago, or 0 for a series that did not exist then, counts
    every event exactly (RRLRestartStorm uses the same form); clamp_min keeps a counter reset
    (a new controller process) from going negative.
    """
    x = sel(metric, matchers)
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(clamp_min({x} - ({x} offset {window} or {x} * 0), 0))"


def mean(histogram: str, window: str, by: str = "") -> str:
    """Mean of a histogram's observations over ``window``."""
    grouping = f" by ({by}) " if by else ""
    return (f"sum{grouping}(increase({sel(histogram + '_sum')}[{window}]))"
            f" / sum{grouping}(increase({sel(histogram + '_count')}[{window}]))")


def quantile(q: float, histogram: str, window: str, by: str = "") -> str:
    """The ``q`` quantile of a histogram over ``window``."""
    labels = f"{by}, le" if by else "le"
    return (f"histogram_quantile({q}, sum by ({labels}) "
            f"(rate({sel(histogram + '_bucket')}[{window}])))")


# -- panels --------------------------------------------------------------------------------

class Placed:
    """A panel builder with its size; the dashboard places it on the grid."""

    def __init__(self, builder: Builder, w: int, h: int) -> None:
        if not 0 < w <= WIDTH or h <= 0:
            raise ValueError(f"panel size {w}x{h} does not fit a {WIDTH}-column grid")
        self.builder, self.w, self.h = builder, w, h


def _targets(exprs: str | list[tuple[str, str]]) -> list[Builder]:
    """Prometheus range queries, refIds A, B, ...; ``exprs`` is one expr or (expr, legend)s."""
    pairs = [(exprs, "")] if isinstance(exprs, str) else exprs
    out = []
    for i, (expr, legend) in enumerate(pairs):
        q = prometheus.Dataquery().expr(expr).ref_id(chr(ord("A") + i)).range().datasource(DATASOURCE)
        out.append(q.legend_format(legend) if legend else q)
    return out


def _thresholds(steps: list[tuple[str, float | None]]) -> db.ThresholdsConfig:
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=value, color=color) for color, value in steps])


def stat_panel(title: str, expr: str, unit: str = "short", *, decimals: int | None = None,
               thresholds: list[tuple[str, float | None]] | None = None, description: str = "",
               w: int = 4, h: int = 4) -> Placed:
    """A single number (the last value of ``expr``) with a sparkline."""
    p = (stat.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
         .targets(_targets(expr))
         .color_scheme(db.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
         .thresholds(_thresholds(thresholds or [("green", None)]))
         .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
         .color_mode(cm.BigValueColorMode.VALUE).graph_mode(cm.BigValueGraphMode.AREA)
         .justify_mode(cm.BigValueJustifyMode.AUTO).orientation(cm.VizOrientation.AUTO)
         .text_mode(cm.BigValueTextMode.AUTO))
    if decimals is not None:
        p.decimals(decimals)
    return Placed(p, w, h)


def ts_panel(title: str, targets: list[tuple[str, str]], unit: str = "short", *,
             min_val: float | None = None, max_val: float | None = None, stacked: bool = False,
             description: str = "", w: int = 12, h: int = 8) -> Placed:
    """A time series of one or more queries; ``stacked`` stacks them (parts of a whole)."""
    p = (timeseries.Panel().title(title).description(description).datasource(DATASOURCE)
         .unit(unit).targets(_targets(targets))
         .draw_style(cm.GraphDrawStyle.LINE).line_width(1).fill_opacity(40 if stacked else 10)
         .show_points(cm.VisibilityMode.NEVER).span_nulls(False)
         .stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL if stacked else cm.StackingMode.NONE)
                   .group("A"))
         .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST)
                 .placement(cm.LegendPlacement.BOTTOM).show_legend(True))
         .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI)
                  .sort(cm.SortOrder.DESCENDING)))
    if min_val is not None:
        p.min(min_val)
    if max_val is not None:
        p.max(max_val)
    return Placed(p, w, h)


def row(title: str) -> Placed:
    """A row header across the grid: the panels after it, up to the next row, belong to it."""
    return Placed(db.Row(title), WIDTH, 1)


# -- dashboards ----------------------------------------------------------------------------

def query_variable(name: str, label: str, query: str) -> db.QueryVariable:
    """A multi-select variable over a label's values, 'All' by default (regex ``.*``)."""
    return (db.QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .include_all(True).all_value(".*").multi(True).hide(dm.VariableHide.DONT_HIDE)
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"])))


def run_variable() -> db.QueryVariable:
    """The *Run* selector every dashboard filters on (targets carry a ``run`` label)."""
    return query_variable("run", "Run", "label_values(rrl_run_info, run)")


GOODPUT_THRESHOLDS = [("red", None), ("orange", 0.5), ("green", 0.8)]
AGE_THRESHOLDS = [("green", None), ("orange", 900), ("red", 1800)]
RECOVERY_ANNOTATION = {
    "name": "Recoveries",
    "expr": f"changes({sel('rrl_recoveries_total')}[1m]) > 0",
    "step": "30s", "titleFormat": "Recovery", "textFormat": "recovery completed on {{instance}}",
}


def build(uid: str, title: str, description: str, panels: list[Placed],
          variables: list[db.QueryVariable], annotations: Sequence[dict] = ()) -> dict:
    """The dashboard as Grafana JSON: panels laid out left to right, wrapping at 24 columns."""
    board = (db.Dashboard(title).uid(uid).description(description).tags([TAG])
             .timezone("browser").editable().tooltip(dm.DashboardCursorSync.CROSSHAIR)
             .refresh("5s").time("now-1h", "now").fiscal_year_start_month(0).live_now(False)
             .version(1)
             .link(db.DashboardLink(TAG).type(dm.DashboardLinkType.DASHBOARDS).tags([TAG])
                   .as_dropdown(True).include_vars(True).keep_time(True)
                   .icon("external link").target_blank(False)))
    x = y = row_h = 0
    for panel_id, placed in enumerate(panels, start=1):
        if x + placed.w > WIDTH:
            x, y, row_h = 0, y + row_h, 0
        placed.builder.id(panel_id).grid_pos(dm.GridPos(h=placed.h, w=placed.w, x=x, y=y))
        if isinstance(placed.builder, db.Row):
            board.with_row(placed.builder)
        else:
            board.with_panel(placed.builder)
        x, row_h = x + placed.w, max(row_h, placed.h)
    for variable in variables:
        board.with_variable(variable)
    for ann in annotations:
        board.annotation(db.AnnotationQuery().name(ann["name"]).datasource(DATASOURCE)
                         .enable(True).hide(False).icon_color("orange").expr(ann["expr"]))
    out = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    out["annotations"].setdefault("list", [])  # Grafana's built-in annotation is added to it
    for encoded, ann in zip(out["annotations"]["list"], annotations):
        encoded.update({k: ann[k] for k in PROMETHEUS_ANNOTATION_EXTRAS})
    return out


# -- the four dashboards -------------------------------------------------------------------

def training() -> dict:
    """Step, rewards (training and validation), losses, KL, learning rate and throughput."""
    steps_per_min = f"sum(rate({sel('rrl_step_duration_seconds_count')}[$__rate_interval])) * 60"
    tokens = f"rate({sel('rrl_tokens_total')}[$__rate_interval])"
    return build("rrl-training", "resilient-rl / Training progress",
                 "Step, rewards, losses, KL, learning rate and throughput of a run.", [
        stat_panel("Step", f"max({sel('rrl_step')})", decimals=0),
        stat_panel("Steps / min", steps_per_min, decimals=2),
        stat_panel("Tokens / s", f"sum({tokens})"),
        stat_panel("Goodput", f"min({sel('rrl_goodput_ratio')})", "percentunit",
                   thresholds=GOODPUT_THRESHOLDS),
        stat_panel("Last checkpoint step", f"max({sel('rrl_checkpoint_last_committed_step')})",
                   decimals=0),
        stat_panel("Checkpoint age", f"max({sel('rrl_checkpoint_age_seconds')})", "s",
                   thresholds=AGE_THRESHOLDS),
        ts_panel("Step", [(f"max by (instance) ({sel('rrl_step')})", "step {{instance}}"),
                          (f"max by (instance) ({sel('rrl_checkpoint_last_committed_step')})",
                           "last committed {{instance}}")],
                 description="Last completed step; it drops back after a restore and climbs again."),
        ts_panel("Reward (mean)", [(sel("rrl_reward_mean"), "{{instance}}")]),
        ts_panel("Validation (held-out prompts)", [(sel("rrl_val_reward_mean"), "reward {{instance}}"),
                                                   (sel("rrl_val_accuracy_ratio"), "accuracy {{instance}}")],
                 description="The last validation pass (trainer.test_freq): mean reward and the share of "
                             "responses scoring 1 on the held-out prompts."),
        ts_panel("Losses", [(sel("rrl_actor_loss"), "actor {{instance}}"),
                            (sel("rrl_critic_loss"), "critic {{instance}}")]),
        ts_panel("KL (actor vs reference)", [(sel("rrl_kl"), "{{instance}}")]),
        ts_panel("Learning rate", [(sel("rrl_learning_rate"), "{{role}} {{instance}}")], "sci"),
        ts_panel("Tokens / s", [(f"sum by (instance) ({tokens})", "{{instance}}")]),
        ts_panel("Goodput", [(sel("rrl_goodput_ratio"), "{{instance}}")], "percentunit",
                 min_val=0, max_val=1,
                 description="Share of wall time spent on steps that were kept."),
        ts_panel("Steps / min", [(f"sum by (instance) (rate({sel('rrl_step_duration_seconds_count')}"
                                  "[$__rate_interval])) * 60", "{{instance}}")]),
    ], [run_variable()], [RECOVERY_ANNOTATION])


def throughput() -> dict:
    """Step time, its phases and tokens per second."""
    phase_rate = f"sum by (phase) (rate({sel('rrl_phase_duration_seconds_sum')}[$__rate_interval]))"
    step_rate = "sum(rate({}[$__rate_interval]))"
    return build("rrl-throughput", "resilient-rl / Throughput and phases",
                 "Step time, its phases and tokens per second.", [
        ts_panel("Step duration", [
            (quantile(0.5, "rrl_step_duration_seconds", "$__rate_interval"), "p50"),
            (quantile(0.9, "rrl_step_duration_seconds", "$__rate_interval"), "p90"),
            (quantile(0.99, "rrl_step_duration_seconds", "$__rate_interval"), "p99"),
            (f"{step_rate.format(sel('rrl_step_duration_seconds_sum'))}"
             f" / {step_rate.format(sel('rrl_step_duration_seconds_count'))}", "mean")], "s"),
        ts_panel("Tokens / s", [(f"sum(rate({sel('rrl_tokens_total')}[$__rate_interval]))",
                                 "tokens/s")]),
        ts_panel("Mean time per step by phase", [(
            f"{phase_rate} / on () group_left () "
            f"{step_rate.format(sel('rrl_step_duration_seconds_count'))}", "{{phase}}")], "s",
            stacked=True,
            description="Seconds each phase adds to an average step (stacked: the step's make-up)."),
        ts_panel("Phase share of step time", [(
            f"{phase_rate} / on () group_left () "
            f"{step_rate.format(sel('rrl_step_duration_seconds_sum'))}", "{{phase}}")],
            "percentunit", min_val=0, stacked=True),
        ts_panel("Phase duration p95", [
            (quantile(0.95, "rrl_phase_duration_seconds", "$__rate_interval", by="phase"),
             "{{phase}}")], "s"),
        ts_panel("Steps / min", [(
            f"{step_rate.format(sel('rrl_step_duration_seconds_count'))} * 60", "steps/min")]),
    ], [run_variable()], [RECOVERY_ANNOTATION])


def reliability() -> dict:
    """Workers, restarts, failures, recoveries, lost work and checkpoints."""
    count = dict(decimals=0)
    red_from_one = [("green", None), ("red", 1)]
    ckpt_save, ckpt_stall = "rrl_checkpoint_save_duration_seconds", "rrl_checkpoint_stall_seconds"
    ckpt_load, recovery = "rrl_checkpoint_load_duration_seconds", "rrl_recovery_duration_seconds"
    phases = "rrl_recovery_phase_seconds"
    # Failure to failed step done again, per recovery: every phase's time over the recoveries.
    restarts_counted = sel(phases + "_count", RUN + ', phase="restart"')
    mttr = f"sum(increase({sel(phases + '_sum')}[$__range])) / sum(increase({restarts_counted}[$__range]))"
    return build("rrl-reliability", "resilient-rl / Reliability",
                 "Workers, restarts, failures, recoveries, lost work and checkpoints.", [
        stat_panel("Workers up", f"sum({sel('rrl_worker_up')})", **count),
        stat_panel("Workers down", f"count({sel('rrl_worker_up')} == 0) or vector(0)",
                   thresholds=red_from_one, **count),
        stat_panel("Restarts (range)", increments("rrl_worker_restarts_total", "$__range"), **count),
        stat_panel("Recoveries (range)", increments("rrl_recoveries_total", "$__range"), **count),
        stat_panel("Steps replayed (range)", increments("rrl_steps_replayed_total", "$__range"),
                   **count),
        stat_panel("Corrupt checkpoints", f"sum({sel('rrl_checkpoint_corrupt_total')})",
                   thresholds=red_from_one, **count),
        stat_panel("Last checkpoint committed",
                   f"max({sel('rrl_checkpoint_last_committed_timestamp_seconds')}) * 1000",
                   "dateTimeFromNow", w=6),
        stat_panel("Last committed step", f"max({sel('rrl_checkpoint_last_committed_step')})",
                   w=6, **count),
        stat_panel("Checkpoint age", f"max({sel('rrl_checkpoint_age_seconds')})", "s",
                   thresholds=AGE_THRESHOLDS, w=6),
        stat_panel("Goodput", f"min({sel('rrl_goodput_ratio')})", "percentunit",
                   thresholds=GOODPUT_THRESHOLDS, w=6),
        ts_panel("Workers up by role", [(f"sum by (role) ({sel('rrl_worker_up')})", "{{role}}")],
                 min_val=0,
                 description="Live workers per role; a dip is a failure, the climb back a recovery."),
        # 1 for each worker while it is down, nothing while it is up.
        ts_panel("Workers down", [(f"(1 - {sel('rrl_worker_up')}) > 0", PROCESS_LEGEND)],
                 min_val=0, description="One line at 1 per worker while it is down."),
        ts_panel("Restarts by cause", [(increments("rrl_worker_restarts_total", "$__interval",
                                                   by="cause"), "{{cause}}")], stacked=True),
        ts_panel("Restarts by worker", [(increments("rrl_worker_restarts_total", "$__interval",
                                                    by="role, rank"), "{{role}}/{{rank}}")],
                 stacked=True),
        ts_panel("Failures by cause", [(increments("rrl_failures_total", "$__interval",
                                                   by="cause"), "{{cause}}")], stacked=True),
        ts_panel("Recovery duration", [(quantile(0.5, recovery, "10m"), "p50 (10m)"),
                                       (quantile(0.95, recovery, "10m"), "p95 (10m)"),
                                       (mean(recovery, "10m"), "mean (10m)")], "s",
                 description="Failure detected to training resumed, over 10-minute windows."),
        ts_panel("Lost work", [(increments("rrl_steps_replayed_total", "$__interval"),
                                "steps replayed"),
                               (increments("rrl_recoveries_total", "$__interval"), "recoveries")]),
        ts_panel("Goodput", [(sel("rrl_goodput_ratio"), "{{instance}}")], "percentunit",
                 min_val=0, max_val=1),
        ts_panel("Checkpoint save and stall", [(quantile(0.95, ckpt_save, "10m"), "save p95"),
                                               (mean(ckpt_save, "10m"), "save mean"),
                                               (mean(ckpt_stall, "10m"), "stall mean"),
                                               (quantile(0.95, ckpt_stall, "10m"), "stall p95")],
                 "s", description="Save: start to commit (async). Stall: time training was blocked."),
        ts_panel("Checkpoint load duration", [(mean(ckpt_load, "10m"), "mean (10m)"),
                                              (quantile(0.95, ckpt_load, "10m"), "p95 (10m)")], "s"),
        ts_panel("Checkpoint write rate", [(f"sum(rate({sel('rrl_checkpoint_bytes_total')}"
                                            "[$__rate_interval]))", "bytes/s")], "Bps"),
        ts_panel("Checkpoint age", [(sel("rrl_checkpoint_age_seconds"), "age {{instance}}")], "s",
                 description="Seconds since the last commit: the work a crash would lose now."),
        ts_panel("Steps since last checkpoint", [(
            f"{sel('rrl_step')} - {sel('rrl_checkpoint_last_committed_step')}", "{{instance}}")]),
        ts_panel("Corrupt checkpoints and snapshots",
                 [(increments("rrl_checkpoint_corrupt_total", "$__interval"), "checkpoint"),
                  (increments("rrl_snapshot_corrupt_total", "$__interval", by="source"),
                   "snapshot copy ({{source}})")],
                 description="Copies that failed verification and were not restored: a checkpoint "
                             "(the previous one was used) or an in-memory snapshot copy (the next "
                             "source was tried: peer copy, older snapshot, checkpoint)."),
        ts_panel("Skipped checkpoints", [(increments("rrl_checkpoint_skipped_total", "$__interval",
                                                     by="reason"), "{{reason}}")], stacked=True,
                 description="Saves skipped while training went on: storage (an outage past the "
                             "retries) or slow (the previous save still writing after "
                             "checkpoint.save_timeout_s). More than checkpoint.max_skipped in a row "
                             "stop the run."),
        row("Recovery by phase and effective training time"),
        stat_panel("ETTR (whole run)", f"min({sel('rrl_ettr_ratio')})", "percentunit",
                   thresholds=GOODPUT_THRESHOLDS, w=8,
                   description="Seconds of steps that count over wall seconds since the run began, "
                               "across controller restarts (ettr.json in the run folder)."),
        stat_panel("Lost time (range)", increments("rrl_lost_seconds_total", "$__range"), "s", w=8,
                   description="Failed work, recovery, rolled-back steps and a crashed controller's "
                               "pause, over the time range."),
        stat_panel("Mean time to recover (range)", mttr, "s", w=8,
                   description="Failure to the failed step done again (detect + restart + rejoin + "
                               "restore + replay), mean over the recoveries in the time range."),
        ts_panel("Recovery phases (mean, 10m)", [(mean(phases, "10m", by="phase"), "{{phase}}")], "s",
                 stacked=True, w=8,
                 description="detect: failure reported (or hang start) to recovery; restart: workers back; "
                             "rejoin: new process groups; restore: snapshot or checkpoint loaded; "
                             "replay: until the failed step is done again."),
        ts_panel("Lost time by cause", [(increments("rrl_lost_seconds_total", "$__interval", by="cause"),
                                         "{{cause}}")], "s", stacked=True, w=8),
        ts_panel("ETTR and goodput", [(sel("rrl_ettr_ratio"), "ETTR {{instance}}"),
                                      (sel("rrl_goodput_ratio"), "goodput {{instance}}")], "percentunit",
                 min_val=0, max_val=1, w=8,
                 description="ETTR spans the run's whole life; goodput this controller's. Both fall "
                             "while a step hangs."),
    ], [run_variable()], [RECOVERY_ANNOTATION])


def gpus() -> dict:
    """Per-GPU readings (NVML) by node and rank, torch memory per rank; CPU and memory of
    worker processes."""
    def gpu(metric: str) -> str:
        return sel(metric, RUN_NODE)
    cpu = f"rate({gpu('rrl_process_cpu_seconds_total')}[$__rate_interval])"
    node_variable = query_variable("node", "Node", "label_values(rrl_worker_up{run=~\"$run\"}, node)")
    return build("rrl-gpus", "resilient-rl / GPUs and processes",
                 "Per-GPU readings by node and rank (NVML); CPU and memory of worker processes.", [
        stat_panel("Mean GPU utilization", f"avg({gpu('rrl_gpu_utilization_ratio')})",
                   "percentunit"),
        stat_panel("GPU memory used", f"sum({gpu('rrl_gpu_memory_used_bytes')})", "bytes"),
        stat_panel("GPU power", f"sum({gpu('rrl_gpu_power_watts')})", "watt"),
        stat_panel("Hottest GPU", f"max({gpu('rrl_gpu_temperature_celsius')})", "celsius",
                   thresholds=[("green", None), ("orange", 80), ("red", 88)]),
        stat_panel("Worker RSS", f"sum({gpu('rrl_process_resident_memory_bytes')})", "bytes"),
        stat_panel("Worker CPU", f"sum({cpu})",
                   description="CPU cores busy across worker processes."),
        ts_panel("GPU utilization", [(gpu("rrl_gpu_utilization_ratio"), GPU_LEGEND)],
                 "percentunit", min_val=0, max_val=1),
        ts_panel("GPU memory used", [(gpu("rrl_gpu_memory_used_bytes"), GPU_LEGEND)], "bytes",
                 min_val=0),
        ts_panel("Torch memory per rank", [
            (gpu("rrl_torch_memory_allocated_bytes"), f"allocated {TORCH_LEGEND}"),
            (gpu("rrl_torch_memory_reserved_bytes"), f"reserved {TORCH_LEGEND}")], "bytes",
            min_val=0, w=WIDTH,
            description="torch's view of each worker process's GPU memory: live tensors (allocated) "
                        "and what the caching allocator holds (reserved), as of the last health "
                        "reply. Absent on CPU."),
        ts_panel("GPU memory used / total", [(
            f"{gpu('rrl_gpu_memory_used_bytes')} / {gpu('rrl_gpu_memory_total_bytes')}",
            GPU_LEGEND)], "percentunit", min_val=0, max_val=1),
        ts_panel("GPU power", [(gpu("rrl_gpu_power_watts"), GPU_LEGEND)], "watt", min_val=0),
        ts_panel("GPU temperature", [(gpu("rrl_gpu_temperature_celsius"), GPU_LEGEND)], "celsius"),
        ts_panel("GPU SM clock", [(gpu("rrl_gpu_sm_clock_hertz"), GPU_LEGEND)], "hertz"),
        ts_panel("Worker CPU (cores)", [(cpu, PROCESS_LEGEND)]),
        ts_panel("Worker resident memory", [(gpu("rrl_process_resident_memory_bytes"),
                                             PROCESS_LEGEND)], "bytes"),
    ], [run_variable(), node_variable])


def dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON, for every dashboard this project ships."""
    boards = [training(), throughput(), reliability(), gpus()]
    return {f"{board['uid']}.json": board for board in boards}


def render(board: dict) -> str:
    """The committed text of a dashboard: stable key order, two-space indent, final newline."""
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write grafana/dashboards/*.json")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 if a committed dashboard differs from the generated one")
    args = parser.parse_args(argv)
    boards = {name: render(board) for name, board in dashboards().items()}
    committed = {p.name for p in DASHBOARDS_DIR.glob("*.json")}
    if args.write:
        for name, text in boards.items():
            (DASHBOARDS_DIR / name).write_text(text)
        for name in committed - set(boards):
            (DASHBOARDS_DIR / name).unlink()
        print(f"wrote {len(boards)} dashboards to {DASHBOARDS_DIR}")
        return 0
    def differs(name: str, text: str) -> bool:
        path = DASHBOARDS_DIR / name
        return not path.exists() or path.read_text() != text
    stale = sorted(name for name, text in boards.items() if differs(name, text))
    stale += sorted(committed - set(boards))
    if stale:
        print(f"out of date: {', '.join(stale)}; run python {Path(__file__).name} --write",
              file=sys.stderr)
        return 1
    print(f"{len(boards)} dashboards up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
