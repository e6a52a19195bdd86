"""A real Prometheus on loopback (Debian's `prometheus`, installed by `make setup`) with the
committed scrape config and rules of deploy/prometheus/, and Grafana dashboards' panel
queries evaluated through its HTTP API."""
from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"

# Grafana's built-in interval variables, as a dashboard over the last hours would resolve
# them: rate windows that hold the whole of a short test's load, however slow the machine
BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__interval_ms": "60000",
            "__range": "1h", "__range_s": "3600", "__range_ms": "3600000", "__auto": "1m"}
VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def binary(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: `make setup` installs Debian's prometheus"
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str) -> list[dict]:
        """The instant vector (or scalar) `expr` evaluates to now; raises on a bad query."""
        resp = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = resp.json()
        if body.get("status") != "success":
            raise ValueError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        params = {"match[]": match} if match else None
        resp = httpx.get(f"{self.url}/api/v1/label/{label}/values", params=params, timeout=30)
        return resp.json()["data"]

    def wait_for(self, expr: str, ok, timeout: float = 60.0) -> list[dict]:
        deadline = time.time() + timeout
        while True:
            result = self.query(expr)
            if ok(result):
                return result
            if time.time() > deadline:
                raise AssertionError(f"{expr!r} never satisfied the condition: {result}")
            time.sleep(0.5)


@contextlib.contextmanager
def running_prometheus(targets: dict[str, str], workdir: Path, interval: str = "1s",
                       rules_dir: Path | None = None):
    """Prometheus on a free loopback port scraping each gateway of `targets` (job name ->
    host:port) every `interval`, and the members that gateway lists for discovery, with
    deploy/prometheus/prometheus.yml's jobs (paths, labels, relabelling) and rules,
    evaluated as often; `rules_dir`: the rule files of that name taken from there instead
    (rewritten copies). Yields a `Prometheus`."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    config["rule_files"] = [str(rules_dir / Path(f).name if rules_dir else PROMETHEUS_DIR / f)
                            for f in config["rule_files"]]
    gateway, members = config["scrape_configs"]
    static = gateway["static_configs"][0]
    local = static["targets"][0]
    config["scrape_configs"] = []
    for name, target in targets.items():
        sd = [dict(c, url=c["url"].replace(local, target), refresh_interval=interval)
              for c in members["http_sd_configs"]]
        relabel = [dict(r, replacement=name) if r["target_label"] == "job" else r
                   for r in members["relabel_configs"]]
        config["scrape_configs"] += [
            dict(gateway, job_name=name, static_configs=[dict(static, targets=[target])]),
            dict(members, job_name=f"{name}-members", http_sd_configs=sd,
                 relabel_configs=relabel)]
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen([binary("prometheus"), f"--config.file={path}",
                             f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()
            assert time.time() < deadline, "Prometheus did not become ready in 60 s"
            time.sleep(0.2)
        yield Prometheus(url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# ---- Grafana dashboards --------------------------------------------------------------
@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    expr: str


def dashboards() -> dict[str, dict]:
    """Every dashboard JSON under deploy/grafana/ (by file name)."""
    found = {p.name: json.loads(p.read_text()) for p in sorted(GRAFANA_DIR.rglob("*.json"))}
    return {name: d for name, d in found.items()
            if isinstance(d, dict) and "panels" in d and "schemaVersion" in d}


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or ())      # a collapsed row's panels


def panel_queries(name: str, dashboard: dict) -> list[PanelQuery]:
    return [PanelQuery(name, panel.get("title") or f"panel {panel.get('id')}", target["expr"])
            for panel in _panels(dashboard.get("panels") or ())
            for target in panel.get("targets") or () if target.get("expr")
            and not target.get("hide")]


def variable_values(dashboard: dict, prom: Prometheus) -> dict[str, str]:
    """Each template variable as Grafana substitutes it with every value selected: a query
    variable's values from Prometheus (`label_values(metric, label)` or `label_values(label)`)
    as a regex alternation, or its `allValue`; a custom or constant one's current value."""
    out = {}
    for var in (dashboard.get("templating") or {}).get("list") or ():
        name, kind = var["name"], var.get("type")
        if kind == "datasource":
            continue
        if kind == "query":
            query = var.get("query")
            query = query.get("query", "") if isinstance(query, dict) else query or ""
            found = re.match(r"\s*label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)\s*$", query)
            assert found, f"variable {name}: no label_values query ({query!r})"
            match = found.group(1) and substitute(found.group(1), out)   # earlier variables
            values = prom.label_values(found.group(2), match)
            if var.get("includeAll") and var.get("allValue"):
                out[name] = var["allValue"]
            elif values:
                out[name] = "(" + "|".join(re.escape(v) for v in values) + ")" \
                    if var.get("multi") or var.get("includeAll") else values[0]
            else:
                out[name] = ".*"
        else:
            current = (var.get("current") or {}).get("value") or var.get("query") or ""
            out[name] = current if isinstance(current, str) else "|".join(current)
    return out


def substitute(expr: str, variables: dict[str, str]) -> str:
    values = {**BUILTINS, **variables}

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        assert name in values, f"unknown variable ${name} in {expr!r}"
        return values[name]

    return VARIABLE.sub(one, expr)


def empty_panels(prom: Prometheus, queries: list[PanelQuery],
                 variables: dict[str, dict[str, str]], numbers: bool = False) -> list[str]:
    """The queries (dashboard, panel, PromQL as sent) that fail or return nothing; with
    `numbers`, also those whose every value is NaN (a quantile of a histogram that observed
    nothing in the window: Grafana draws no line)."""
    bad = []
    for q in queries:
        expr = substitute(q.expr, variables[q.dashboard])
        try:
            result = prom.query(expr)
        except ValueError as err:
            bad.append(f"{q.dashboard} / {q.panel}: {err}")
            continue
        if not result:
            bad.append(f"{q.dashboard} / {q.panel}: no data for {expr}")
        elif numbers and all(math.isnan(float(r["value"][1])) for r in result):
            bad.append(f"{q.dashboard} / {q.panel}: only NaN for {expr}")
    return bad
