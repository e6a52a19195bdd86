"""The deployment's own panels over the run's time range, for a user without Grafana: each
panel's PromQL from the Grafana dashboards (`deploy/grafana/*.json`; a built-in list of
key queries when there are none) goes through Prometheus's `query_range`, and each
dashboard becomes one PNG of its panels.

Grafana's variables are filled in before a query is sent: `$__rate_interval` and
`$__interval` with the rate window, `$__range` with the run's length, and any other
`$name` with the value given for it (`--prom-var name=value`), else `.*`; a matcher on a
variable (`service="$service"`) becomes a regex matcher, so `.*` selects every value."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

DASHBOARDS = Path(__file__).resolve().parents[1] / "deploy" / "grafana"

Q = "histogram_quantile({q}, sum by (le) (rate({m}_bucket[$__rate_interval])))"
BUILTIN = {
    "title": "splitstack key metrics",
    "panels": [
        {"title": "Finished requests", "unit": "reqps", "targets": [
            {"expr": "sum by (status) (rate(splitstack_requests_total[$__rate_interval]))",
             "legendFormat": "{{status}}"}]},
        {"title": "Generated tokens", "unit": "tok/s", "targets": [
            {"expr": "sum(rate(splitstack_generation_tokens_total[$__rate_interval]))",
             "legendFormat": "output"},
            {"expr": "sum(rate(splitstack_prompt_tokens_total[$__rate_interval]))",
             "legendFormat": "prompt"}]},
        *({"title": title, "unit": "s", "targets": [
            {"expr": Q.format(q=q, m=metric), "legendFormat": f"p{int(q * 100)}"}
            for q in (0.5, 0.95, 0.99)]}
          for title, metric in (("Time to first token", "splitstack_time_to_first_token_seconds"),
                                ("Inter-token latency", "splitstack_inter_token_latency_seconds"),
                                ("End-to-end latency", "splitstack_e2e_request_latency_seconds"))),
        {"title": "Requests in the engine", "unit": "short", "targets": [
            {"expr": "sum(splitstack_requests_running)", "legendFormat": "running"},
            {"expr": "sum(splitstack_requests_waiting)", "legendFormat": "waiting"}]},
        {"title": "KV cache usage", "unit": "percentunit", "targets": [
            {"expr": "max(splitstack_kv_cache_usage_ratio)", "legendFormat": "max"}]},
    ]}

UNITS = {"s": "seconds", "ms": "milliseconds", "percentunit": "share (0-1)",
         "percent": "percent", "reqps": "requests/s", "ops": "operations/s",
         "bytes": "bytes", "decbytes": "bytes", "short": "count", "none": ""}


@dataclass
class Panel:
    title: str
    unit: str
    targets: list[dict]                          # {"expr", "legendFormat"}
    series: list[tuple[str, list[float], list[float]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def unit_label(unit: str) -> str:
    if unit.startswith("suffix:"):
        return unit[len("suffix:"):].strip()
    return UNITS.get(unit, unit)


def panels_of(dashboard: dict) -> list[Panel]:
    """The dashboard's panels with PromQL targets, rows' nested panels included."""
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out += panels_of(p)
            continue
        targets = [t for t in p.get("targets", []) if t.get("expr")]
        if targets:
            unit = p.get("unit") or p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            out.append(Panel(p.get("title", ""), unit or "", targets))
    return out


def load_dashboards(directory: Path = DASHBOARDS) -> list[tuple[str, list[Panel]]]:
    """(title, panels) per `*.json` dashboard in `directory`; the built-in list if none."""
    found = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            board = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(board, dict) and "dashboard" in board:       # an API export
            board = board["dashboard"]
        if isinstance(board, dict) and panels_of(board):
            found.append((board.get("title", path.stem), panels_of(board)))
    return found or [(BUILTIN["title"], panels_of(BUILTIN))]


def substitute(expr: str, variables: dict[str, str], rate_interval: str, range_s: int) -> str:
    builtins = {"__rate_interval": rate_interval, "__interval": rate_interval,
                "__range": f"{range_s}s", "__range_s": str(range_s)}

    def value(name: str) -> str:
        return builtins.get(name, variables.get(name, ".*"))

    var = r"(?:\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\])"
    # a label matched to a user variable: equality becomes a regex match
    expr = re.sub(r'(\w+)\s*(=|!=)\s*"' + var + '"',
                  lambda m: (f'{m.group(1)}{"=~" if m.group(2) == "=" else "!~"}'
                             f'"{value(m.group(3) or m.group(4) or m.group(5))}"'),
                  expr)
    return re.sub(var, lambda m: value(m.group(1) or m.group(2) or m.group(3)), expr)


def legend(fmt: str, labels: dict) -> str:
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    shown = {k: v for k, v in labels.items() if k not in ("job", "instance")}
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "value"


def query_panels(prometheus: str, panels: list[Panel], start: float, end: float,
                 variables: dict[str, str], rate_interval: str,
                 origin: float | None = None) -> None:
    """Fills each panel's series (or errors) from `query_range` over [start, end]; times
    in seconds from `origin` (default: `start`)."""
    origin = start if origin is None else origin
    step = max(1.0, (end - start) / 300)
    base = prometheus.rstrip("/")
    with httpx.Client(timeout=30) as client:
        for panel in panels:
            for t in panel.targets:
                expr = substitute(t["expr"], variables, rate_interval, int(end - start))
                try:
                    r = client.get(base + "/api/v1/query_range", params={
                        "query": expr, "start": start, "end": end, "step": step})
                    body = r.json()
                except (httpx.HTTPError, ValueError) as exc:
                    panel.errors.append(f"{expr}: {type(exc).__name__}: {exc}")
                    continue
                if body.get("status") != "success":
                    panel.errors.append(f"{expr}: {body.get('error', r.text[:200])}")
                    continue
                for s in body["data"]["result"]:
                    xs = [float(v[0]) - origin for v in s["values"]]
                    ys = [float(v[1]) for v in s["values"]]
                    panel.series.append((legend(t.get("legendFormat", ""), s["metric"]), xs, ys))


def render(path: Path, title: str, panels: list[Panel], subtitle: str,
           marks: list[tuple[float, str]] = (),
           xlim: tuple[float, float] | None = None) -> None:
    """The panels in two columns over `xlim` (seconds); `marks`: (seconds, label) of each
    sweep point's start, drawn as dotted lines."""
    from loadtest.plots import plt

    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.4 * rows + 0.8), squeeze=False,
                             layout="constrained")
    for ax, panel in zip(axes.flat, panels):
        for name, xs, ys in panel.series[:12]:
            ax.plot(xs, ys, label=name[:60])
        for at, label in marks:
            ax.axvline(at, color="gray", linestyle=":", linewidth=1)
            ax.annotate(label, (at, 1), xycoords=("data", "axes fraction"), xytext=(2, -2),
                        textcoords="offset points", va="top", fontsize=7, color="gray")
        if xlim:
            ax.set_xlim(*xlim)
        ax.set_title(panel.title, fontsize=11)
        ax.set_xlabel("seconds since the run's start")
        ax.set_ylabel(unit_label(panel.unit))
        if panel.series:
            ax.legend(fontsize=8, loc="upper right")
        else:
            ax.text(0.5, 0.5, "query error" if panel.errors else "no data",
                    ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{title}\n{subtitle}", fontsize=13)
    fig.savefig(path)
    plt.close(fig)


def series_summaries(panels: list[Panel], points: list[tuple[float, float, str]],
                     origin: float) -> list[dict]:
    """Per series of every panel: min / mean / max / last over the run, and mean / max
    over each sweep point ((start, end, label), Unix seconds; series times in seconds
    from `origin`), for result.json."""
    first, last = min(p[0] for p in points) - origin, max(p[1] for p in points) - origin
    out = []
    for panel in panels:
        for name, xs, ys in panel.series:
            t, v = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
            run = (t >= first) & (t <= last) & ~np.isnan(v)
            if not run.any():
                continue
            per_point = []
            for start, end, label in points:
                inside = (t >= start - origin) & (t <= end - origin) & ~np.isnan(v)
                per_point.append({"point": label,
                                  "mean": float(v[inside].mean()) if inside.any() else None,
                                  "max": float(v[inside].max()) if inside.any() else None})
            out.append({"panel": panel.title, "series": name, "unit": panel.unit,
                        "min": float(v[run].min()), "mean": float(v[run].mean()),
                        "max": float(v[run].max()), "last": float(v[run][-1]),
                        "per_point": per_point})
    return out


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "dashboard"


def prometheus_panels(out: Path, prometheus: str, points: list[tuple[float, float, str]],
                      variables: dict[str, str], rate_interval: str,
                      directory: Path = DASHBOARDS) -> list[dict]:
    """One PNG per dashboard in `out`, over the sweep's points ((start, end, label), Unix
    seconds) and `pad` seconds either side; per dashboard its file, the panels that
    returned no data or an error, and each series' summary (`series_summaries`)."""
    pad = 10.0
    start, end = min(p[0] for p in points), max(p[1] for p in points)
    marks = [(p[0] - start, p[2]) for p in points]
    written = []
    for title, panels in load_dashboards(directory):
        query_panels(prometheus, panels, start - pad, end + pad, variables, rate_interval,
                     origin=start)
        name = f"prometheus-{slug(title)}.png"
        render(out / name, title, panels,
               f"Prometheus {prometheus}, the run ±{pad:g} s, rate window {rate_interval}; "
               "dotted lines: each sweep point's start", marks, (-pad, end - start + pad))
        written.append({"dashboard": title, "file": name, "panels": len(panels),
                        "empty": [p.title for p in panels if not p.series and not p.errors],
                        "errors": [e for p in panels for e in p.errors],
                        "series": series_summaries(panels, points, start)})
    return written
