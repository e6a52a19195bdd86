"""The run's outputs in one directory: `result.json` (the settings and, per sweep point,
`vllm bench serve`'s fields), `report.md` (the table and the plots) and the PNGs."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from loadtest.plots import point_label, write_plots

LOADS = {"concurrency": "closed loop, one point per concurrency",
         "rate": "open loop, Poisson arrivals, one point per rate"}
COLUMNS = (("completed", "completed", "d"), ("failed", "failed", "d"),
           ("cancelled", "cancelled", "d"), ("req/s", "request_throughput", ".2f"),
           ("output tok/s", "output_throughput", ".1f"),
           ("TTFT median / p99 (ms)", ("median_ttft_ms", "p99_ttft_ms"), ".0f"),
           ("TPOT median / p99 (ms)", ("median_tpot_ms", "p99_tpot_ms"), ".1f"),
           ("ITL median / p99 (ms)", ("median_itl_ms", "p99_itl_ms"), ".1f"),
           ("E2EL median / p99 (ms)", ("median_e2el_ms", "p99_e2el_ms"), ".0f"))


def machine() -> str:
    """The client machine: CPU model and cores (the server's, when on loopback)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"


def cell(p: dict, key, fmt: str) -> str:
    if isinstance(key, tuple):
        return " / ".join(format(p[k], fmt) for k in key)
    return format(p[key], fmt)


def table(result: dict) -> list[str]:
    head = ["point"] + [c[0] for c in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in result["points"]:
        lines.append("| " + " | ".join([point_label(p)] + [cell(p, k, f) for _, k, f in COLUMNS])
                     + " |")
    return lines


def markdown(result: dict, plots: list[str], panels: list[dict]) -> str:
    r = result
    settings = [f"- command: `{r.get('command', 'splitstack loadtest')}`",
                f"- server: {r['base_url']}, model `{r['model_id']}` "
                f"(context {r['max_model_len']})",
                f"- scenario: `{r['scenario']}`, seed {r['seed']}"
                + (f", reuse ratio {r['reuse_ratio']}" if r.get("reuse_ratio") is not None else "")
                + (f", extra body `{json.dumps(r['extra_body'])}`" if r["extra_body"] else ""),
                f"- load: {LOADS[r['mode']]}; each point at most "
                f"{r['points'][0]['num_prompts']} requests and {r['max_seconds']:g} s",
                f"- client machine: {r.get('machine') or machine()}; date {r['date']} UTC"]
    lines = [f"# Load test: {r['scenario']} against {r['model_id']}", "", *settings, "",
             "TTFT: time to first token; TPOT: time per output token after the first; ITL: "
             "time between streamed chunks; E2EL: end-to-end latency. Field names and "
             "definitions follow `vllm bench serve`; the numbers of every point are in "
             "`result.json`.", "", *table(r), ""]
    errors = sorted({e for p in r["points"] for e in p["errors"] if e})
    if errors:
        lines += ["Errors (distinct):", "", *[f"- `{e[:200]}`" for e in errors[:10]], ""]
    captions = {"ttft_cdf.png": "Time to first token, CDF per point",
                "itl_cdf.png": "Inter-token latency, CDF per point",
                "throughput.png": "Throughput against the load",
                "latency.png": "Latency against the load"}
    for name in plots:
        lines += [f"## {captions.get(name, name)}", "", f"![{captions.get(name, name)}]({name})",
                  ""]
    for d in panels:
        lines += [f"## Prometheus: {d['dashboard']}", "",
                  f"![{d['dashboard']}]({d['file']})", ""]
        if d["empty"]:
            lines += ["Panels with no data over the run: " + ", ".join(d["empty"]) + ".", ""]
        if d["errors"]:
            lines += ["Queries that failed:", "", *[f"- `{e[:300]}`" for e in d["errors"]], ""]
    return "\n".join(lines)


def write_report(out: Path, result: dict, prometheus: str | None = None,
                 prom_vars: dict[str, str] | None = None, rate_interval: str = "1m",
                 dashboards: Path | None = None) -> dict:
    """Writes everything into `out`; returns the file names written."""
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(out, result)
    panels = []
    if prometheus:
        from loadtest.prometheus import DASHBOARDS, prometheus_panels

        points = [(p["start_time"], p["end_time"], point_label(p)) for p in result["points"]]
        panels = prometheus_panels(out, prometheus, points, prom_vars or {}, rate_interval,
                                   dashboards or DASHBOARDS)
        result["prometheus"] = {"url": prometheus, "rate_interval": rate_interval,
                                "dashboards": panels}
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "report.md").write_text(markdown(result, plots, panels))
    return {"result": "result.json", "report": "report.md", "plots": plots,
            "panels": [d["file"] for d in panels]}
