"""Building blocks of the splitstack dashboards (grafana-foundation-sdk, Grafana 11.6): the
datasource and template variables, the label selector every query carries, PromQL helpers
and the two panel kinds used (time series and stat), each with a title, a unit and a
description."""
from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Every series a dashboard reads carries this selector: `namespace` is the Kubernetes
# namespace (absent on a local scrape, which `.*` matches), `deployment` picks the scrape
# job, one per splitstack deployment (the gateway's /metrics covers all of it), `pod` one of
# its gateway pods and `member` one attention service, pool or prefill replica. A series
# without the pod or member label (a recording rule's, a gateway's own) matches any choice:
# picking a member filters the per-member panels and leaves the deployment's as they are.
SEL = ('namespace=~"$namespace", job=~"$deployment", pod=~"$pod|", '
       'member=~"$member|"')
WINDOW = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)


def sel(extra: str = "") -> str:
    """`{selector}` with `extra` matchers appended (e.g. `reason="error"`)."""
    return "{" + SEL + (", " + extra if extra else "") + "}"


def by(labels: tuple[str, ...]) -> str:
    return f" by ({', '.join(labels)})" if labels else ""


def rate(name: str, labels: tuple[str, ...] = (), extra: str = "", window: str = WINDOW) -> str:
    """Per-second rate of a counter, summed over everything but `labels`."""
    return f"sum{by(labels)} (rate({name}{sel(extra)}[{window}]))"


def increase(name: str, labels: tuple[str, ...] = (), extra: str = "") -> str:
    return f"sum{by(labels)} (increase({name}{sel(extra)}[{WINDOW}]))"


def quantile(q: float, histogram: str, labels: tuple[str, ...] = (),
             window: str = WINDOW) -> str:
    """The q-quantile of a histogram (`histogram` without `_bucket`) over the window."""
    return (f"histogram_quantile({q}, sum by ({', '.join(('le', *labels))}) "
            f"(rate({histogram}_bucket{sel()}[{window}])))")


def mean(histogram: str, labels: tuple[str, ...] = ()) -> str:
    """Mean observation of a histogram over the window (sum / count)."""
    return f"{rate(histogram + '_sum', labels)} / {rate(histogram + '_count', labels)}"


def zero_if_none(expr: str, present: str, label: str) -> str:
    """`expr`, or 0 for each series of `present` (with `label`="none") while `expr` has no
    series: a counter with labels has none until its first event (no refusal yet), and a
    panel should say 0 rather than "No data" while the deployment (`present`) is up."""
    return f'({expr}) or label_replace(0 * {present}, "{label}", "none", "", "")'


def heatmap_targets(histogram: str) -> list[tuple[str, str]]:
    """Requests per second in each bucket of a histogram, for a heatmap panel."""
    return [(f"sum by (le) (rate({histogram}_bucket{sel()}[{WINDOW}]))", "{{le}}")]


def quantile_targets(histogram: str, labels: tuple[str, ...] = (),
                     legend: str = "") -> list[tuple[str, str]]:
    return [(quantile(q, histogram, labels), f"{legend}p{round(q * 100)}")
            for q in QUANTILES]


@dataclass(frozen=True)
class Panel:
    """One panel: `targets` are (PromQL, legend) pairs. `kind`: timeseries, stat, or
    heatmap (a histogram's buckets per `le`, `heatmap_targets`)."""
    title: str
    unit: str
    description: str
    targets: list[tuple[str, str]]
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    stack: bool = False
    max: float | None = None
    red_from: float | None = None      # a stat turns red from here (an alert's threshold)

    def builder(self):
        p = {"stat": stat.Panel, "heatmap": heatmap.Panel}.get(self.kind, timeseries.Panel)()
        p = (p.title(self.title).description(self.description).unit(self.unit)
             .datasource(DATASOURCE).span(self.width).height(self.height).min(0))
        if self.max is not None:
            p = p.max(self.max)
        if self.red_from is not None:
            p = p.thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
                [dm.Threshold(None, "green"), dm.Threshold(self.red_from, "red")]))
        for i, (expr, legend) in enumerate(self.targets):
            query = (prometheus.Dataquery().expr(expr).legend_format(legend)
                     .ref_id(chr(ord("A") + i)).range())
            if self.kind == "heatmap":
                query = query.format(pm.PromQueryFormat.HEATMAP)
            p = p.with_target(query)
        if self.kind == "heatmap":       # Prometheus's buckets as they are, by upper bound
            return (p.calculate(False).cell_gap(1)
                    .rows_frame(heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.LE))
                    .y_axis(heatmap.YAxisConfig().unit(self.unit)))
        if self.kind == "stat":
            return (p.graph_mode(cm.BigValueGraphMode.AREA)
                    .color_mode(cm.BigValueColorMode.VALUE)
                    .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"])
                                    .values(False)))
        p = (p.line_width(1).fill_opacity(10).show_points(cm.VisibilityMode.NEVER)
             .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST)
                     .placement(cm.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI)
                      .sort(cm.SortOrder.DESCENDING)))
        if self.stack:
            p = p.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
        return p


def variables() -> list:
    """Datasource, namespace, deployment (the scrape job), gateway pod and member, each
    defaulting to all."""
    def query_var(name: str, label: str, query: str, description: str):
        return (db.QueryVariable(name).label(label).description(description)
                .datasource(DATASOURCE).query(query)
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(dm.VariableSort.ALPHABETICAL_ASC)
                .include_all(True).all_value(".*").multi(False)
                .current(dm.VariableOption(selected=True, text="All", value="$__all")))

    return [
        db.DatasourceVariable("datasource").label("Data source").type("prometheus")
        .description("The Prometheus that scrapes the splitstack gateway"),
        query_var("namespace", "Namespace",
                  "label_values(splitstack_requests_running, namespace)",
                  "Kubernetes namespace of the deployment (none on a local scrape)"),
        query_var("deployment", "Deployment",
                  'label_values(splitstack_requests_running{namespace=~"$namespace"}, job)',
                  "The splitstack deployment: the Prometheus job scraping its gateway"),
        query_var("pod", "Gateway pod",
                  'label_values(splitstack_requests_running{namespace=~"$namespace", '
                  'job=~"$deployment"}, pod)',
                  "One gateway pod of the deployment (none on a local scrape)"),
        query_var("member", "Member",
                  'label_values({__name__=~"splitstack_(attention|prefill|pool)_up", '
                  'namespace=~"$namespace", job=~"$deployment"}, member)',
                  "One attention service, prefill or MLP pool replica (its address) for "
                  "the per-member panels; the deployment's own panels ignore it"),
    ]


@dataclass(frozen=True)
class Annotation:
    """Events drawn on every time panel: a mark wherever `expr` has a sample, titled
    `title` (a legend format), tagged with the values of `tags`."""
    name: str
    expr: str
    color: str
    title: str
    tags: tuple[str, ...] = ()

    def builder(self):
        return (db.AnnotationQuery().name(self.name).datasource(DATASOURCE).enable(True)
                .icon_color(self.color).expr(self.expr))

    def fields(self) -> dict:
        """What Grafana's Prometheus annotations read beyond the SDK's fields."""
        return {"titleFormat": self.title, "tagKeys": ",".join(self.tags), "step": "1m",
                "useValueForTime": False}


def dashboard(uid: str, title: str, description: str, tags: list[str],
              rows: list[tuple[str, list[Panel]]],
              annotations: tuple[Annotation, ...] = ()) -> dict:
    """The dashboard as a JSON-ready dict; panel ids numbered in layout order, a menu of
    the other splitstack dashboards that keeps the time range and variables, and
    `annotations` as event marks."""
    d = (db.Dashboard(title).uid(uid).description(description).tags(["splitstack", *tags])
         .editable().refresh("10s").time("now-30m", "now").timezone("browser")
         .tooltip(dm.DashboardCursorSync.CROSSHAIR).variables(variables())
         .link(db.DashboardLink("splitstack").type(dm.DashboardLinkType.DASHBOARDS)
               .tags(["splitstack"]).icon("external link").as_dropdown(True)
               .include_vars(True).keep_time(True)))
    for a in annotations:
        d = d.annotation(a.builder())
    for row_title, panels in rows:
        d = d.with_row(db.Row(row_title))
        for panel in panels:
            d = d.with_panel(panel.builder())
    model = d.build()
    for i, panel in enumerate(model.panels, start=1):
        panel.id_val = i
    out = json.loads(json.dumps(model, cls=JSONEncoder))
    for var in out["templating"]["list"]:
        # the SDK writes an interval variable's settings on every variable; Grafana's
        # dashboard schema has no such fields on a variable (and none of these is one)
        for key in ("auto", "auto_count", "auto_min"):
            var.pop(key, None)
    listed = out.get("annotations", {}).get("list", [])
    for a in annotations:
        next(q for q in listed if q.get("name") == a.name).update(a.fields())
    return out
