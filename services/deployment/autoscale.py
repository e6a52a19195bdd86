"""The autoscaler: each pool's desired size from its members' load, within bounds.

`--autoscale attention=1:4,mlp=1:4,prefill=1:2` gives each autoscaled pool its min:max.
Every `interval_s` the pool manager's thread hands `Autoscaler.decide` one `Window`: what the
pools' members did since the last one (their polled load, and the deltas of their own
Prometheus histograms), and the gateway's TTFT and ITL over it. For each pool it answers at
most one step, up or down by one member, with the reason in words:

- attention: up when the fullest service's KV usage passes `kv_high` or requests wait for a
  slot (or ITL p95 is over `--slo-itl-ms`); down when every service is under `kv_low` with
  nothing waiting;
- mlp: a replica's stage latency against the pool's idle baseline (the lowest mean stage
  latency seen at `busy_low` or less) and its busy share of the window (stage seconds per
  wall second); up when the latency is `latency_high` times the baseline or a replica is
  busier than `busy_high` (or ITL p95 is over the SLO), down when every replica is under
  `busy_low` with the latency back near the baseline;
- prefill: up when prompts queue (`waiting` per replica over `queue_high`) or TTFT p95 is
  over `--slo-ttft-ms`; down when nothing queued or ran through the window.

A pool that changed waits `cooldown_s` before its next change, and a pool with a member still
starting or draining does not change at all (Dynamo's planner blocks the same way). The
manager logs each decision with its reason and counts it in
`splitstack_scale_events_total{pool,direction,reason="autoscale"}`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

POOLS = ("attention", "mlp", "prefill")


class AutoscaleError(ValueError):
    """A malformed `--autoscale` value."""


def parse_autoscale(text: str) -> dict[str, tuple[int, int]]:
    """"attention=1:4,mlp=1:4" -> {"attention": (1, 4), "mlp": (1, 4)}."""
    bounds: dict[str, tuple[int, int]] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        pool, sep, span = part.partition("=")
        low, colon, high = span.partition(":")
        if not sep or not colon:
            raise AutoscaleError(f"{part!r}: expected POOL=MIN:MAX, e.g. mlp=1:4")
        if pool not in POOLS:
            raise AutoscaleError(f"{part!r}: no pool {pool!r}; pools: {', '.join(POOLS)}")
        if pool in bounds:
            raise AutoscaleError(f"{part!r}: pool {pool} given twice")
        try:
            lo, hi = int(low), int(high)
        except ValueError:
            raise AutoscaleError(f"{part!r}: MIN and MAX must be integers") from None
        if lo < 1:
            raise AutoscaleError(f"{part!r}: a pool keeps at least 1 member (a deployment "
                                 "started without prefill replicas prefills through the MLP "
                                 "pool, and a pool at 0 could not serve)")
        if hi < lo:
            raise AutoscaleError(f"{part!r}: MAX is under MIN")
        bounds[pool] = (lo, hi)
    if not bounds:
        raise AutoscaleError("--autoscale names no pool; e.g. attention=1:4,mlp=1:4")
    return bounds


@dataclass
class Policy:
    """The thresholds (defaults for this project's CPU and GPU deployments alike)."""
    interval_s: float = 10.0
    cooldown_s: float = 30.0
    kv_high: float = 0.80
    kv_low: float = 0.30
    busy_high: float = 0.80
    busy_low: float = 0.25
    latency_high: float = 2.0
    queue_high: float = 1.0
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None


@dataclass
class Window:
    """What one interval saw. `members[pool]`: one dict per ready member (its polled load;
    mlp members also `stage_s`, `stage_calls`, `rows`, `batches` over the window)."""
    seconds: float
    members: dict[str, list[dict]] = field(default_factory=dict)
    busy: dict[str, bool] = field(default_factory=dict)    # a member starting or draining
    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None


@dataclass
class Decision:
    pool: str
    replicas: int
    direction: str      # "up" | "down"
    why: str


class Autoscaler:
    def __init__(self, bounds: dict[str, tuple[int, int]], policy: Policy | None = None):
        self.bounds, self.policy = dict(bounds), policy or Policy()
        self.changed_at: dict[str, float] = {}
        self.baseline_s: float | None = None          # mlp: idle mean stage latency

    def decide(self, now: float, window: Window, desired: dict[str, int]) -> list[Decision]:
        out = []
        for pool, (low, high) in self.bounds.items():
            members = window.members.get(pool, [])
            if window.busy.get(pool) or not members:
                continue
            if now - self.changed_at.get(pool, -1e18) < self.policy.cooldown_s:
                continue
            want = getattr(self, f"_{pool}")(members, window)
            if want is None:
                continue
            step, why = want
            n = desired[pool]
            target = min(max(n + step, low), high)
            if target == n:
                continue
            self.changed_at[pool] = now
            out.append(Decision(pool, target, "up" if target > n else "down", why))
        return out

    # ---- per-pool signals -> (+1 | -1, why) or None ----------------------------------
    def _slo(self, window: Window, which: str) -> str | None:
        p = self.policy
        value, slo = ((window.ttft_p95_s, p.slo_ttft_s) if which == "ttft"
                      else (window.itl_p95_s, p.slo_itl_s))
        if slo is not None and value is not None and value > slo:
            return f"{which.upper()} p95 {value * 1e3:.0f} ms over the {slo * 1e3:.0f} ms SLO"
        return None

    def _attention(self, members: list[dict], window: Window):
        p = self.policy
        kv = max(m.get("kv_usage", 0.0) for m in members)
        waiting = sum(m.get("waiting", 0) for m in members)
        if kv > p.kv_high:
            return 1, f"KV usage {kv:.0%} over {p.kv_high:.0%}"
        if waiting > 0:
            return 1, f"{waiting} requests waiting for a slot"
        if slo := self._slo(window, "itl"):
            return 1, slo
        if kv < p.kv_low:
            return -1, f"KV usage {kv:.0%} under {p.kv_low:.0%}, nothing waiting"
        return None

    def _mlp(self, members: list[dict], window: Window):
        p = self.policy
        busy = [m.get("stage_s", 0.0) / window.seconds for m in members]
        calls = sum(m.get("stage_calls", 0) for m in members)
        latency = (sum(m.get("stage_s", 0.0) for m in members) / calls) if calls else None
        rows = (sum(m.get("rows", 0) for m in members)
                / max(sum(m.get("batches", 0) for m in members), 1))
        if latency is not None and max(busy) <= p.busy_low:
            self.baseline_s = min(self.baseline_s or latency, latency)
        ratio = latency / self.baseline_s if latency and self.baseline_s else None
        if max(busy) > p.busy_high:
            return 1, (f"a replica busy {max(busy):.0%} of the window (over "
                       f"{p.busy_high:.0%}), {rows:.1f} rows a batch")
        if ratio is not None and ratio > p.latency_high:
            return 1, (f"stage latency {latency * 1e3:.1f} ms, {ratio:.1f}x its idle "
                       f"baseline, {rows:.1f} rows a batch")
        if calls and (slo := self._slo(window, "itl")):
            return 1, slo
        if max(busy) < p.busy_low and (ratio is None or ratio < p.latency_high / 1.5):
            return -1, f"every replica busy under {p.busy_low:.0%} of the window"
        return None

    def _prefill(self, members: list[dict], window: Window):
        p = self.policy
        queued = sum(m.get("waiting", 0) + m.get("calls", 0) for m in members) / len(members)
        if queued > p.queue_high:
            return 1, f"{queued:.1f} prompts queued per replica (over {p.queue_high:g})"
        if slo := self._slo(window, "ttft"):
            return 1, slo
        if all(m.get("prefilled", 0) == 0 for m in members) and queued == 0:
            return -1, "no prompt prefilled in the window"
        return None


# ---- reading the members' and the gateway's histograms ------------------------------------
def histogram_totals(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of the histogram `name` in a Prometheus exposition (all label sets)."""
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_sum":
                total += sample.value
            elif sample.name == name + "_count":
                count += sample.value
    return total, count


def bucket_counts(histogram) -> list[tuple[float, float]]:
    """A prometheus_client Histogram's cumulative (upper bound, count) pairs, now."""
    out = []
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                out.append((float(sample.labels["le"]), sample.value))
    return sorted(out)


def quantile_between(before: list[tuple[float, float]], after: list[tuple[float, float]],
                     q: float) -> float | None:
    """The q-quantile of what a histogram observed between two `bucket_counts` readings
    (linear within a bucket, as PromQL's histogram_quantile); None when it saw nothing."""
    prior = dict(before)
    counts = [(le, c - prior.get(le, 0.0)) for le, c in after]
    if not counts or counts[-1][1] <= 0:
        return None
    rank = q * counts[-1][1]
    lower_le, lower_c = 0.0, 0.0
    for le, c in counts:
        if c >= rank:
            if le == float("inf"):
                return lower_le
            if c == lower_c:
                return le
            return lower_le + (le - lower_le) * (rank - lower_c) / (c - lower_c)
        lower_le, lower_c = le, c
    return lower_le
