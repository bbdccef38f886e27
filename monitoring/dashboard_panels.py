"""The vocabulary of monitoring/dashboards.py: PromQL helpers, panels, variables, and the
dashboard layout (panels placed left to right on Grafana's 24-column grid), built with
grafana-foundation-sdk. A sibling script module, not part of the package."""

from __future__ import annotations

import json
from collections.abc import Sequence

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

DATASOURCE_UID = "rrl-prometheus"
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
TAG = "resilient-rl"
WIDTH = 24  # Grafana's grid is 24 columns wide

#: Fields Grafana's Prometheus datasource reads from an annotation query that the SDK's
#: AnnotationQuery type does not model; added to the JSON after the SDK has encoded it.
PROMETHEUS_ANNOTATION_EXTRAS = ("step", "titleFormat", "textFormat")

RUN = 'run=~"$run"'
#: The window of the rates and quantiles of per-step series (steps, tokens, phases, checkpoint
#: bytes): a dashboard variable, 10 minutes by default. It must span several steps: Grafana's
#: ``$__rate_interval`` (four scrapes, 8 s at the 2 s scrape interval) holds no step of a model
#: whose steps take longer, and a rate over it reads 0 between steps and several times the true
#: value across one.
WINDOW = "$window"
WINDOW_DEFAULT = "10m"
RUN_NODE = 'run=~"$run", node=~"$node"'
# GPU series name the worker process computing on the GPU; a colocated process joins its
# roles with "+" (role="actor+critic+ref+rollout"), an unused GPU has role="" and rank="".
GPU_LEGEND = "{{node}} gpu{{gpu}} {{role}} r{{rank}}"
TORCH_LEGEND = "{{role}} r{{rank}} {{node}}"
PROCESS_LEGEND = "{{role}}/{{rank}} on {{node}}"


# -- PromQL helpers ------------------------------------------------------------------------

def sel(metric: str, matchers: str = RUN) -> str:
    """``metric`` restricted to the dashboard's selected runs (and nodes); every series of it
    without ``matchers`` (an alert rule's selector)."""
    return f"{metric}{{{matchers}}}" if matchers else metric


def increments(metric: str, window: str, by: str = "", matchers: str = RUN) -> str:
    """How much a counter grew over ``window``, across controller restarts and series born inside it.

    Per series, the larger of two counts: ``increase()``, which adds what a counter counted after
    a reset (a new controller on the same address starts again from 0) and what a series counted
    before it ended (the old controller's, when the new one listens on another port); and the
    value now less the value ``window`` ago (0 for a series that did not exist then), which counts
    the first event of a series first exported at 1 (a labelled child created by its first event),
    where increase() starts from its first sample. A series with a single sample in the window
    (born at the last scrape, or a window of one scrape) has no increase(): its difference counts.
    """
    x = sel(metric, matchers)
    grown = f"({x} - ({x} offset {window} or {x} * 0))"
    inc = f"increase({x}[{window}])"
    per_series = f"({inc} + (clamp_min({grown} - {inc}, 0) or {inc} * 0)) or clamp_min({grown}, 0)"
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}({per_series})"


def run_growth(metric: str, window: str, by: str = "", matchers: str = RUN) -> str:
    """How much a counter of the run's whole life grew over ``window``.

    Such a counter (``rrl_lost_seconds_total``) is seeded by each new controller with what the
    run's earlier ones counted, so a new controller's series starts at the run's total, not at 0:
    :func:`increments` would count the whole history again. Per run, the highest value any of
    its controllers reached in the window, less the highest ``window`` ago (0 for a run that
    started inside the window)."""
    x = sel(metric, matchers)
    keys = f"run, {by}" if by else "run"
    now = f"max by ({keys}) (max_over_time({x}[{window}]))"
    then = f"max by ({keys}) ({x} offset {window})"
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(clamp_min({now} - ({then} or {now} * 0), 0))"


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


def window_variable() -> db.IntervalVariable:
    """The *Rate window* selector of the per-step rates (:data:`WINDOW`)."""
    choices = ["1m", "5m", WINDOW_DEFAULT, "30m", "1h", "3h"]
    return (db.IntervalVariable("window").label("Rate window").values(",".join(choices))
            .description("Window of the per-step rates and quantiles: longer than several steps, or they "
                         "read 0 between steps").hide(dm.VariableHide.DONT_HIDE)
            .current(dm.VariableOption(selected=True, text=WINDOW_DEFAULT, value=WINDOW_DEFAULT)))


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
          variables: list[db.QueryVariable | db.IntervalVariable], annotations: Sequence[dict] = ()) -> dict:
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
