"""Elastic pools under load: how long a pool takes to grow, how long a migrated request
pauses, and what scaling costs the requests being served.

`splitstack serve` on Ray (1 attention service, 1 MLP replica, 1 prefill replica, grpc) in a
subprocess on loopback, under `--streams` concurrent greedy streams for the whole run. Each
round resizes every pool through the admin API, one at a time: `PUT replicas 2`, wait until
both members are ready, a steady stretch, `PUT replicas 1`, wait until one is left, a steady
stretch. The server runs with `--drain-timeout 1`, so an attention service leaving with
requests still running kills them over to the other (a migration) after a second; MLP and
prefill members leave once idle.

Printed per round and as the median of `--rounds`:
- PUT -> ready: seconds from the PUT to both members ready, per pool;
- migration pause p50 and p99: last token before the move to the first after it, from the
  server's `splitstack_migration_pause_seconds` histogram (interpolated within buckets, as
  PromQL's histogram_quantile);
- TTFT and ITL p50 and p99 of the requests that started (TTFT) or tokens that arrived (ITL)
  during a scale event (from the PUT to 2 s after the pool settled) against the rest
  (steady state), measured by the client.

    python -m bench.serving.elastic [--rounds 5] [--streams 8] [--max-tokens 48]
                            [--model models/zoo/smollm2-135m] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import MODEL, ServeProcess
from services.deployment.autoscale import quantile_between

POOLS = ("mlp", "prefill", "attention")
SETTLE_MARGIN_S = 2.0


class Streams:
    """`n` clients streaming greedy completions back to back on their own event loop (in a
    thread); every request's start, token arrival times and error are kept."""

    def __init__(self, base: str, model: str, n: int, max_tokens: int):
        self.base, self.model, self.n, self.max_tokens = base, model, n, max_tokens
        self.requests: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _client(self, http: httpx.AsyncClient, i: int) -> None:
        k = 0
        while not self.stop.is_set():
            words = " ".join(f"w{(i * 31 + k * 7 + j) % 97}" for j in range(24 + 8 * (k % 5)))
            body = {"model": self.model, "prompt": f"Request {i}-{k}: {words}",
                    "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            k += 1
            record = {"start": time.monotonic(), "tokens": [], "error": None}
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        record["error"] = f"HTTP {r.status_code}"
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            record["error"] = event["error"]["message"]
                            break
                        record["tokens"].append(time.monotonic())
            except httpx.HTTPError as err:
                record["error"] = f"{type(err).__name__}: {err}"
            self.requests.append(record)

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=300) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.n)))

    def __enter__(self) -> Streams:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=600)


def members(base: str, pool: str) -> list[str]:
    view = httpx.get(base + "/admin/pools", timeout=30).json()["data"]
    return [m["state"] for m in next(p for p in view if p["pool"] == pool)["members"]]


def resize(base: str, pool: str, n: int, timeout: float = 600) -> float:
    """PUT the pool to `n`; seconds until it has exactly `n` members, all ready."""
    start = time.monotonic()
    r = httpx.put(f"{base}/admin/pools/{pool}", json={"replicas": n}, timeout=30)
    r.raise_for_status()
    while members(base, pool) != ["ready"] * n:
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"{pool} did not reach {n} ready members: {members(base, pool)}")
        time.sleep(0.1)
    return time.monotonic() - start


def pause_buckets(base: str) -> list[tuple[float, float]]:
    text = httpx.get(base + "/metrics", timeout=30).text
    out = []
    for line in text.splitlines():
        if line.startswith("splitstack_migration_pause_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((float(le), float(line.rsplit(" ", 1)[1])))
    return sorted(out)


def pctl(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def latencies(requests: list[dict], windows: list[tuple[float, float]], since: float,
              until: float) -> dict:
    """TTFT and ITL (ms) inside the scale windows and outside them, for requests that
    started in [since, until)."""
    inside = lambda t: any(a <= t <= b for a, b in windows)      # noqa: E731
    out = {"scale": {"ttft": [], "itl": []}, "steady": {"ttft": [], "itl": []}}
    for r in requests:
        if not since <= r["start"] < until or not r["tokens"] or r["error"]:
            continue
        out["scale" if inside(r["start"]) else "steady"]["ttft"].append(
            (r["tokens"][0] - r["start"]) * 1e3)
        for a, b in zip(r["tokens"], r["tokens"][1:]):
            out["scale" if inside(b) else "steady"]["itl"].append((b - a) * 1e3)
    return {phase: {f"{k} p{int(q * 100)}": pctl(v, q) for k, v in d.items()
                    for q in (0.5, 0.99)} for phase, d in out.items()}


def one_round(base: str, streams: Streams, steady_s: float) -> dict:
    since = time.monotonic()
    before = pause_buckets(base)
    windows, ready = [], {}
    time.sleep(steady_s)
    for pool in POOLS:
        start = time.monotonic()
        ready[pool] = resize(base, pool, 2)
        windows.append((start, time.monotonic() + SETTLE_MARGIN_S))
        time.sleep(steady_s)
        start = time.monotonic()
        resize(base, pool, 1)
        windows.append((start, time.monotonic() + SETTLE_MARGIN_S))
        time.sleep(steady_s)
    until = time.monotonic()
    after = pause_buckets(base)
    moved = (after[-1][1] - dict(before).get(float("inf"), 0.0)) if after else 0.0
    return {"put_to_ready_s": ready, "migrations": moved,
            "migration_pause_ms": {f"p{int(q * 100)}": (None if (v := quantile_between(
                before, after, q)) is None else v * 1e3) for q in (0.5, 0.99)},
            "latency_ms": latencies(streams.requests, windows, since, until)}


def median(rounds: list[dict], *path) -> float | None:
    values = []
    for r in rounds:
        for key in path:
            r = r.get(key) if isinstance(r, dict) else None
        if r is not None:
            values.append(r)
    return statistics.median(values) if values else None


def fmt(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--steady-s", type=float, default=6.0, help="steady stretch between events")
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", help="write every round's figures here (JSON)")
    args = ap.parse_args()

    flags = ["--model", args.model, "--disaggregated", "--prefill-replicas", "1",
             "--max-num-seqs", str(max(8, args.streams)), "--max-replicas", "4",
             "--drain-timeout", "1", "--served-model-name", "smollm2"]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp, \
            ServeProcess(flags, Path(tmp) / "serve.log") as server, \
            Streams(server.base, "smollm2", args.streams, args.max_tokens) as streams:
        while len(streams.requests) < args.streams:          # warm: every client served
            time.sleep(0.2)
        for i in range(args.rounds):
            r = one_round(server.base, streams, args.steady_s)
            rounds.append(r)
            lat = r["latency_ms"]
            print(f"round {i + 1}: PUT->ready "
                  + ", ".join(f"{p} {s:.1f}s" for p, s in r["put_to_ready_s"].items())
                  + f"; migrations {r['migrations']:.0f}, pause p50 "
                  f"{fmt(r['migration_pause_ms']['p50'])} ms p99 "
                  f"{fmt(r['migration_pause_ms']['p99'])} ms; TTFT p99 steady "
                  f"{fmt(lat['steady']['ttft p99'])} / scale {fmt(lat['scale']['ttft p99'])} "
                  f"ms", flush=True)
        failed = [r["error"] for r in streams.requests if r["error"]]
    total = len(streams.requests)

    print(f"\nelastic pools, median of {len(rounds)} rounds ({args.streams} streams, "
          f"{args.max_tokens} tokens each; {total} requests, {len(failed)} failed)\n")
    print("| pool | PUT -> 2 ready (s) |\n|---|---|")
    for pool in POOLS:
        print(f"| {pool} | {fmt(median(rounds, 'put_to_ready_s', pool), 1)} |")
    print(f"\nmigrations per round: {fmt(median(rounds, 'migrations'))}; migration pause "
          f"p50 {fmt(median(rounds, 'migration_pause_ms', 'p50'))} ms, p99 "
          f"{fmt(median(rounds, 'migration_pause_ms', 'p99'))} ms\n")
    print("| phase | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |")
    print("|---|---|---|---|---|")
    for phase in ("steady", "scale"):
        cells = [fmt(median(rounds, "latency_ms", phase, key))
                 for key in ("ttft p50", "ttft p99", "itl p50", "itl p99")]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    if failed:
        print(f"\nfailed requests: {failed[:5]}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": rounds, "requests": total,
                                              "failed": failed}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
