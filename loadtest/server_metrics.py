"""The server's own counters over a sweep point, without Prometheus: `GET /metrics`
(Prometheus text format, which splitstack and vLLM serve), and that of each member a
splitstack Ray deployment lists for discovery (`GET /admin/scrape-targets`, as Prometheus
finds them), before and after the point, and
the increase of every splitstack_* and vllm:* counter between the two, histograms'
`_sum` and `_count` included (their buckets left out). A counter that went down was
reset (the server restarted): its increase is its value after, as Prometheus's
`increase()` counts it."""
from __future__ import annotations

import httpx

PREFIXES = ("splitstack_", "vllm:")


def parse_counters(text: str) -> dict[str, float]:
    """{series: value} of the counters in a Prometheus text exposition; a series is the
    metric name with its labels as written (`name{a="1"}`)."""
    kinds: dict[str, str] = {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                kinds[parts[2]] = parts[3]
            continue
        if not line.strip() or line.startswith("#"):
            continue
        if "{" in line:
            close = line.rfind("}")
            series, rest = line[:close + 1], line[close + 1:]
        else:
            series, _, rest = line.partition(" ")
        name = series.split("{", 1)[0].strip()
        if not name.startswith(PREFIXES) or not rest.split():
            continue
        if not (kinds.get(name) == "counter" or kinds.get(base(name, "_total")) == "counter"
                or kinds.get(base(name, "_sum")) in ("histogram", "summary")
                or kinds.get(base(name, "_count")) in ("histogram", "summary")):
            continue
        try:
            out[series.strip()] = float(rest.split()[0])
        except ValueError:
            continue
    return out


def base(name: str, suffix: str) -> str | None:
    return name[:-len(suffix)] if name.endswith(suffix) else None


def scrape(url: str, headers: dict, timeout: float = 10.0) -> dict[str, float] | None:
    """The counters at `url`/metrics now, with its members' (each series of theirs carries
    a `member` label); None when the server has no such route. A member that does not
    answer within 2 s (out of reach from where the load runs, say) is left out."""
    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=timeout)
        if r.status_code != 200:
            return None
        out = parse_counters(r.text)
        sd = httpx.get(url + "/admin/scrape-targets", headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return None
    groups = sd.json() if sd.status_code == 200 else []       # other servers: no members
    for member in (t for g in groups for t in g["targets"]):
        try:
            m = httpx.get(f"http://{member}/metrics", timeout=min(timeout, 2.0))
        except httpx.HTTPError:
            continue
        if m.status_code == 200:
            out.update(parse_counters(m.text))
    return out


def increase(before: dict[str, float] | None,
             after: dict[str, float] | None) -> dict[str, float] | None:
    """Each counter's increase from `before` to `after` (a series new in `after` counts
    from 0); None when either scrape failed."""
    if before is None or after is None:
        return None
    out = {}
    for series, value in sorted(after.items()):
        was = before.get(series, 0.0)
        out[series] = value - was if value >= was else value
    return out
