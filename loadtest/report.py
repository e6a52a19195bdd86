"""The run's outputs in one directory: `result.json` (the settings and, per sweep point,
`vllm bench serve`'s fields), `requests.jsonl` (one record per request sent),
`report.md` (the table and the plots) and the PNGs."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from loadtest.plots import point_label, write_plots

LOADS = {"concurrency": "closed loop, one point per concurrency",
         "rate": "open loop, one point per rate"}
COLUMNS = (("completed", "completed", "d"), ("failed", "failed", "d"),
           ("cancelled", "cancelled", "d"), ("req/s", "request_throughput", ".2f"),
           ("goodput req/s", "request_goodput", ".2f"),
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
    columns = [c for c in COLUMNS if c[1] != "request_goodput" or result.get("goodput")]
    head = ["point"] + [c[0] for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in result["points"]:
        lines.append("| " + " | ".join([point_label(p)] + [cell(p, k, f) for _, k, f in columns])
                     + " |")
    return lines


def load_line(r: dict) -> str:
    p = r["points"][0]
    line = f"- load: {LOADS[r['mode']]}"
    if r["mode"] == "rate":
        line += (", Poisson arrivals" if p["burstiness"] == 1.0
                 else f", gamma arrivals (burstiness {p['burstiness']:g})")
        if p["max_concurrency"]:
            line += f", at most {p['max_concurrency']} in flight"
    line += f"; each point at most {p['num_prompts']} requests and {r['max_seconds']:g} s"
    if r.get("num_warmups"):
        line += f", after {r['num_warmups']} warm-up requests"
    if r.get("goodput"):
        line += "; goodput SLOs " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in r["goodput"].items())
    return line


def markdown(result: dict, plots: list[str], panels: list[dict]) -> str:
    r = result
    settings = [f"- command: `{r.get('command', 'splitstack loadtest')}`",
                f"- server: {r['base_url']}, model `{r['model_id']}` "
                f"(context {r['max_model_len']})",
                f"- workload: `{r['workload']}`, seed {r['seed']}"
                + (f", reuse ratio {r['reuse_ratio']}" if r.get("reuse_ratio") is not None else "")
                + (f", extra body `{json.dumps(r['extra_body'])}`" if r["extra_body"] else ""),
                load_line(r),
                f"- client machine: {r.get('machine') or machine()}; date {r['date']} UTC"]
    lines = [f"# Load test: {r['workload']} against {r['model_id']}", "",
             *settings, "",
             "TTFT: time to first token; TPOT: time per output token after the first; ITL: "
             "time between streamed chunks; E2EL: end-to-end latency. Field names and "
             "definitions follow `vllm bench serve`; requests cancelled at the time bound "
             "count with their times cut at the cancel. The numbers of every point are in "
             "`result.json`, every request in `requests.jsonl`.", "", *table(r), ""]
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
    """Writes everything into `out`; returns the file names written. The points'
    per-request records ("requests") move from `result` to `requests.jsonl`."""
    out.mkdir(parents=True, exist_ok=True)
    write_requests(out / "requests.jsonl", result)
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
    return {"result": "result.json", "requests": "requests.jsonl", "report": "report.md",
            "plots": plots, "panels": [d["file"] for d in panels]}


def write_requests(path: Path, result: dict) -> None:
    """One JSON line per request of every point, with the point's index and label."""
    with path.open("w") as f:
        for i, p in enumerate(result["points"]):
            for record in p.pop("requests", []):
                f.write(json.dumps({"point": i, "point_label": point_label(p), **record}) + "\n")
            p["requests_file"] = path.name
