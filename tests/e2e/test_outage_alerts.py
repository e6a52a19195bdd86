"""A whole outage as an on-call engineer would see it: the Ray deployment (SmolLM2, one
attention service, one MLP pool replica) serves a steady load, then its only attention
service is killed while the load goes on. The gateway answers 503 ("no attention service
is available"); a real Prometheus scraping the gateway every second, with the committed
recording and alert rules (their windows and `for:` shortened to seconds, nothing else
changed), shows the 503s in `splitstack_http_requests_total` and fires
`SplitstackAvailabilityFastBurn`, which was silent while the deployment served."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from services.deployment.ray_cluster import ClusterConfig
from services.deployment.server import build_cluster
from tests.helpers.gateway import MODEL, ZOO, running
from tests.helpers.prometheus import PROMETHEUS_DIR, running_prometheus

pytestmark = pytest.mark.slow

# the rules' windows and `for:` durations, scaled from hours and minutes to seconds
SHORT = {"3d": "60s", "1d": "40s", "6h": "30s", "2h": "20s", "1h": "20s", "30m": "10s",
         "10m": "10s", "5m": "5s", "2m": "2s", "1m": "1s", "15m": "15s"}
ALERT = "SplitstackAvailabilityFastBurn"


def short_rules(out):
    """Copies of deploy/prometheus/rules/*.yml with every range and `for:` in seconds."""
    out.mkdir()
    for path in (PROMETHEUS_DIR / "rules").glob("*.yml"):
        text = re.sub(r"\[(\d+[mhd])\]", lambda m: f"[{SHORT[m.group(1)]}]", path.read_text())
        text = re.sub(r"\[(\d+[mhd]):(\d+[mhd])\]",
                      lambda m: f"[{SHORT[m.group(1)]}:{SHORT[m.group(2)]}]", text)
        text = re.sub(r"for: (\d+[mhd])", lambda m: f"for: {SHORT[m.group(1)]}", text)
        (out / path.name).write_text(text)
    return out


class Load:
    """Completions one after another from two threads until stopped; keeps each status."""

    def __init__(self, base: str):
        self.base, self.codes, self.stop = base, [], threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(2)]

    def run(self):
        with httpx.Client(base_url=self.base, timeout=60) as client:
            while not self.stop.is_set():
                r = client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "Name a colour:", "max_tokens": 4,
                    "temperature": 0})
                self.codes.append(r.status_code)
                if r.status_code != 200:
                    time.sleep(0.2)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


def firing(prom, job: str) -> bool:
    found = prom.query(f'ALERTS{{alertname="{ALERT}", alertstate="firing", job="{job}"}}')
    return bool(found)


def test_killing_every_attention_service_fires_the_availability_alert(ray_session,
                                                                       tmp_path):
    config = ClusterConfig(model=str(ZOO), attention_shards=1, kv_splits=1, mlp_replicas=1,
                           transport="grpc", kv_cache_bytes=64 << 20, max_num_seqs=4)
    app, cluster = build_cluster(config, served_name=MODEL)
    try:
        with running(app) as base, running_prometheus(
                {"outage": base.removeprefix("http://")}, tmp_path,
                rules_dir=short_rules(tmp_path / "rules")) as prom, Load(base) as load:
            prom.wait_for('sum(splitstack_http_requests_total{job="outage", code="200"})',
                          lambda r: r and float(r[0]["value"][1]) >= 4, timeout=180)
            # a few evaluations of every window over healthy traffic: no page
            time.sleep(8)
            assert not firing(prom, "outage")
            served = len(load.codes)
            ray_session.kill(cluster.attention[0])
            prom.wait_for('sum(splitstack_http_requests_total{job="outage", '
                          'route="/v1/completions", code="503"})',
                          lambda r: r and float(r[0]["value"][1]) >= 3, timeout=120)
            prom.wait_for(f'ALERTS{{alertname="{ALERT}", alertstate="firing", '
                          f'job="outage"}}', bool, timeout=120)
        assert 200 in load.codes[:served]
        assert 503 in load.codes[served:]
    finally:
        cluster.shutdown()
